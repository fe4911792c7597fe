"""PyTorch's own context parallelism, for cp_train.py --implementation pytorch.

torch.distributed.tensor.experimental.context_parallel: inside it, SDPA runs as ring attention
over the CP mesh (set_rotate_method "alltoall": K/V passed round, as cp_train.py's RingAttention;
"allgather": as its AllGatherAttention), and x, y and the position ids are sharded in place along
the sequence (its load balancer: the same zigzag chunks as cp_train.py's positions()). torch DDP
divides each bucket by N and sums it: the mean cp_train.py's GradientBuckets reach by summing the
gradients of losses divided by N beforehand. CUDA only (cp_train.py's check_cp_args): its
sharding rules cover the flash/efficient/cudnn SDPA kernels, not CPU's. Not run here (no GPU in
this project's CI); written for NCCL, to be checked on one.
These are the methods that differ (the clip too: ContextParallel's takes its own buckets' flat
buffers); cp_train.py's TorchCP takes the rest (optimizer, checkpoint state) from its
ContextParallel class, and the model from its sdpa_gpt()."""
from contextlib import nullcontext

import torch
import torch.distributed as dist

from common.distributed import autocast, clip_grad_norm_
from common.metrics import activations
from common.model import compile_forward, num_params
from common.recompute import torch_checkpoint_blocks


class TorchCP:
    def __init__(self, config, args, device, state=None):
        # imported on use: torch's experimental CP modules cost about 0.5 s a process to import,
        # and only --implementation pytorch needs them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
        self.args = args
        self.device = device
        self.grid = torch.arange(dist.get_world_size()).view(-1, args.context_parallel_size)
        mesh_shape = tuple(self.grid.shape)
        mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("dp", "cp"))
        self.cp_mesh = mesh["cp"]
        if args.cp_mode == "ring":
            set_rotate_method("alltoall")
        else:
            set_rotate_method("allgather")
        _cp_options.enable_load_balance = args.load_balance
        self.model = self.sdpa_gpt(config)  # GPT's SDPA attention, which context_parallel replaces
        if state is not None:
            self.model.load_state_dict(state)
        # --compile: each block's forward; the attention core, whose SDPA context_parallel turns
        # into ring attention, runs eagerly (as in cp_train.py)
        compile_forward(self.model.transformer.h, args.compile, eager=["attn.attend"])
        torch_checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=[device.index], bucket_cap_mb=args.bucket_cap_mb,
            gradient_as_bucket_view=True)

    def sharded(self, x, y):
        """(x, y, pos) and the contexts that run SDPA as CP attention and shard x, y, pos in place
        along dims 1, 1, 0."""
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel
        pos = torch.arange(self.args.block_size, device=self.device)
        buffers = [x.clone(), y.clone(), pos]  # resized in place: no views of the caller's batch
        kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.CUDNN_ATTENTION]
        sharded = context_parallel(self.cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0],
                                   no_restore_buffers=set(buffers))
        return buffers, (sdpa_kernel(kernels), sharded)

    def forward_backward(self, x, y, sync):
        (x, y, pos), (kernels, sharded) = self.sharded(x, y)
        no_sync = nullcontext() if sync else self.ddp.no_sync()
        with kernels, sharded, no_sync:
            with activations.first(), autocast(self.args, self.device):
                _, loss = self.ddp(x, y, pos)
            # backward's SDPA ops run as CP attention too
            (loss / self.args.grad_accum_steps).backward()
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        (x, y, pos), (kernels, sharded) = self.sharded(x, y)
        self.model.eval()
        with kernels, sharded, autocast(self.args, self.device):
            _, loss = self.model(x, y, pos)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # Equal on every rank, as in ContextParallel; torch's reducer keeps its buckets to itself:
        # the norm takes each parameter's gradient.
        return clip_grad_norm_(None, [p.grad for p in self.model.parameters()], max_norm)

    def describe(self):
        dp_size, cp_size = self.grid.shape
        n_params = num_params(self.model) / 1e6
        return (f"DP {dp_size} x CP {cp_size}, torch context_parallel ({self.args.cp_mode}, "
                f"load balance {self.args.load_balance}), {n_params:.2f}M params, torch DDP")
