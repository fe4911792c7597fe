"""DDP: Distributed Data Parallel, written by hand.

Every rank holds the whole model and its optimizer and runs forward/backward on its own rows of
the global batch. After backward the gradients are averaged over the N ranks with all-reduce, so
every rank takes the same optimizer step and the replicas stay equal.
  memory per rank:  16P bytes (fp32 params 4P + grads 4P + AdamW state 8P), as one process
  communication:    one all-reduce of the 4P gradient bytes per step; a ring all-reduce sends
                    about 2(N-1)/N x 4P bytes per rank.

To hide that communication the gradients live in flat buckets of about --bucket_cap_mb. When the
last gradient of a bucket has been accumulated, its all-reduce starts asynchronously while backward
goes on with the earlier layers; the loop waits once, at the end of backward. The buckets follow
the order in which the gradients become ready: a guess (reverse registration order) for the first
backward, then rebuilt from the order measured there, as torch DDP does.

Run:
  python ddp_train.py                                   # single process: the reference
  torchrun --standalone --nproc_per_node=2 ddp_train.py # 2 ranks (2 GPUs, or 2 CPU processes)
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 ddp_train.py       # 2 nodes x 8 GPUs (node_rank=1 on node 2)
  python ddp_train.py --implementation pytorch          # torch.nn.parallel.DistributedDataParallel
The buckets' order, the mean on the loss, no-sync accumulation: docs/ddp.md.
"""
import os
import time
import weakref

import torch
import torch.distributed as dist

from common.checkpoint import (checkpoint, model_state_on_cpu, optimizer_state_by_name, resume,
                               set_adamw_state)
from common.config import check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import Batches, get_batch
from common.distributed import autocast, clip_grad_norm_, setup, setup_data, teardown
from common.metrics import MFU, Metrics, Profiler, activations, model_state_bytes
from common.model import GPT, compile_forward, configure_optimizer, num_params
from common.recompute import checkpoint_blocks
import peers.torch_ddp


# ---- the strategy: gradient buckets with overlapped all-reduce ---------------------------

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


class GradientBuckets:
    """Sums gradients over the ranks of `group` during backward: their mean, when each rank has
    divided its loss by the number of ranks before backward.

    Call `finish_backward()` after every backward. Set `require_sync = False` BEFORE the forward of
    a micro-step that should only accumulate locally (gradient accumulation; DDP's no_sync): those
    micro-steps send nothing, and the last micro-step's all-reduce carries the sum of them all."""

    def __init__(self, model, bucket_cap_mb, group=None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cap = int(bucket_cap_mb * 2**20)  # bytes
        self.group = group
        self.require_sync = True
        self.ready_order = []  # the order gradients became ready in the first backward
        self._make_buckets(self.params[::-1])  # first guess: backward runs roughly in reverse
        # The hook holds the buckets weakly: a parameter keeps its hooks in C++, out of sight of
        # Python's garbage collector, so param -> hook -> buckets -> param would never be freed.
        buckets = weakref.ref(self)
        for p in self.params:
            p.register_post_accumulate_grad_hook(lambda p: buckets()._grad_ready(p))

    def _make_buckets(self, order):
        groups, current, size = [], [], 0
        for p in order:
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > self.cap:  # a tensor over the cap: a bucket of its own
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        groups.append(current)
        self.buckets = [Bucket(g) for g in groups]
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        self.next = 0  # the next bucket to all-reduce: buckets go on the wire in index order

    def _grad_ready(self, p):
        # Runs inside backward, right after p.grad has been accumulated. A parameter used twice
        # (the tied wte/lm_head) gets one call, with both paths already summed by autograd.
        if self.ready_order is not None:
            self.ready_order.append(p)
        self.bucket_of[p].pending -= 1
        # Every rank must issue the same all-reduces in the same order, so a full bucket waits for
        # the ones before it (torch DDP's rule too); with buckets in ready order it rarely has to.
        while self.require_sync and self.next < len(self.buckets):
            if self.buckets[self.next].pending > 0:
                break
            self._all_reduce(self.buckets[self.next])

    def _all_reduce(self, bucket):
        # Sends the whole bucket (numel x 4 bytes in fp32) to every other rank and receives theirs,
        # summed: each rank's gradients are already g/N (its loss was divided by N), so afterwards
        # every rank holds the mean gradient. Async: backward keeps computing earlier layers while
        # it is on the wire.
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self.next += 1

    def finish_backward(self):
        """The one wait at the end of backward (on syncing micro-steps). Parameters that got no
        gradient (unused in forward) keep a zero gradient; their buckets are reduced here, in order,
        which is correct as long as every rank has the same unused parameters."""
        while self.require_sync and self.next < len(self.buckets):
            self._all_reduce(self.buckets[self.next])
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            bucket.pending = len(bucket.params)
        self.next = 0
        if self.ready_order is not None:
            self._rebuild()

    def _rebuild(self):
        """After the first backward: buckets in the order the gradients became ready, so each bucket
        fills and leaves as early as it can. Rank 0's order is broadcast (8 bytes a parameter):
        every rank must build the same buckets, whatever order its own autograd happened to use."""
        index = {p: i for i, p in enumerate(self.params)}
        seen = [index[p] for p in dict.fromkeys(self.ready_order)]  # first readiness, no repeats
        unseen = [i for i in range(len(self.params)) if i not in set(seen)]  # unused: at the end
        order = torch.tensor(seen + unseen, device=self.params[0].device)
        dist.broadcast(order, group=self.group, group_src=0)
        self.ready_order = None
        self._make_buckets([self.params[i] for i in order.tolist()])


class DDP:
    """The strategy behind the few methods the training loop calls: the whole GPT on every rank,
    its gradients averaged by GradientBuckets."""
    dp_group = None  # the ranks that split the batch: all of them

    def __init__(self, config, args, device, state=None):
        # Every rank builds the same weights: initialisation depends only on (seed, name), which
        # tests/test_ddp.py checks across ranks, so no broadcast of rank 0's parameters is needed.
        self.model = GPT(config, seed=args.seed, device=device)
        self.args, self.device = args, device
        if state is not None:  # a full checkpoint from any script: every rank loads all of it
            self.model.load_state_dict(state)
        # --compile: each block's forward. Not the whole model: its backward would be one graph,
        # after which every gradient, and so every bucket, is ready at once, with no backward left
        # to hide the all-reduces behind; a block's backward is its own graph, and a bucket full
        # after it leaves while the earlier blocks compute. The head (ln_f, lm_head, loss) too.
        compile_forward(self.model.transformer.h, args.compile)
        compile_forward([self.model], args.compile, method="head")  # the loss fused, no buckets
        checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        self.buckets = GradientBuckets(self.model, args.bucket_cap_mb)

    def configure_optimizer(self, args, state=None):
        betas = (args.beta1, args.beta2)
        named = self.model.named_parameters()
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        if state is not None:  # a checkpoint's AdamW state, keyed by parameter name
            for name, p in self.model.named_parameters():
                set_adamw_state(optimizer, p, state[name], self.to_device)
        return optimizer

    def to_device(self, tensor):
        return tensor.to(self.device, copy=True)

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its loss. sync=False: accumulate only (set before forward)."""
        self.buckets.require_sync = sync
        with activations.first(), autocast(self.args, self.device):  # the bytes kept for backward
            _, loss = self.model(x, y)
        # Each micro-step is 1/A of this rank's rows and each rank 1/N of the batch: backward of
        # loss/(A*N) writes g/(A*N), and the buckets' plain sum over the ranks is the mean, with
        # no pass over the gradients to divide them (why a sum: docs/design.md).
        N = dist.get_world_size(self.buckets.group)  # the ranks the buckets sum over
        (loss / (self.args.grad_accum_steps * N)).backward()
        self.buckets.finish_backward()
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # The gradients are equal on every rank now: the global norm needs no communication. Every
        # gradient is a view of a bucket, so the norm and the scaling take the flat buffers: the
        # same elements, one tensor a bucket instead of one a parameter (a CPU foreach op runs
        # one op per tensor).
        return clip_grad_norm_(None, [b.buffer for b in self.buckets.buckets], max_norm)

    def full_state(self, optimizer):
        """Every rank holds the full model, so nothing is gathered: rank 0 copies its state into
        its CPU memory, one tensor at a time, and the other ranks keep nothing."""
        if dist.get_rank() != 0:
            return None, None
        named = self.model.named_parameters()
        return model_state_on_cpu(self.model), optimizer_state_by_name(named, optimizer)

    def describe(self):
        n_buckets = len(self.buckets.buckets)
        return f"{num_params(self.model) / 1e6:.2f}M params, {n_buckets} gradient buckets"


class TorchDDP(peers.torch_ddp.TorchDDP, DDP):
    """--implementation pytorch: torch's DistributedDataParallel in place of GradientBuckets
    (peers/torch_ddp.py); the other methods are DDP's."""


def add_ddp_flags(group):
    group.add_argument("--bucket_cap_mb", type=float, default=25.0,
                       help="gradient bucket size (MiB)")


def check_ddp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns the DP size."""
    if args.bucket_cap_mb <= 0:
        die(f"--bucket_cap_mb: must be > 0, got {args.bucket_cap_mb}")
    if args.implementation == "pytorch" and args.bucket_cap_mb < 1:  # torch 2.13's DDPOptimizer
        if args.compile:
            die("--compile: dynamo splits torch DDP's compiled graph at its buckets, whose first "
                "holds 1 MiB: --bucket_cap_mb must be >= 1 (or use --compile false)")
        args.compile = False  # the default: off here
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

    Strategy = DDP if args.implementation == "custom" else TorchDDP
    model = Strategy(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    mfu = MFU(config, args, device, world_size)  # model FLOPs utilisation, per log line
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start, mfu=mfu)
    if rank == 0:
        print(f"ddp ({args.implementation}): {world_size} rank(s) on {device} in {args.dtype}, "
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
        for j in range(A):  # gradients are synchronised on the last micro-step only
            part = slice(j * micro, (j + 1) * micro)
            loss_sum += model.forward_backward(x[part], y[part], sync=j == A - 1)
        batches.prefetch(step + 1)  # built and copied while the device runs this step
        # Logged loss: the mean over all B*T tokens of the global batch (equal chunks: mean of
        # means).
        loss_sum /= A
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=model.dp_group)
        norm = model.clip_grad_norm_(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # zero in place: gradients that are views stay views
        loss, norm = torch.stack([loss_sum, norm]).tolist()  # the step's one host sync
        dt = time.perf_counter() - t0  # the step's kernels have run
        metrics.step(step, loss, lr, norm, B * T, dt, device, args.log_interval)
        profiler.step()
        if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0:
            checkpoint(step + 1, model, optimizer, config, args)
    profiler.stop()

    if args.eval_interval:
        metrics.eval(args.max_iters, evaluate())
    checkpoint(args.max_iters, model, optimizer, config, args)
    metrics.summary(model_state_bytes(optimizer), device)
    metrics.close()


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
