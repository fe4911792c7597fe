"""DiLoCo: data parallelism that communicates every H steps (Douillard et al. 2023), by hand.

Every rank holds the whole model and trains it on its own rows of the global batch with its own
AdamW for --inner_steps H steps, sending nothing. Then the replicas average their
pseudo-gradients, θ_outer − θ_local (how far each has moved from the weights the window started
from), in one all-reduce; an outer Nesterov SGD steps θ_outer by that mean Δ (m = μm + Δ;
θ_outer −= lr·(Δ + μm); --outer_lr 0.7 and --outer_momentum 0.9, the paper's), and every replica
restarts from θ_outer. A last window shorter than H ends with an outer step too: the final weights
are θ_outer. Each replica's AdamW state persists across outer steps. Each replica clips its own
gradient by its own norm; the logged pre-clip grad norm is the replicas' mean, as the loss is.
  memory per rank:  24P bytes: fp32 params 4P + grads 4P + AdamW state 8P, as DDP's, + θ_outer 4P
                    + its momentum 4P
  communication:    one all-reduce of the 4P pseudo-gradient bytes every H steps, H times fewer
                    bytes than DDP's gradients; and every step one of 8 bytes, the loss and the
                    grad norm to log
Evaluation reads θ_outer, at any step. A checkpoint is written at an outer step only
(--checkpoint_interval a multiple of H): θ_outer as the model, which every script resumes, with
the outer momentum and each replica's AdamW; it resumes in DiLoCo at its world size only.

Run:
  python ddp_diloco_train.py                                # one replica; with --outer_lr 1
                                                            # --outer_momentum 0: plain AdamW
  torchrun --standalone --nproc_per_node=2 ddp_diloco_train.py   # 2 replicas (GPUs or CPU procs)
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 ddp_diloco_train.py  # 2 nodes x 8 GPUs (node_rank=1 on 2)
torch has no DiLoCo: --implementation pytorch is refused. Why H is 10 by default, and what it costs
in loss against DDP, measured: docs/ddp.md.
"""
import os
import time

import torch
import torch.distributed as dist

from common.checkpoint import (checkpoint, model_state_on_cpu, optimizer_state_by_name, resume,
                               set_adamw_state)
from common.config import check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import Batches, get_batch
from common.distributed import autocast, clip_grad_norm_, setup, setup_data, teardown
from common.metrics import MFU, Metrics, Profiler, activations, held_bytes, model_state_bytes
from common.model import GPT, compile_forward, configure_optimizer, num_params
from common.recompute import checkpoint_blocks


# ---- the strategy: inner steps without communication, an outer step every H -------------

class Bucket:
    """One flat gradient buffer; the .grad of each of its parameters is a view into it, so autograd
    accumulates straight into the buffer and the all-reduce needs no copy in or out."""

    def __init__(self, params):
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            view = self.buffer[offset: offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)  # rebuilt mid-accumulation: keep what was accumulated
            p.grad = view
            offset += p.numel()
        self.pending = len(params)  # gradients not yet accumulated in this backward
        self.work = None            # the in-flight async all-reduce


class DiLoCo:
    """The strategy behind the few methods the training loop calls: the whole GPT on every rank,
    trained by this rank alone between outer steps, and θ_outer with its momentum."""
    dp_group = None  # the ranks that split the batch: all of them

    def __init__(self, config, args, device, state=None):
        # Every rank builds the same weights: initialisation depends only on (seed, name), which
        # tests/test_ddp.py checks across ranks, so no broadcast of rank 0's parameters is needed.
        self.model = GPT(config, seed=args.seed, device=device)
        self.args, self.device = args, device
        if state is not None:  # a full checkpoint from any script (DiLoCo's holds θ_outer)
            self.model.load_state_dict(state)
        # --compile: each block's forward and the head (ln_f, lm_head, loss), as ddp_train.py
        compile_forward(self.model.transformer.h, args.compile)
        compile_forward([self.model], args.compile, method="head")
        checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # One flat gradient buffer: the clip's one tensor, and where the pseudo-gradient is
        # written and all-reduced at an outer step, when the gradients are spent.
        self.grads = Bucket(self.params)
        # θ_outer and its Nesterov momentum, flat like the gradients (8 bytes a parameter), with
        # a view shaped like each parameter
        self.outer = torch.cat([p.detach().flatten() for p in self.params])
        self.momentum = torch.zeros_like(self.outer)
        sizes = [p.numel() for p in self.params]
        self.outer_views = [v.view_as(p) for v, p in zip(self.outer.split(sizes), self.params)]
        momentum = self.momentum.split(sizes)
        self.momentum_views = [v.view_as(p) for v, p in zip(momentum, self.params)]

    def configure_optimizer(self, args, state=None):
        """This replica's own AdamW. From a DiLoCo checkpoint: this rank's AdamW state and the
        outer momentum; from any other script's: its AdamW state on every replica, momentum 0."""
        betas = (args.beta1, args.beta2)
        named = self.model.named_parameters()
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        if state is not None and "diloco" in state:
            replicas = len(state["diloco"]["inner"])
            if replicas != dist.get_world_size():  # each rank needs its own replica's AdamW
                die(f"--resume: the checkpoint holds {replicas} DiLoCo replicas, this run has "
                    f"{dist.get_world_size()}: resume it at {replicas} ranks (or in ddp_train.py)")
            for m, (name, _) in zip(self.momentum_views, self.model.named_parameters()):
                m.copy_(state["diloco"]["outer_momentum"][name])
            state = state["diloco"]["inner"][dist.get_rank()]
        if state is not None:  # a checkpoint's AdamW state, keyed by parameter name
            for name, p in self.model.named_parameters():
                set_adamw_state(optimizer, p, state[name], self.to_device)
        return optimizer

    def to_device(self, tensor):
        return tensor.to(self.device, copy=True)

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its loss. sync: unused, an inner step sends nothing."""
        with activations.first(), autocast(self.args, self.device):  # the bytes kept for backward
            _, loss = self.model(x, y)
        (loss / self.args.grad_accum_steps).backward()  # this replica's mean over its rows
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        # θ_outer, the model the replicas share: mid-window each replica's own weights have moved
        # on. Its views stand in for the parameters in this forward (torch.func, no copy).
        outer = {name: v for (name, _), v in zip(self.model.named_parameters(), self.outer_views)}
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = torch.func.functional_call(self.model, outer, (x, y))
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # This replica's own norm, clipping its own gradient: nothing to communicate. The flat
        # buffer is the one tensor the norm and the scaling take.
        return clip_grad_norm_(None, [self.grads.buffer], max_norm)

    @torch.no_grad()
    def outer_step(self, lr, momentum):
        """Every H steps (and after the last): average the replicas' pseudo-gradients, step
        θ_outer by Nesterov SGD, and restart every replica from it."""
        delta = self.grads.buffer  # the gradients are spent and zero: Δ goes here, no new memory
        grads = [p.grad for p in self.params]  # views of delta
        torch._foreach_copy_(grads, self.outer_views)
        torch._foreach_sub_(grads, self.params)  # this replica's θ_outer − θ_local
        delta.div_(dist.get_world_size(self.dp_group))  # its share of the mean
        # The one collective: every rank sends its 4P bytes of Δ/N and receives the others', and
        # each ends with their sum, the mean Δ (a ring sends about 2(N-1)/N x 4P bytes per rank),
        # as DDP's gradient all-reduce, once every H steps. Every replica started the window from
        # the same θ_outer, so the mean of θ_outer − θ_local is θ_outer less the replicas' mean.
        dist.all_reduce(delta, group=self.dp_group)
        self.momentum.mul_(momentum).add_(delta)  # m = μm + Δ
        delta.add_(self.momentum, alpha=momentum)  # Nesterov: the step looks ahead, Δ + μm
        self.outer.sub_(delta, alpha=lr)  # θ_outer −= lr·(Δ + μm)
        torch._foreach_copy_(self.params, self.outer_views)  # every replica restarts from θ_outer
        delta.zero_()  # the next inner step's gradients accumulate from zero

    def full_state(self, optimizer):
        """Written at an outer step, where every replica holds θ_outer: rank 0's model is the full
        format's, and its AdamW state too, so any script resumes the run. DiLoCo's own, under
        "diloco", resumes it bit for bit: the outer momentum, and each replica's AdamW state,
        gathered to rank 0 ((N-1) x 8P bytes, pickled) into its CPU memory."""
        named = list(self.model.named_parameters())
        inner = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(optimizer_state_by_name(named, optimizer), inner, dst=0)
        if dist.get_rank() != 0:
            return None, None
        momentum = {n: m.to("cpu", copy=True) for (n, _), m in zip(named, self.momentum_views)}
        adamw = dict(inner[0], diloco=dict(outer_momentum=momentum, inner=inner))
        return model_state_on_cpu(self.model), adamw

    def describe(self):
        args = self.args
        return (f"{num_params(self.model) / 1e6:.2f}M params, an outer step every "
                f"{args.inner_steps} steps (lr {args.outer_lr}, Nesterov momentum "
                f"{args.outer_momentum})")


def add_ddp_flags(group):
    group.add_argument("--inner_steps", type=int, default=10,
                       help="H: optimizer steps each replica takes alone between outer steps")
    group.add_argument("--outer_lr", type=float, default=0.7, help="the outer SGD's lr")
    group.add_argument("--outer_momentum", type=float, default=0.9,
                       help="the outer SGD's Nesterov momentum (0: none)")


def check_ddp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns the DP size."""
    if args.inner_steps < 1:
        die(f"--inner_steps: must be >= 1, got {args.inner_steps}")
    if not args.outer_lr > 0:
        die(f"--outer_lr: must be > 0, got {args.outer_lr}")
    if not 0 <= args.outer_momentum < 1:
        die(f"--outer_momentum: must be in [0, 1), got {args.outer_momentum}")
    if args.checkpoint_interval % args.inner_steps:  # between outer steps the replicas differ
        die(f"--checkpoint_interval: must be a multiple of --inner_steps ({args.inner_steps}), "
            f"got {args.checkpoint_interval}")
    if args.implementation == "pytorch":
        die("--implementation: custom only; torch has no DiLoCo (ddp_train.py --implementation "
            "pytorch: torch's DDP)")
    check_batch_split(args, world_size)
    return world_size


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("ddp", add_ddp_flags, argv)
    D = check_ddp_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank = rank * D // world_size
    rows = B // D  # rows per data-parallel rank
    micro = rows // A  # rows per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    model = DiLoCo(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    mfu = MFU(config, args, device, world_size)  # model FLOPs utilisation, per log line
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start, mfu=mfu)
    if rank == 0:
        print(f"ddp_diloco: {world_size} rank(s) on {device} in {args.dtype}, "
              f"{model.describe()}; global batch {B} x {T} tokens, "
              f"{A} micro-step(s) of {micro} rows per data-parallel rank", flush=True)

    @torch.no_grad()
    def evaluate():
        """Mean loss over eval_iters fixed batches per split: each data-parallel rank evaluates
        its rows of each batch, and the means are averaged over those ranks (equal rows: the
        global mean)."""
        out = {}
        for split in ("train", "val"):
            total = torch.zeros((), device=device)
            for i in range(args.eval_iters):
                x, y = get_batch(split, i, B, T, args.seed + 1, args.dataset)
                x, y = x[mine].to(device), y[mine].to(device)
                total += model.eval_loss(x, y)
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=model.dp_group)
            out[split] = total.item() / args.eval_iters
        return out

    # ---- training loop -------------------------------------------------------------------
    profiler = Profiler(args, rank)
    batches = Batches(args, mine, device)  # the training batches, one step ahead
    for step in range(start, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            metrics.eval(step, evaluate())
        t0 = time.perf_counter()
        lr = get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batches.get(step)  # this rank's rows, on the device
        loss_sum = torch.zeros((), device=device)
        for j in range(A):  # this replica's rows alone: nothing is sent
            part = slice(j * micro, (j + 1) * micro)
            loss_sum += model.forward_backward(x[part], y[part], sync=j == A - 1)
        batches.prefetch(step + 1)  # built and copied while the device runs this step
        norm = model.clip_grad_norm_(args.grad_clip)  # this replica's own pre-clip norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # zero in place: gradients that are views stay views
        if (step + 1) % args.inner_steps == 0 or step + 1 == args.max_iters:
            model.outer_step(args.outer_lr, args.outer_momentum)
        # Logged loss: the mean over all B*T tokens of the global batch (equal chunks: mean of
        # means); logged norm: the replicas' mean. Both in one all-reduce of 8 bytes.
        logged = torch.stack([loss_sum / A, norm])
        dist.all_reduce(logged, op=dist.ReduceOp.AVG, group=model.dp_group)
        loss, norm = logged.tolist()  # the step's one host sync
        dt = time.perf_counter() - t0  # the step's kernels have run
        metrics.step(step, loss, lr, norm, B * T, dt, device, args.log_interval)
        profiler.step()
        if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0:
            checkpoint(step + 1, model, optimizer, config, args)
    profiler.stop()

    if args.eval_interval:
        metrics.eval(args.max_iters, evaluate())
    checkpoint(args.max_iters, model, optimizer, config, args)
    outer_bytes = held_bytes([model.outer, model.momentum])  # 8 bytes a parameter
    metrics.summary(model_state_bytes(optimizer) + outer_bytes, device)
    metrics.close()


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
