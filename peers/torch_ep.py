"""PyTorch has no expert parallelism: ep_train.py --implementation pytorch trains the same
mixture-of-experts GPT under torch.nn.parallel.DistributedDataParallel, every expert on every rank
(the layout of ep_train.py in one process), through the same loop. These are the methods that differ
from ep_train.py's EP; its TorchEP takes the rest (optimizer, eval) from EP."""
from contextlib import nullcontext

import torch
import torch.distributed as dist

from common.checkpoint import model_state_on_cpu, optimizer_state_by_name
from common.distributed import autocast, clip_grad_norm_
from common.metrics import activations
from common.model import GPT, num_params
from common.recompute import torch_checkpoint_blocks


class TorchEP:
    def __init__(self, config, args, device, state=None):
        self.model = GPT(config, seed=args.seed, device=device)
        self.args, self.device = args, device
        if state is not None:
            self.model.load_state_dict(state)
        # Each tensor with its one name, none stacked: what EP's configure_optimizer reads
        self.layout = [(p, [name], False) for name, p in self.model.named_parameters()]
        torch_checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        device_ids = [device.index] if device.type == "cuda" else None
        # Its reducer's buckets, 25 MiB by default, all-reduced as backward fills them: every
        # expert's gradient included (4 bytes a parameter of the whole model), an expert that got
        # no rows with its zeros
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=device_ids, gradient_as_bucket_view=True)

    def forward_backward(self, x, y, sync):
        with nullcontext() if sync else self.ddp.no_sync():
            with activations.first(), autocast(self.args, self.device):
                _, loss = self.ddp(x, y)
            aux_loss = self.model.aux_loss()
            load = self.model.expert_load().flatten()  # (L, E) -> (L*E,)
            objective = loss + self.args.aux_loss_coef * aux_loss
            (objective / self.args.grad_accum_steps).backward()  # DDP divides by the ranks
        return torch.cat([torch.stack([loss, aux_loss]), load]).detach().float()

    def clip_grad_norm_(self, max_norm):
        # Equal on every rank after DDP's all-reduce: no communication
        return clip_grad_norm_(None, [p.grad for p in self.model.parameters()], max_norm)

    def full_state(self, optimizer):
        """Every rank holds the whole model: rank 0 copies its state to its CPU memory."""
        if dist.get_rank() != 0:
            return None, None
        named = self.model.named_parameters()
        return model_state_on_cpu(self.model), optimizer_state_by_name(named, optimizer)

    def describe(self):
        config = self.model.config
        return (f"torch DDP, all {config.n_experts} experts on every rank, top-{config.top_k}, "
                f"{num_params(self.model) / 1e6:.2f}M params")
