"""PyTorch's own ZeRO, for zero3_train.py --implementation pytorch (stages 1 and 3; 2 has none).

Stage 3: torch.distributed.fsdp.fully_shard (FSDP2) on every block and on the root, in place of
ParamFetcher and ReduceToOwner: every tensor a Shard(0) DTensor (N slices, where zero3_train.py
gives each tensor whole to one owner), all-gathered before each group's forward and backward,
gradients reduce-scattered (averaged) on every micro-step; AdamW updates the local shards.
Stage 1: torch.nn.parallel.DistributedDataParallel (gradient buckets all-reduced during backward,
as GradientBuckets) with torch.distributed.optim.ZeroRedundancyOptimizer(AdamW), in place of
OwnedAdamW: each rank's AdamW over the whole parameters its greedy partition gives it (per param
group, largest first), then a broadcast from each owner (one per owner: the parameters are views
of a bucket per rank, parameters_as_bucket_view).
These are the methods that differ; zero3_train.py's TorchZeRO3 and TorchZeRO1 take the rest
(the optimizer of stage 3, eval, the partition banner) from its ZeRO3 and ZeRO1 classes."""
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, distribute_tensor

from common.checkpoint import model_state_on_cpu, set_adamw_state
from common.config import die
from common.distributed import autocast, clip_grad_norm_
from common.model import (FUSED_ADAMW, GPT, compile_forward, configure_optimizer, init_tensor,
                          num_params)
from common.metrics import activations
from common.recompute import torch_checkpoint_blocks


class TorchZeRO3:
    def __init__(self, config, args, device, state=None):
        self.args, self.device = args, device
        self.model = GPT(config, device="meta")
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        if args.dtype == "bfloat16":  # gathers bf16, as ParamFetcher broadcasts it
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()
        compile_forward(self.model.transformer.h, args.compile)  # fully_shard's hooks: eager
        torch_checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        for block in self.model.transformer.h:  # its unshard before backward serves the recompute
            fully_shard(block, mesh=self.mesh, mp_policy=mp)
        fully_shard(self.model, mesh=self.mesh, mp_policy=mp)
        self.model.to_empty(device=device)  # allocates only this rank's shards
        self.kept = list(self.model.named_parameters())
        with torch.no_grad():
            for name, p in self.kept:  # each rank cuts its shard from the full tensor
                if state is not None:
                    full = state[name]
                else:
                    full = init_tensor(name, p.shape, config, args.seed)
                p.copy_(self.local(p, full))

    def local(self, p, full):
        """Every rank has the full tensor: src_data_rank=None cuts this rank's shard, sending
        nothing."""
        full = full.to(self.device)
        return distribute_tensor(full, self.mesh, p.placements, src_data_rank=None).clone()

    def forward_backward(self, x, y, sync):
        with activations.first(), autocast(self.args, self.device):
            _, loss = self.model(x, y)
        (loss / self.args.grad_accum_steps).backward()  # reduce-scatters every micro-step, too
        return loss.detach().float()

    def clip_grad_norm_(self, max_norm):
        return clip_grad_norm_([p.grad.to_local() for p in self.model.parameters()], [], max_norm)

    def full_state(self, optimizer):
        """Every DTensor all-gathered whole on every rank (full_tensor(): a collective), one at a
        time; rank 0 copies each into its CPU memory before the next, the other ranks keep
        nothing. The tied wte/lm_head is one parameter: gathered once, one copy under both names."""
        rank0 = dist.get_rank() == 0
        model_state = model_state_on_cpu(self.model, gather=full_tensor, keep=rank0)
        optimizer_state = {}
        for name, p in self.model.named_parameters():
            state = optimizer.state[p]
            optimizer_state[name] = {k: on_rank0_cpu(full_tensor(v), rank0)
                                     for k, v in state.items()}
        if not rank0:
            return None, None
        return model_state, optimizer_state

    def describe(self):
        world_size = dist.get_world_size()
        return f"{num_params(self.model) / 1e6:.2f}M params, torch FSDP2 over {world_size} rank(s)"


def full_tensor(value):
    """A DTensor all-gathered whole (a collective); a plain tensor (AdamW's step) as it is."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.detach()


def on_rank0_cpu(value, rank0):
    """A copy of `value` in rank 0's CPU memory; None on the other ranks."""
    if rank0:
        return value.to("cpu", copy=True)
    return None


class TorchZeRO1:
    def __init__(self, config, args, device, state=None):
        self.model = GPT(config, seed=args.seed, device=device)
        self.args, self.device = args, device
        if state is not None:
            self.model.load_state_dict(state)
        if args.activation_checkpointing == "none":  # --compile: as in torch_ddp.py
            compile_forward([self.model], args.compile)
        else:
            compile_forward(self.model.transformer.h, args.compile)
        torch_checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        device_ids = [device.index] if device.type == "cuda" else None
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=device_ids, bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=True)

    def configure_optimizer(self, args, state=None):
        named = list(self.model.named_parameters())
        betas = (args.beta1, args.beta2)
        contract = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        optimizer = ZeroRedundancyOptimizer(contract.param_groups, torch.optim.AdamW,
                                            parameters_as_bucket_view=True, fused=FUSED_ADAMW)
        optimizer.state = optimizer.optim.state  # its own stays empty: the local AdamW's is ours
        self.owned = [p for group in optimizer.optim.param_groups for p in group["params"]]
        names = {p: n for n, p in named}
        if state:  # a checkpoint's AdamW state by name: each rank loads what it owns
            for p in self.owned:
                set_adamw_state(optimizer, p, state[names[p]], partial(self.local, p))
        # Rank 0 prints both partitions: ours (one greedy pass) and ZeRO's (one per param group).
        self.assign_owners([(n, p.shape) for n, p in named])
        for r, groups in enumerate(optimizer._partition_parameters()):
            params = [p for group in groups for p in group["params"]]
            if dist.get_rank() == 0:
                print(f"  ZeroRedundancyOptimizer's rank {r}: {len(params):3d} tensors, "
                      f"{4 * sum(p.numel() for p in params):>12,} bytes")
        return optimizer

    def forward_backward(self, x, y, sync):
        with nullcontext() if sync else self.ddp.no_sync():
            with activations.first(), autocast(self.args, self.device):
                _, loss = self.ddp(x, y)
            (loss / self.args.grad_accum_steps).backward()
        return loss.detach().float()

    def clip_grad_norm_(self, max_norm):
        # DDP left every gradient on every rank: each element once, from its owner in ZeRO's
        return clip_grad_norm_([p.grad for p in self.owned], [], max_norm)

    def full_state(self, optimizer):
        optimizer.consolidate_state_dict(to=0)  # collective: every rank's AdamW state to rank 0
        if dist.get_rank() != 0:
            return None, None
        state = optimizer.state_dict()["state"]  # by position in param_groups
        names = {p: n for n, p in self.model.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return model_state_on_cpu(self.model), {names[p]: state[i] for i, p in enumerate(params)}

    def describe(self):
        n = num_params(self.model) / 1e6
        return f"{n:.2f}M params, torch DDP + ZeroRedundancyOptimizer(AdamW)"


def check_args(args, custom_only):
    """zero3_train.py's flags that --implementation pytorch cannot honour: one line from rank 0
    (die), before anything is built. `custom_only`: {flag: the only value FSDP2 and
    ZeroRedundancyOptimizer give}."""
    if args.implementation != "pytorch":
        return
    if args.stage == 2:  # docs/zero3.md, "PyTorch's versions"
        die("--stage: 2 has no PyTorch peer (torch's nearest, FSDP2 with "
            "reshard_after_forward=False, also shards the parameters between steps: "
            "fsdp_train.py --implementation pytorch --reshard_after_forward false)")
    for flag, default in custom_only.items():  # FSDP2 shards every tensor, prefetches, frees
        if getattr(args, flag) != default:
            die(f"--{flag}: {str(getattr(args, flag)).lower()} is only supported by "
                "--implementation custom")
