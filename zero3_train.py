"""ZeRO-3 (DeepSpeed style): every parameter tensor is owned whole by one rank, written by hand.

The parameter tensors are partitioned over the N ranks whole (inter-tensor; FSDP instead slices every
tensor, see fsdp_train.py): the owner of a tensor alone keeps its fp32 value, its gradient and its
AdamW state, so the model state per rank is about 16P/N bytes (how close depends on the partition:
greedy, largest tensor first onto the least-loaded rank, so the most-loaded rank holds at most
P/N + the largest tensor; the small preset's tied 50304 x 128 embedding is 88% of P, so at 2 ranks
one rank holds it and the other the rest). Tensors of fewer than --persistence_threshold elements
(e.g. 1024: biases, LayerNorms) stay replicated on every rank like in DDP (16 bytes each everywhere);
the default 0 partitions everything: keeping them persistent was not faster on CPU/gloo (small
preset, 2 ranks, 30 steps, alternating runs: 1787/1717 tok/s with 1024 vs 1826/1750 with 0).

  forward:  before each module runs, every tensor it needs is broadcast from its owner into a buffer
            (4 bytes x numel, owner -> all; one message per owner of the module's tensors); the next
            module's broadcasts are already in flight (--prefetch); after the module, non-owners free
            the buffers, unless the tensor is used again soon (--max_reuse_distance: the tied wte).
  backward: the same, in reverse: the buffers are fetched again before a module's backward and freed
            after it. Each gradient goes to its owner with an async dist.reduce as soon as autograd
            has accumulated it; non-owners free it once the reduce is done; the owner divides by N.
  step:     AdamW over the owned (and persistent) tensors only; global grad norm from an all-reduce of
            each rank's squared norm of its owned gradients.

Communication per micro-step: 2 broadcasts + 1 reduce of every partitioned tensor (4 bytes x numel
each), except the position embedding: a lookup's backward reads no weight, so wpe is broadcast once.
The tied wte/lm_head is one tensor, broadcast for the embedding and kept for the head (whose backward
reuses the buffer; with --max_reuse_distance 0, broadcast again for the head), and reduced once with
the sum of both uses. Persistent tensors'
gradients accumulate locally and are all-reduced once per optimizer step.
Gradient accumulation: partitioned gradients are reduced to the owner on EVERY micro-step (the owner
accumulates; a non-owner would otherwise have to keep a full gradient, 4P bytes, between micro-steps).

Run:
  python zero3_train.py                                   # single process: everything owned by rank 0
  torchrun --standalone --nproc_per_node=2 zero3_train.py # 2 ranks (2 GPUs, or 2 CPU processes)
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 zero3_train.py       # 2 nodes x 8 GPUs (node_rank=1 on the other)
  torchrun --standalone --nproc_per_node=2 zero3_train.py --implementation pytorch
PyTorch has no whole-tensor ZeRO-3; --implementation pytorch runs its own ZeRO-3, FSDP2
(torch.distributed.fsdp.fully_shard on every block and on the root: intra-tensor shards), in the same loop.
"""
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from common.checkpoint import resume, save_checkpoint, set_adamw_state
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import get_batch
from common.distributed import autocast, setup, setup_data, teardown
from common.metrics import Metrics, peak_mem_bytes
from common.model import GPT, configure_optimizer, init_tensor, num_params


# ---- the strategy: whole tensors owned by one rank, broadcast when needed, reduced to the owner ------

def partition(named_shapes, world_size, persistence_threshold):
    """{name: owner rank, or None for a persistent (replicated) tensor}, and the elements per rank.
    Greedy (LPT): largest tensor first, each onto the rank with the fewest elements so far (lowest
    rank on ties). Bound: when the most-loaded rank got its last tensor it was the least loaded,
    so max(load) <= partitioned elements / N + the largest tensor."""
    owner, load = {}, [0] * world_size
    sizes = {name: torch.Size(shape).numel() for name, shape in named_shapes}
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # stable: equal sizes keep model order
        if sizes[name] < persistence_threshold:
            owner[name] = None
            continue
        rank = min(range(world_size), key=lambda r: load[r])
        owner[name] = rank
        load[rank] += sizes[name]
    return owner, load


def materialize_owned_(model, owner, rank, value_of, device):
    """Deferred init: give storage and a value, value_of(name, shape) (the per-name initial value, or
    the checkpoint's), only to the tensors this rank owns (and the persistent ones). The others become
    tensors of the right shape on 0 bytes of storage, which a broadcast fills when needed."""
    names = {id(p): n for n, p in model.named_parameters()}  # the tied weight appears once
    made = {}
    for module in model.modules():
        for local, p in list(module._parameters.items()):
            if p is None:
                continue
            name = names[id(p)]
            if name not in made:
                if owner[name] in (None, rank):
                    t = value_of(name, p.shape).to(device, copy=True)
                else:  # allocated and at once given back: at most one tensor's bytes, once
                    t = torch.empty(p.shape, device=device)
                    t.untyped_storage().resize_(0)
                made[name] = nn.Parameter(t)
            module._parameters[local] = made[name]  # lm_head gets wte's Parameter: still tied


class Zero3:
    """Fetch/free of the partitioned tensors around each module, gradient reduces to the owners.

    Modules ("units") in forward order: wte, wpe, h.0 .. h.{L-1}, ln_f, lm_head. All ranks issue the
    same collectives in the same order (hooks fire in the same order everywhere), so every rank keeps
    the same `fetched` bookkeeping, owner included. Call `finish_backward()` after every backward;
    set `sync_persistent = False` before the micro-steps that only accumulate (all but the last)."""

    def __init__(self, model, owner, rank, world_size, prefetch=True, max_reuse_distance=0):
        self.rank, self.world_size, self.prefetch = rank, world_size, prefetch
        self.owner = {p: owner[n] for n, p in model.named_parameters()}  # parameter -> rank or None
        self.units = [model.transformer.wte, model.transformer.wpe, *model.transformer.h,
                      model.transformer.ln_f, model.lm_head]
        # One broadcast per (module, owner): that owner's tensors of the module are views of one flat
        # buffer, so a block costs one message per owner, not one per tensor (gloo, 2 ranks: a block's 12
        # tensors one by one took 3.3 ms, the same 1.2 MB in one message 0.5 ms).
        self.buffers, self.unit_buffers = [], []  # [(flat buffer, owner)]; per module: indices into it
        for unit in self.units:
            by_owner = {}
            for p in unit.parameters():
                if self.owner[p] is not None:
                    by_owner.setdefault(self.owner[p], []).append(p)
            self.unit_buffers.append([self._buffer(ps, r) for r, ps in sorted(by_owner.items())])
        # DeepSpeed's stage3_max_reuse_distance: after a module's forward, a buffer that a later module
        # uses again within this many fetched elements stays (the tied wte, from the embedding to the
        # head: 1 broadcast per micro-step instead of 2, for holding 4 x 50304 x C bytes meanwhile).
        sizes = [sum(self.buffers[b][0].numel() for b in bs) for bs in self.unit_buffers]
        self.keep = [set() for _ in self.units]  # per module: the buffers its forward does not free
        for i, j in ((i, j) for i in range(len(self.units)) for j in range(i + 1, len(self.units))):
            if sum(sizes[i + 1:j]) <= max_reuse_distance:
                self.keep[i] |= set(self.unit_buffers[i]) & set(self.unit_buffers[j])
        # an embedding lookup's backward reads no weight: only the others are fetched again for backward
        self.backward_order = [i for i in reversed(range(len(self.units))) if not isinstance(self.units[i], nn.Embedding)]
        self.fetched = {}   # buffer index -> in-flight broadcast work, or None once it has arrived
        self.reduces = []   # (parameter, in-flight reduce / all-reduce work)
        self.sync_persistent = True
        self.wait_s = {"broadcast": 0.0, "reduce": 0.0}  # exposed communication (what overlap did not hide)
        for i, unit in enumerate(self.units):
            unit.register_forward_pre_hook(lambda m, inputs, i=i: self._before_forward(i))
            unit.register_forward_hook(lambda m, inputs, out, i=i: self._after_forward(i))
            if i in self.backward_order:
                unit.register_full_backward_pre_hook(lambda m, grad_out, i=i: self._before_backward(i))
                unit.register_full_backward_hook(lambda m, grad_in, grad_out, i=i: self._free(i))
        for p in self.owner:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _buffer(self, params, owner):
        """Index of the flat buffer holding `params` (owned by `owner`); the parameters become views of it."""
        for b, (flat, _) in enumerate(self.buffers):
            if flat is params[0]:  # the tied wte: one buffer for both its modules
                return b
        if len(params) == 1:
            flat = params[0]  # a lone tensor is its own buffer
        else:
            flat = (torch.cat([p.detach().flatten() for p in params]) if owner == self.rank
                    else torch.empty(sum(p.numel() for p in params), device=params[0].device))
            offset = 0
            for p in params:
                p.data = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            if owner != self.rank:
                flat.untyped_storage().resize_(0)
        self.buffers.append((flat, owner))
        return len(self.buffers) - 1

    def _fetch(self, i):
        for b in self.unit_buffers[i]:
            if b in self.fetched:  # already here or on its way (prefetched)
                continue
            flat, owner = self.buffers[b]
            if owner != self.rank:
                flat.untyped_storage().resize_(flat.numel() * flat.element_size())  # the buffer
            # The owner sends its tensors (numel x 4 bytes in fp32) to every other rank; after the wait
            # all ranks hold the owner's exact values. Async, so it overlaps the running module.
            # .data: the broadcast writes in place without bumping the parameters' autograd version
            # counters, which the tensors saved for backward check.
            self.fetched[b] = dist.broadcast(flat.data, src=owner, async_op=True)

    def _wait(self, i):
        t0 = time.perf_counter()
        for b in self.unit_buffers[i]:
            if self.fetched[b] is not None:
                self.fetched[b].wait()
                self.fetched[b] = None
        self.wait_s["broadcast"] += time.perf_counter() - t0

    def _free(self, i, keep=()):
        for b in (b for b in self.unit_buffers[i] if b not in keep):
            if self.fetched.pop(b, None) is not None:
                raise RuntimeError("freeing a tensor whose broadcast is still in flight")
            flat, owner = self.buffers[b]
            if owner != self.rank:
                flat.untyped_storage().resize_(0)  # shapes kept; the bytes go back to the allocator

    def _before_forward(self, i):
        self._fetch(i)
        if self.prefetch and i + 1 < len(self.units):
            self._fetch(i + 1)  # the next module's broadcasts run while this module computes
        self._wait(i)

    def _after_forward(self, i):
        # The head's backward comes right after the loss: keep its buffer (the tied wte) until then.
        if not (torch.is_grad_enabled() and i == len(self.units) - 1):
            self._free(i, self.keep[i])

    def _before_backward(self, i):
        self._fetch(i)
        k = self.backward_order.index(i)
        if self.prefetch and k + 1 < len(self.backward_order):
            self._fetch(self.backward_order[k + 1])
        self._wait(i)

    def _grad_ready(self, p):
        # Runs inside backward once p.grad holds this micro-step's full gradient (for the tied
        # wte/lm_head: once, with the embedding's and the head's contributions already summed).
        owner = self.owner[p]
        if owner is None:
            if self.sync_persistent:  # replicated tensor: sum every rank's gradient on every rank
                self.reduces.append((p, dist.all_reduce(p.grad, async_op=True)))
        else:
            # Every rank sends its p.grad (numel x 4 bytes) towards the owner, which receives the sum.
            # The owner's p.grad also holds the earlier micro-steps' reduced sums, so the sum is the
            # accumulated gradient; non-owners start every micro-step from None.
            self.reduces.append((p, dist.reduce(p.grad, dst=owner, async_op=True)))
        self._release_reduced(wait=False)

    def _release_reduced(self, wait):
        pending = []
        for p, work in self.reduces:
            if wait:
                work.wait()
            if wait or work.is_completed():
                if self.owner[p] not in (None, self.rank):
                    p.grad = None  # sent: a non-owner keeps no gradient
            else:
                pending.append((p, work))
        self.reduces = pending

    def finish_backward(self):
        """Wait for the gradient reduces; afterwards no rank holds a non-owned parameter or gradient."""
        t0 = time.perf_counter()
        self._release_reduced(wait=True)
        self.wait_s["reduce"] += time.perf_counter() - t0
        assert not self.fetched, "a fetched tensor was not freed"

    def owned(self):
        return [p for p, r in self.owner.items() if r == self.rank]

    def persistent(self):
        return [p for p, r in self.owner.items() if r is None]


@torch.no_grad()
def gather_full_state(model, optimizer, zero3):
    """The full checkpoint's model and optimizer dicts on rank 0 (None elsewhere): each owner sends
    its parameter, exp_avg, exp_avg_sq and step packed in one tensor to rank 0 (4 x (3 numel + 1)
    bytes); persistent tensors are already on rank 0. Rank 0 holds the whole model meanwhile."""
    rank, params, optim = dist.get_rank(), {}, {}
    for name, p in model.named_parameters():
        owner = 0 if zero3.owner[p] is None else zero3.owner[p]
        if rank not in (0, owner):
            continue
        n = p.numel()
        if rank == owner:
            s = optimizer.state[p]
            packed = torch.cat([p.flatten(), s["exp_avg"].flatten(), s["exp_avg_sq"].flatten(), s["step"].view(1).to(p)])
        else:
            packed = torch.empty(3 * n + 1, device=p.device)
        if owner != 0:
            dist.send(packed, dst=0) if rank == owner else dist.recv(packed, src=owner)
        if rank == 0:
            params[id(p)] = packed[:n].view_as(p).clone()
            optim[name] = {"step": packed[3 * n].cpu().clone(), "exp_avg": packed[n:2 * n].view_as(p).clone(),
                           "exp_avg_sq": packed[2 * n:3 * n].view_as(p).clone()}
    if rank != 0:
        return None, None
    return {k: params[id(v)] for k, v in model.state_dict(keep_vars=True).items()}, optim  # both tied keys


def add_zero3_flags(group):
    group.add_argument("--persistence_threshold", type=int, default=0,  # measured: see the docstring
                       help="tensors with fewer elements stay replicated on every rank (0: partition all)")
    add_bool(group, "--prefetch", True, "broadcast the next module's tensors while the current one computes")
    group.add_argument("--max_reuse_distance", type=int, default=10**9,  # DeepSpeed's default
                       help="keep a fetched tensor whose next use comes within this many fetched elements (0: always free)")


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(tensors):
    """Bytes this rank really holds: a freed tensor (0-byte storage) counts 0, a DTensor its shard."""
    return sum(min(local(t).numel() * t.element_size(), local(t).untyped_storage().nbytes())
               for t in tensors if t is not None)


# ---- setup -------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("zero3", add_zero3_flags, argv)
    for flag in ("persistence_threshold", "max_reuse_distance"):
        if getattr(args, flag) < 0:
            die(f"--{flag}: must be >= 0, got {getattr(args, flag)}")
    check_batch_split(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    rows, micro = B // world_size, B // world_size // A  # this rank's rows; rows per micro-step

    # Resuming re-partitions: each rank takes from the full tensors only what it keeps in this layout.
    value_of = ((lambda name, shape: ckpt["model"][name]) if ckpt else
                (lambda name, shape: init_tensor(name, shape, config, args.seed)))
    model = GPT(config, device="meta")  # shapes only; each rank then materialises what it keeps
    zero3 = None
    if args.implementation == "custom":
        owner, load = partition([(n, p.shape) for n, p in model.named_parameters()], world_size,
                                args.persistence_threshold)
        materialize_owned_(model, owner, rank, value_of, device)
        zero3 = Zero3(model, owner, rank, world_size, args.prefetch, args.max_reuse_distance)
        optimizer = configure_optimizer([(n, p) for n, p in model.named_parameters() if owner[n] in (None, rank)],
                                        args.weight_decay, args.learning_rate, (args.beta1, args.beta2))
    else:  # FSDP2: every block and the root become groups of per-tensor Shard(0) DTensors
        mesh = init_device_mesh(device.type, (world_size,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=device)  # allocates only this rank's shards
        with torch.no_grad():
            for name, p in model.named_parameters():  # each rank cuts its shard from the full tensor
                p.copy_(distribute_tensor(value_of(name, p.shape).to(device), mesh, p.placements, src_data_rank=None))
        optimizer = configure_optimizer(model.named_parameters(), args.weight_decay, args.learning_rate,
                                        (args.beta1, args.beta2))
    start = ckpt["step"] if ckpt else 0
    if ckpt:  # AdamW state cut like its parameter: whole for an owned tensor, this rank's shard of a DTensor
        names = {p: n for n, p in model.named_parameters()}
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            cut = ((lambda t, p=p: distribute_tensor(t.to(device), p.device_mesh, p.placements, src_data_rank=None).clone())
                   if isinstance(p, DTensor) else (lambda t: t.to(device, copy=True)))  # clone: not a view of t
            set_adamw_state(optimizer, p, ckpt["optimizer"][names[p]], cut)
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start)
    if rank == 0:
        print(f"zero3 ({args.implementation}): {world_size} rank(s) on {device}, {num_params(model) / 1e6:.2f}M params, "
              f"global batch {B} x {T} tokens, {A} micro-step(s) of {micro} rows per rank", flush=True)
        if zero3 is not None:
            persistent = sum(p.numel() for p in zero3.persistent())
            print(f"partition ({len(owner) - list(owner.values()).count(None)} partitioned tensors, "
                  f"{list(owner.values()).count(None)} persistent of {persistent * 4:,} bytes on every rank):")
            for r in range(world_size):
                print(f"  rank {r}: {sum(1 for o in owner.values() if o == r):3d} tensors, {load[r] * 4:>12,} bytes "
                      f"({load[r] / max(1, sum(load)):.1%})", flush=True)
            if 0 in [sum(1 for o in owner.values() if o == r) for r in range(world_size)]:
                print(f"warning: some of the {world_size} ranks own no tensor (fewer partitioned tensors than ranks, "
                      f"or one tensor dominates); they only receive broadcasts", flush=True)

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

    def sum_of_squares(tensors):
        return sum(((g.float() * g.float()).sum() for g in tensors), torch.zeros((), device=device))

    # ---- training loop -------------------------------------------------------------------
    timings = []  # per step, ms: exposed broadcast wait, exposed reduce wait, optimizer (for the bench)
    for step in range(start, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            metrics.eval(step, evaluate())
        t0 = time.perf_counter()
        if zero3 is not None:
            zero3.wait_s = dict.fromkeys(zero3.wait_s, 0.0)  # this step only, not the evaluation
        lr = get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch("train", step, B, T, args.seed, args.dataset)
        x, y = x[rank * rows:(rank + 1) * rows].to(device), y[rank * rows:(rank + 1) * rows].to(device)
        loss_sum = torch.zeros((), device=device)
        for j in range(A):
            if zero3 is not None:
                zero3.sync_persistent = j == A - 1  # persistent grads: accumulate locally, all-reduce once
            with autocast(args, device):
                _, loss = model(x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro])
            (loss / A).backward()  # each micro-step is 1/A of this rank's rows
            if zero3 is not None:
                zero3.finish_backward()
            loss_sum += loss.detach().float()
        # Logged loss: the mean over all B*T tokens of the global batch (equal chunks: mean of means).
        loss_sum /= A
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        if zero3 is not None:  # the reduces summed over ranks: the owner averages
            sharded, replicated = [p.grad for p in zero3.owned()], [p.grad for p in zero3.persistent()]
            for g in sharded + replicated:
                g.div_(world_size)
        else:  # FSDP2's reduce-scatter already averaged; each rank holds its shards' gradients
            sharded, replicated = [local(p.grad) for p in model.parameters()], []
        # Pinned global norm: every gradient element is on exactly one rank (owned / shard), or on all
        # of them identically (persistent): all-reduce the former's squares, add the latter's once.
        squares = sum_of_squares(sharded)
        dist.all_reduce(squares)
        norm = (squares + sum_of_squares(replicated)).sqrt()
        if args.grad_clip > 0:
            clip = (args.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            for g in sharded + replicated:
                g.mul_(clip)
        t_opt = time.perf_counter()
        optimizer.step()  # AdamW over the owned tensors only
        if zero3 is not None:
            timings.append([1000 * zero3.wait_s["broadcast"], 1000 * zero3.wait_s["reduce"], 1000 * (time.perf_counter() - t_opt)])
        optimizer.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        metrics.step(step, loss_sum.item(), lr, norm.item(), B * T, time.perf_counter() - t0, device,
                     args.log_interval)
        if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0:
            checkpoint(model, optimizer, zero3, step + 1, config, args)

    if args.eval_interval:
        metrics.eval(args.max_iters, evaluate())
    checkpoint(model, optimizer, zero3, args.max_iters, config, args)
    state_bytes = (held_bytes(model.parameters()) + held_bytes(p.grad for p in model.parameters())
                   + held_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)))
    per_rank = [None] * world_size
    medians = [statistics.median(column) for column in zip(*timings)] if timings else None
    dist.all_gather_object(per_rank, (state_bytes, peak_mem_bytes(device), medians))
    extra = {}
    if medians:  # where the step's time goes, per rank: the owner of the big tensors waits and works most
        for k, key in enumerate(["broadcast_wait_ms", "reduce_wait_ms", "optimizer_ms"]):
            extra[key + "_per_rank"] = [round(r[2][k], 2) for r in per_rank]
    metrics.summary([r[0] for r in per_rank], [r[1] for r in per_rank], **extra)
    metrics.close()


def checkpoint(model, optimizer, zero3, step, config, args):
    """Collective: the full format gathered on rank 0, which writes it (with every rank's RNG state)."""
    if zero3 is not None:
        state, optim = gather_full_state(model, optimizer, zero3)
    else:  # FSDP2: full_tensor() all-gathers each DTensor on every rank
        full = lambda v: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
        state = {k: full(v) for k, v in model.state_dict().items()}
        optim = {n: {k: full(v) for k, v in optimizer.state[p].items()} for n, p in model.named_parameters()}
    save_checkpoint(state, optim, step, config, args)


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
