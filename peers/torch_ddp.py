"""PyTorch's own DDP, for ddp_train.py --implementation pytorch.

torch.nn.parallel.DistributedDataParallel's C++ reducer does what ddp_train.py's GradientBuckets
does: buckets of bucket_cap_mb rebuilt in ready order, all-reduce from autograd hooks, no_sync for
gradient accumulation. These are the methods that differ (the clip too: DDP's takes its own
buckets' flat buffers); ddp_train.py's TorchDDP takes the rest (optimizer, eval, checkpoint state)
from its DDP class."""
from contextlib import nullcontext

import torch

from common.distributed import autocast, clip_grad_norm_
from common.metrics import activations
from common.model import GPT, compile_forward, num_params
from common.recompute import torch_checkpoint_blocks


class TorchDDP:
    def __init__(self, config, args, device, state=None):
        self.model = GPT(config, seed=args.seed, device=device)
        self.args, self.device = args, device
        if state is not None:
            self.model.load_state_dict(state)
        # --compile: the whole model; dynamo splits its graph at DDP's buckets (DDPOptimizer), so
        # their all-reduces still overlap backward. With --activation_checkpointing each block's
        # forward: traced, the hooks of torch's checkpoint recomputed the wrong tensors
        if args.activation_checkpointing == "none":
            compile_forward([self.model], args.compile)
        else:
            compile_forward(self.model.transformer.h, args.compile)
        torch_checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        device_ids = [device.index] if device.type == "cuda" else None
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=device_ids, bucket_cap_mb=args.bucket_cap_mb,
            gradient_as_bucket_view=True)

    def forward_backward(self, x, y, sync):
        with nullcontext() if sync else self.ddp.no_sync():
            with activations.first(), autocast(self.args, self.device):
                _, loss = self.ddp(x, y)
            (loss / self.args.grad_accum_steps).backward()
        return loss.detach().float()

    def clip_grad_norm_(self, max_norm):
        # Equal on every rank, as in DDP; torch's reducer keeps its buckets to itself: the norm
        # takes each parameter's gradient.
        return clip_grad_norm_(None, [p.grad for p in self.model.parameters()], max_norm)

    def describe(self):
        return f"{num_params(self.model) / 1e6:.2f}M params, torch DDP"
