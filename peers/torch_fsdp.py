"""PyTorch's own FSDP, for fsdp_train.py --implementation pytorch.

torch.distributed.fsdp.fully_shard (FSDP2) on every block and on the root does what fsdp_train.py's
FullyShardedGPT and ShardedAdamW do: each parameter a DTensor sharded on dim 0, all-gathered by
per-module hooks before use, its gradient reduce-scattered after backward; AdamW updates the local
shards. The full checkpoint goes through torch.distributed.checkpoint's state_dict helpers. These
are the methods that differ; fsdp_train.py's TorchFSDP takes the rest (eval) from its FSDP class."""
from functools import partial

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from common.checkpoint import set_adamw_state
from common.distributed import autocast, clip_grad_norm_
from common.metrics import activations
from common.model import GPT, compile_forward, configure_optimizer, num_params
from common.recompute import torch_checkpoint_blocks


class TorchFSDP:
    mesh = None  # fully_shard's default: every rank, one shard each (HSDP: a 2-D mesh)
    norm_group = None  # the ranks whose shards make up each gradient once: every rank

    def __init__(self, config, args, device, state=None):
        self.model = GPT(config, seed=args.seed, device=device)
        self.args, self.device = args, device
        if state is not None:  # every rank loads it whole; fully_shard keeps its dim-0 shards
            self.model.load_state_dict(state)
        if args.dtype == "bfloat16":  # gathers bf16, reduce-scatters fp32, as fsdp_train.py does
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()
        # --compile: each block's forward; fully_shard's hooks around it stay eager
        compile_forward(self.model.transformer.h, args.compile)
        # before fully_shard, as torch documents: its unshard before a block's backward also serves
        # the recompute
        torch_checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        for block in self.model.transformer.h:
            fully_shard(block, mesh=self.mesh, reshard_after_forward=args.reshard_after_forward,
                        mp_policy=mp)
        # the root stays gathered through backward, as fsdp_train.py's does
        fully_shard(self.model, mesh=self.mesh, reshard_after_forward=False, mp_policy=mp)

    def configure_optimizer(self, args, state=None):
        # DTensor parameters keep their global shapes, so the >= 2-dim decay rule applies unchanged
        betas = (args.beta1, args.beta2)
        named = self.model.named_parameters()
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        if state:  # a checkpoint's AdamW state, keyed by parameter name (empty before a step)
            for name, p in self.model.named_parameters():
                set_adamw_state(optimizer, p, state[name], partial(self.shard_like, p))
        return optimizer

    def shard_like(self, param, full):
        """This rank's piece of the full tensor, laid out like the DTensor param: each rank cuts it
        from its own full copy (src_data_rank=None: no communication)."""
        full = full.to(self.device)
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)

    def forward_backward(self, x, y, sync):
        with activations.first(), autocast(self.args, self.device):
            _, loss = self.model(x, y)
        (loss / self.args.grad_accum_steps).backward()  # FSDP2 reduce-scatters every micro-step too
        return loss.detach().float()

    def clip_grad_norm_(self, max_norm):
        # the local tensors of FSDP2's DTensor gradients: this rank's dim-0 rows, no padding
        grads = [p.grad.to_local() for p in self.model.parameters()]
        return clip_grad_norm_(grads, [], max_norm, group=self.norm_group)

    def full_state(self, optimizer):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # complete on rank 0
        model_state = get_model_state_dict(self.model, options=options)
        optimizer_state = get_optimizer_state_dict(self.model, optimizer, options=options)
        return model_state, optimizer_state.get("state", {})

    def describe(self):
        return f"{num_params(self.model) / 1e6:.2f}M params, torch FSDP2 (fully_shard)"
