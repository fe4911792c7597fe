"""DDP: Distributed Data Parallel, written by hand.

Every rank holds the whole model and optimizer (memory per rank: 4P bytes of fp32 params + 4P of
grads + 8P of AdamW state = 16P, the same as one process) and runs forward/backward on its own
rows of the global batch. After backward the gradients are averaged over the N ranks with
all-reduce, so every rank takes the identical optimizer step. Communication per step: one
all-reduce of the 4P gradient bytes (a ring all-reduce sends about 2*(N-1)/N * 4P bytes per rank).

To hide that communication, the gradients live in flat "buckets" (about --bucket_cap_mb each,
filled in reverse registration order, roughly the order backward produces them). When the last
gradient of a bucket has been accumulated, its all-reduce starts asynchronously while backward
goes on computing the earlier layers; the training loop waits once, at the end of backward.

Run:
  python ddp_train.py                                   # single process: the reference
  torchrun --standalone --nproc_per_node=2 ddp_train.py # 2 ranks (2 GPUs, or 2 CPU processes)
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 ddp_train.py       # 2 nodes x 8 GPUs (node_rank=1 on the other)
  python ddp_train.py --implementation pytorch          # torch.nn.parallel.DistributedDataParallel
"""
import os
import time
import weakref
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.checkpoint import optimizer_state_by_name, resume, save_checkpoint, set_adamw_state
from common.config import check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import get_batch
from common.distributed import autocast, setup, setup_data, teardown
from common.metrics import Metrics, optimizer_state_bytes, peak_mem_bytes, tensor_bytes
from common.model import GPT, configure_optimizer, num_params


# ---- the strategy: gradient buckets with overlapped all-reduce ---------------------------

class Bucket:
    """One flat gradient buffer; the .grad of each of its parameters is a view into it, so autograd
    accumulates straight into the buffer and the all-reduce needs no copy in or out."""

    def __init__(self, params):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = self.buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.pending = len(params)  # gradients not yet accumulated in this backward
        self.work = None            # the in-flight async all-reduce


class GradientBuckets:
    """Averages gradients over the ranks of `group` during backward.

    Call `finish_backward()` after every backward. Set `require_sync = False` BEFORE the forward of a
    micro-step that should only accumulate locally (gradient accumulation; DDP's no_sync): those
    micro-steps send nothing, and the last micro-step's all-reduce carries the sum of all of them.

    `embedding`: an nn.Embedding whose weight is tied to the output head (GPT's wte/lm_head). That
    one tensor is most of the gradient bytes (50304 x 128 of the small model's 7.2M parameters), and
    autograd would deliver its gradient last (the lookup is the first op of forward, so its backward
    is the last), leaving its all-reduce exposed after backward. So the lookup's gradient is taken
    off the autograd graph: the weight then receives only the head's dense gradient, early in
    backward, and its bucket's all-reduce overlaps the whole block backward. The lookup's gradient
    is sparse (one row per token) and is exchanged at the end with two small all-gathers."""

    def __init__(self, model, bucket_cap_mb, group=None, embedding=None):
        self.group = group
        self.require_sync = True
        cap = int(bucket_cap_mb * 2**20)
        params = [p for p in model.parameters() if p.requires_grad][::-1]  # reverse registration order
        groups, current, size = [], [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap:  # a tensor bigger than the cap gets a bucket of its own
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        groups.append(current)
        self.buckets = [Bucket(g) for g in groups]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        # The hook holds the buckets weakly: a parameter keeps its hooks in C++, out of sight of Python's
        # garbage collector, so param -> hook -> buckets -> param would be a cycle never freed, keeping
        # the buckets' process group (tp_train.py's DP group) alive past teardown().
        buckets = weakref.ref(self)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: buckets()._grad_ready(p))
        self.embedding, self.gathers = embedding, None
        if embedding is not None:
            embedding.register_forward_hook(self._detach_lookup)

    def _grad_ready(self, p):
        # Runs inside backward, right after p.grad has been accumulated. A parameter used twice
        # (the tied wte/lm_head) gets one call, with both paths already summed by autograd.
        bucket = self.bucket_of[p]
        bucket.pending -= 1
        if bucket.pending == 0 and self.require_sync:
            # Sends the whole bucket (bucket.buffer.numel() * 4 bytes in fp32) to every other rank
            # and receives theirs, summing and dividing by N: afterwards every rank holds the mean
            # gradient. Async: backward keeps computing earlier layers while it is on the wire.
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.AVG, group=self.group, async_op=True)

    def _detach_lookup(self, embedding, inputs, out):
        # Forward hook on the embedding: return a detached copy of the lookup output, so autograd
        # stops there; its gradient (shape of the output) comes to _lookup_grad_ready instead.
        if not torch.is_grad_enabled():
            return None
        out = out.detach().requires_grad_()
        ids = inputs[0]
        out.register_hook(lambda grad: self._lookup_grad_ready(ids, grad))
        return out

    def _lookup_grad_ready(self, ids, grad):
        # The last gradient of backward: d(loss)/d(looked-up rows), one row of C values per token.
        ids, grad = ids.reshape(-1), grad.reshape(-1, grad.size(-1))
        if not self.require_sync:  # accumulate locally, like every other gradient on no_sync steps
            self.embedding.weight.grad.index_add_(0, ids, grad)
            return
        # Every rank needs every rank's rows: all-gather the token ids (8 bytes each) and the row
        # gradients (4*C bytes each) of all N ranks, instead of all-reducing a dense vocab x C tensor.
        # (all_gather_single is torch 2.13's name for all_gather_into_tensor, now deprecated.)
        n = dist.get_world_size(self.group)
        all_ids = ids.new_empty(n * ids.numel())
        all_grad = grad.new_empty(n * grad.size(0), grad.size(1))
        self.gathers = (all_ids, all_grad, [dist.all_gather_single(all_ids, ids, group=self.group, async_op=True),
                                            dist.all_gather_single(all_grad, grad.contiguous(), group=self.group, async_op=True)])

    def finish_backward(self):
        """The one wait at the end of backward (on syncing micro-steps). Parameters that got no
        gradient (unused in forward) keep a zero gradient; their bucket is reduced here, in bucket
        order, which is correct as long as every rank has the same unused parameters."""
        for bucket in self.buckets:
            if self.require_sync and bucket.work is None:
                bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            bucket.pending = len(bucket.params)
        if self.gathers is not None:
            # mean over ranks of (head + lookup) = all-reduced mean of the head part + (1/N) * sum of
            # every rank's lookup rows, added after the bucket holding the weight has been reduced.
            all_ids, all_grad, works = self.gathers
            for work in works:
                work.wait()
            self.embedding.weight.grad.index_add_(0, all_ids, all_grad, alpha=1.0 / dist.get_world_size(self.group))
            self.gathers = None


def add_ddp_flags(group):
    group.add_argument("--bucket_cap_mb", type=float, default=25.0, help="gradient bucket size (MiB)")


# ---- setup -------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("ddp", add_ddp_flags, argv)
    if args.bucket_cap_mb <= 0:
        die(f"--bucket_cap_mb: must be > 0, got {args.bucket_cap_mb}")
    check_batch_split(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    rows, micro = B // world_size, B // world_size // A  # this rank's rows; rows per micro-step

    # Every rank builds the same weights: initialisation depends only on (seed, name), which
    # tests/test_ddp.py checks across ranks, so no broadcast of rank 0's parameters is needed.
    model = GPT(config, seed=args.seed, device=device)
    ckpt = resume(args)  # None, or a full checkpoint written by any script: every rank loads all of it
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    if args.implementation == "custom":
        buckets = GradientBuckets(model, args.bucket_cap_mb, embedding=model.transformer.wte)
        train_model = model
    else:
        buckets = None
        train_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)
    optimizer = configure_optimizer(model.named_parameters(), args.weight_decay, args.learning_rate,
                                    (args.beta1, args.beta2))
    start = 0
    if ckpt is not None:
        for name, p in model.named_parameters():
            set_adamw_state(optimizer, p, ckpt["optimizer"][name], lambda t: t.to(device, copy=True))
        start = ckpt["step"]
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start)
    if rank == 0:
        print(f"ddp ({args.implementation}): {world_size} rank(s) on {device}, {num_params(model) / 1e6:.2f}M params, "
              f"global batch {B} x {T} tokens, {A} micro-step(s) of {micro} rows per rank"
              + (f", {len(buckets.buckets)} gradient buckets" if buckets else ""), flush=True)

    @torch.no_grad()
    def evaluate():
        """Mean loss over eval_iters fixed batches per split; each rank evaluates its rows of
        each batch and the means are averaged over ranks (equal row counts, so the global mean)."""
        model.eval()
        out = {}
        for split in ("train", "val"):
            total = torch.zeros((), device=device)
            for k in range(args.eval_iters):
                x, y = get_batch(split, k, B, T, args.seed + 1, args.dataset)
                with autocast(args, device):
                    _, loss = model(x[rank * rows:(rank + 1) * rows].to(device), y[rank * rows:(rank + 1) * rows].to(device))
                total += loss.float()
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
            out[split] = total.item() / args.eval_iters
        model.train()
        return out

    # ---- training loop -------------------------------------------------------------------
    for step in range(start, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            metrics.eval(step, evaluate())
        t0 = time.perf_counter()
        lr = get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch("train", step, B, T, args.seed, args.dataset)
        x, y = x[rank * rows:(rank + 1) * rows].to(device), y[rank * rows:(rank + 1) * rows].to(device)
        loss_sum = torch.zeros((), device=device)
        for j in range(A):
            last = j == A - 1
            if buckets is not None:
                buckets.require_sync = last  # before the forward, like DDP's no_sync()
            no_sync = train_model.no_sync() if buckets is None and not last else nullcontext()
            with no_sync:
                with autocast(args, device):
                    _, loss = train_model(x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro])
                (loss / A).backward()  # each micro-step is 1/A of this rank's rows
            if buckets is not None:
                buckets.finish_backward()
            loss_sum += loss.detach().float()
        # Logged loss: the mean over all B*T tokens of the global batch (equal chunks: mean of means).
        loss_sum /= A
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        # Gradients are identical on every rank now: the pinned global norm needs no communication.
        grads = [p.grad for p in model.parameters()]
        norm = torch.stack([(g.float() * g.float()).sum() for g in grads]).sum().sqrt()
        if args.grad_clip > 0:
            clip = (args.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # zero in place: the grads stay views into the buckets
        if device.type == "cuda":
            torch.cuda.synchronize()
        metrics.step(step, loss_sum.item(), lr, norm.item(), B * T, time.perf_counter() - t0, device,
                     args.log_interval)
        if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0:
            checkpoint(model, optimizer, step + 1, config, args)

    if args.eval_interval:
        metrics.eval(args.max_iters, evaluate())
    checkpoint(model, optimizer, args.max_iters, config, args)
    state_bytes = (tensor_bytes(model.parameters()) + tensor_bytes(p.grad for p in model.parameters())
                   + optimizer_state_bytes(optimizer))
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, (state_bytes, peak_mem_bytes(device)))
    metrics.summary([s for s, _ in per_rank], [m for _, m in per_rank])
    metrics.close()


def checkpoint(model, optimizer, step, config, args):
    """Every rank holds the full model, so nothing is gathered: rank 0 writes it as it is (the
    full format); save_checkpoint is collective only to collect every rank's RNG state."""
    first = dist.get_rank() == 0
    save_checkpoint(model.state_dict() if first else None,
                    optimizer_state_by_name(model.named_parameters(), optimizer) if first else None, step, config, args)


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
