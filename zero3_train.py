"""ZeRO, stages 1 to 3 (DeepSpeed style), written by hand: every parameter tensor is owned whole by one rank.

ZeRO removes data parallelism's copies of the model state in three steps (--stage): 1 the AdamW state, 2 the
gradients too, 3 the parameters too; a rank keeps what is sharded for the tensors it owns only (FSDP instead slices
every tensor over the N ranks). Greedy partition, largest tensor first onto the least-loaded rank: no rank owns
more than P/N + the largest tensor (P_own: about P/N). Tensors under --persistence_threshold elements stay
replicated, as in DDP. Memory per rank, fp32 (8 bytes of AdamW state an element):
  stage 1:   4P params + 4P grads + 8P_own. The gradients are all-reduced (averaged) in buckets overlapped with
             backward, as in ddp_train.py; AdamW runs on the owned tensors only, then each owner broadcasts them
             (one message per owner: its tensors are views of one flat buffer).
  stage 2:   4P params + 4P_own grads + 8P_own, plus the non-owned gradients whose reduce is in flight. Each
             gradient goes to its owner with an async reduce as soon as backward has accumulated it, on every
             micro-step; a non-owner drops it at once. After the step, broadcasts from the owners as in stage 1.
  stage 3:   16P/N (owned params, grads, AdamW state) + the non-owned tensors fetched at the moment (a module or
             two); stage 2's reduces, and:
  forward:   before each module its tensors are broadcast from their owners (one message per owner),
             the next module's already in flight (--prefetch); after it the non-owners free them,
             unless used again soon (--max_reuse_distance: the tied wte, kept until the head).
  backward:  fetched and freed again around each module, gradients reduced to their owners as in stage 2.
  Persistent tensors: every rank keeps all their state and runs AdamW on them; their gradients are all-reduced
             once a step (in stage 1 with the others).
Communication per step, in bytes handed to the collectives by each rank (A micro-steps):
  stage 1:   an all-reduce of 4P + broadcasts of 4P. A ring all-reduce is a reduce-scatter plus an all-gather,
             each sending (N-1)/N x 4P per rank: DDP's 2(N-1)/N x 4P. ZeRO-1 costs DDP's traffic only when its
             all-reduce is split so: the owners need the summed gradient of their own tensors (the reduce-scatter)
             and their broadcast replaces the all-gather. This implementation all-reduces the whole gradient, as
             ddp does, so it sends 2(N-1)/N x 4P and the broadcasts about (N-1)/N x 4P more: 3(N-1)/N x 4P.
  stage 2:   reduces of 4P on every micro-step (A x 4P) + broadcasts of 4P: the reduce to the owners is that
             reduce-scatter, so at A = 1 DDP's 2(N-1)/N x 4P.
  stage 3:   per micro-step 2 broadcasts + 1 reduce of 4P bytes, less one broadcast of wpe (a
             lookup's backward reads no weight) and of the tied wte/lm_head (one tensor: fetched for
             the embedding and kept for the head, reduced once with both uses summed).
  --dtype bfloat16: stages 1 and 2 compute under autocast with fp32 parameters, as ddp. Stage 3: the model
             computes with bf16 parameters, broadcast in bf16 (2P bytes: each owner casts its fp32 master);
             gradients are reduced in fp32, AdamW updates the fp32 masters.

Run:
  python zero3_train.py                                   # single process: everything owned by rank 0
  torchrun --standalone --nproc_per_node=2 zero3_train.py # 2 ranks (2 GPUs, or 2 CPU processes)
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 zero3_train.py       # 2 nodes x 8 GPUs (node_rank=1 on the other)
  torchrun --standalone --nproc_per_node=2 zero3_train.py --stage 1   # or 2; default 3
  python zero3_train.py --implementation pytorch          # FSDP2 (fully_shard): PyTorch's own ZeRO-3
  python zero3_train.py --stage 1 --implementation pytorch  # DDP + ZeroRedundancyOptimizer(AdamW)
"""
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, distribute_tensor

from common.checkpoint import checkpoint, resume, set_adamw_state
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import get_batch
from common.distributed import autocast, clip_grad_norm_, setup, setup_data, teardown
from common.metrics import Metrics, Profiler, model_state_bytes, timers
from common.model import GPT, configure_optimizer, init_tensor, num_params

BUCKET_CAP_MB = 25  # stage 1's gradient buckets: DDP's default


# ---- the strategy: whole tensors owned by one rank, broadcast when needed, reduced to the owner ------

def partition(named_shapes, world_size, persistence_threshold):
    """{name: owner rank, or None for a persistent (replicated) tensor}, and the elements per rank. Greedy (LPT):
    largest tensor first, each onto the rank with the fewest elements so far (lowest rank on ties). Bound: when
    the most-loaded rank got its last tensor it was the least loaded, so max(load) <= partitioned / N + largest."""
    sizes = {name: torch.Size(shape).numel() for name, shape in named_shapes}
    owner, load = dict.fromkeys(sizes), [0] * world_size  # None: persistent
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # stable: equal sizes keep model order
        if sizes[name] >= persistence_threshold:
            owner[name] = min(range(world_size), key=lambda r: load[r])
            load[owner[name]] += sizes[name]
    return owner, load


def materialize_owned_(model, owner, rank, value_of, device, dtype=torch.float32):
    """Deferred init: storage and a value, value_of(name, shape) (the initial value, or the checkpoint's), only for
    the fp32 masters of the tensors this rank owns and the persistent ones; returns {parameter: master}. The model
    computes with the masters themselves in fp32 (persistent ones always), else, as with the tensors owned
    elsewhere, with `dtype` parameters of 0 bytes of storage, which a broadcast fills when needed."""
    made, masters = {}, {}
    for name, p in model.named_parameters():  # the tied weight appears once
        if owner[name] in (None, rank):
            masters[p] = torch.nn.Parameter(value_of(name, p.shape).to(device, torch.float32, copy=True))
        if p in masters and (owner[name] is None or dtype == torch.float32):
            made[p] = masters[p]
        else:  # allocated and at once given back: at most one tensor's bytes, once
            made[p] = torch.nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype))
            made[p].untyped_storage().resize_(0)
    for name, p in model.named_parameters(remove_duplicate=False):  # lm_head gets wte's Parameter: still tied
        module, _, local = name.rpartition(".")
        setattr(model.get_submodule(module), local, made[p])
    return {made[p]: master for p, master in masters.items()}


def flatten_(tensors):
    """One flat buffer whose views `tensors` become (a lone tensor is its own), values kept: 0 bytes when
    they hold none (not fetched here)."""
    if len(tensors) == 1:
        return tensors[0]
    held = tensors[0].untyped_storage().nbytes() > 0  # a buffer's tensors: all held (its owner's) or none
    flat = (torch.cat([t.detach().flatten() for t in tensors]) if held else
            torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device))
    for t, view in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.data = view.view_as(t)
    if not held:
        flat.untyped_storage().resize_(0)
    return flat


class ReduceToOwner:
    """Stage 2's gradients (and stage 3's): each one goes to its owner with an async reduce as soon as backward has
    accumulated it, on every micro-step; a non-owner keeps none. Persistent (replicated) gradients: one all-reduce on
    the syncing micro-step. Hooks fire in the same order on every rank, so all issue the same collectives.
    Call `finish_backward()` after every backward; `sync_persistent = False` before accumulating only.
    `masters`: {parameter: the fp32 tensor AdamW updates here}; `owned`, `persistent`: those."""

    def __init__(self, model, owner, rank, masters):
        self.rank, self.masters = rank, masters
        self.owner = {p: owner[n] for n, p in model.named_parameters()}  # parameter -> rank or None
        self.owned = [masters[p] for p, r in self.owner.items() if r == rank]
        self.persistent = [masters[p] for p, r in self.owner.items() if r is None]
        self.reduces, self.sync_persistent = [], True  # reduces: (gradient, its in-flight reduce/all-reduce)
        for p in self.owner:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p):
        # Runs in backward once p.grad holds this micro-step's full gradient (the tied wte/lm_head: once, both
        # uses summed). Every rank sends its fp32 gradient (numel x 4 bytes) to the owner, which receives the sum.
        # The owner's fp32 gradient holds the earlier micro-steps' sums too: that is the accumulated gradient.
        grad, master = p.grad.float(), self.masters.get(p)  # bf16: an fp32 copy; fp32: p.grad itself
        if master is not p:  # a non-owner keeps no gradient (the reduce holds what it sends), nor does bf16 p
            p.grad = None
            if master is not None:  # the owner under bf16: accumulated in its fp32 master's gradient
                master.grad = grad = grad if master.grad is None else master.grad.add_(grad)
        if self.owner[p] is not None:
            self.reduces.append((grad, dist.reduce(grad, dst=self.owner[p], async_op=True)))
        elif self.sync_persistent:  # replicated tensor: sum every rank's gradient on every rank
            self.reduces.append((grad, dist.all_reduce(grad, async_op=True)))
        self.reduces = [(g, work) for g, work in self.reduces if not work.is_completed()]  # sent: let go

    def finish_backward(self):
        """Wait for the gradient reduces; afterwards no rank holds a non-owned gradient."""
        with timers("reduce_wait"):
            for _, work in self.reduces:
                work.wait()
        self.reduces = []


class Zero3(ReduceToOwner):
    """Stage 3: ReduceToOwner's gradients, and the fetch/free of the partitioned tensors around each module. The
    hooks keep the same `fetched` bookkeeping on every rank. `masters`: materialize_owned_'s."""

    def __init__(self, model, owner, rank, world_size, masters, prefetch=True, max_reuse_distance=0):
        super().__init__(model, owner, rank, masters)
        self.world_size, self.prefetch = world_size, prefetch
        self.units = [model.transformer.wte, model.transformer.wpe, *model.transformer.h,
                      model.transformer.ln_f, model.lm_head]  # the modules, in forward order
        # One broadcast per (module, owner), not per tensor: that owner's tensors of a module are views of one buffer.
        self.buffer_owner, self.master = {}, {}  # flat buffer -> owner rank; -> the owner's fp32 flat master
        self.unit_buffers = [[self._buffer([p for p in unit.parameters() if self.owner[p] == r], r)
                              for r in sorted({self.owner[p] for p in unit.parameters()} - {None})]
                             for unit in self.units]
        # DeepSpeed's stage3_max_reuse_distance: module i's forward keeps (keep[i]) the buffers a later module uses
        # again within this many fetched elements (the tied wte: 1 broadcast a micro-step, not 2; V x C values held).
        sizes = [sum(flat.numel() for flat in bs) for bs in self.unit_buffers]
        self.keep = [{b for j in range(i + 1, len(sizes)) if sum(sizes[i + 1:j]) <= max_reuse_distance
                      for b in set(self.unit_buffers[i]) & set(self.unit_buffers[j])} for i in range(len(sizes))]
        # an embedding lookup's backward reads no weight: only the others are fetched again for backward
        self.backward_order = [i for i, u in enumerate(self.units) if not isinstance(u, torch.nn.Embedding)][::-1]
        self.fetched = {}  # flat buffer -> in-flight broadcast work, or None once it has arrived
        for i, unit in enumerate(self.units):
            unit.register_forward_pre_hook(lambda m, inputs, i=i: self._before(i, range(len(self.units))))
            unit.register_forward_hook(lambda m, inputs, out, i=i: self._after_forward(i))
            if i in self.backward_order:
                unit.register_full_backward_pre_hook(lambda m, grad_out, i=i: self._before(i, self.backward_order))
                unit.register_full_backward_hook(lambda m, grad_in, grad_out, i=i: self._free(i))

    def _buffer(self, params, owner):
        """The flat buffer the module computes with, holding `params`, owned by `owner` (the tied wte: one buffer
        for both its modules). Its owner also keeps the flat fp32 master of the buffer: in fp32 the same one."""
        flat = flatten_(params)
        self.buffer_owner[flat] = owner
        if owner == self.rank:
            masters = [self.masters[p] for p in params]
            self.master[flat] = flat if masters[0] is params[0] else flatten_(masters)
        return flat

    def _fetch(self, i):
        for flat in (b for b in self.unit_buffers[i] if b not in self.fetched):  # not here nor on its way
            master = self.master.get(flat)  # this rank's fp32 master of it, if it owns it: in fp32 the buffer itself
            if master is not flat:  # held only while used: owned elsewhere, or a bf16 buffer
                flat.untyped_storage().resize_(flat.numel() * flat.element_size())
                if master is not None:
                    flat.data.copy_(master.detach())  # bf16: the owner casts its fp32 master
            # The owner sends its tensors (numel x 4 bytes; bf16: 2) to every other rank, async: it overlaps the
            # running module. .data: writing in place must not bump the autograd version counters saved tensors
            # check. What autograd saves are views of this buffer (under bf16 too: no autocast copies to keep).
            self.fetched[flat] = dist.broadcast(flat.data, src=self.buffer_owner[flat], async_op=True)

    def _free(self, i, keep=()):
        for flat in (b for b in self.unit_buffers[i] if b not in keep):
            if self.fetched.pop(flat, None) is not None:
                raise RuntimeError("freeing a tensor whose broadcast is still in flight")
            if self.master.get(flat) is not flat:
                flat.untyped_storage().resize_(0)  # shapes kept; the bytes go back to the allocator

    def _before(self, i, order):
        """Before module i's forward (or backward): its tensors here, the next module's on the way."""
        self._fetch(i)
        if self.prefetch and i != order[-1]:
            self._fetch(order[order.index(i) + 1])  # the next module's broadcasts run while this one computes
        with timers("broadcast_wait"):  # exposed communication: what the overlap did not hide
            for b in self.unit_buffers[i]:
                if self.fetched[b] is not None:
                    self.fetched[b].wait()
                    self.fetched[b] = None

    def _after_forward(self, i):
        # The head's backward comes right after the loss: keep its buffer (the tied wte) until then.
        if not (torch.is_grad_enabled() and i == len(self.units) - 1):
            self._free(i, self.keep[i])

    def finish_backward(self):
        """Wait for the gradient reduces; afterwards no rank holds a non-owned parameter or gradient."""
        super().finish_backward()
        assert not self.fetched, "a fetched tensor was not freed"


class GradientBuckets:
    """Stage 1's gradients, ddp_train.py's way: every .grad a view into a flat bucket of about `cap_bytes`, whose
    all-reduce starts as soon as backward has filled it; one wait at the end of backward. The buckets follow the
    reverse registration order, this GPT's order of readiness (ddp_train.py also rebuilds them in the measured
    order). `require_sync = False` before the forward of a micro-step that only accumulates."""

    def __init__(self, params, cap_bytes):
        groups = [[]]
        for p in reversed(params):  # backward runs in reverse; the tied wte (first) is ready last
            if groups[-1] and 4 * sum(q.numel() for q in groups[-1] + [p]) > cap_bytes:
                groups.append([])
            groups[-1].append(p)
        self.buckets = [torch.zeros(sum(p.numel() for p in g), device=g[0].device) for g in groups]
        for g, bucket in zip(groups, self.buckets):
            for p, view in zip(g, bucket.split([p.numel() for p in g])):
                p.grad = view.view_as(p)  # autograd accumulates into the bucket: no copy in or out
        self.bucket_of = {p: i for i, g in enumerate(groups) for p in g}
        self.sizes = [len(g) for g in groups]
        self.pending, self.works, self.require_sync = list(self.sizes), [], True  # works: in index order
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p):
        self.pending[self.bucket_of[p]] -= 1
        # Every rank must issue the same all-reduces in the same order: a full bucket waits for the ones before it.
        while self.require_sync and len(self.works) < len(self.buckets) and self.pending[len(self.works)] == 0:
            self._all_reduce_next()

    def _all_reduce_next(self):
        # The bucket (numel x 4 bytes) to every rank, summed and divided by N: every rank holds the mean gradient.
        self.works.append(dist.all_reduce(self.buckets[len(self.works)], op=dist.ReduceOp.AVG, async_op=True))

    def finish_backward(self):
        while self.require_sync and len(self.works) < len(self.buckets):  # a parameter unused in forward
            self._all_reduce_next()
        with timers("all_reduce_wait"):
            for work in self.works:
                work.wait()
        self.pending, self.works = list(self.sizes), []


class OwnedAdamW(torch.optim.Optimizer):
    """Stages 1 and 2's optimizer, laid out as ZeroRedundancyOptimizer is: its param_groups (the contract's two)
    hold every parameter, so the loop sets their lr and zeroes every gradient, and the state bytes count them all;
    `adamw`, built on the tensors this rank keeps (owned or persistent), alone has state and steps. `flats`:
    (owner, the flat buffer whose views its tensors are) for each rank that owns any."""

    def __init__(self, named_params, kept, flats, args):
        hyper = (args.weight_decay, args.learning_rate, (args.beta1, args.beta2))
        super().__init__(configure_optimizer(named_params, *hyper).param_groups, {})
        self.adamw, self.flats = configure_optimizer(kept, *hyper), flats
        self.state = self.adamw.state  # 8 bytes (exp_avg, exp_avg_sq) per kept element, + the step

    @torch.no_grad()
    def step(self):
        for group, mine in zip(self.param_groups, self.adamw.param_groups):
            mine["lr"] = group["lr"]
        self.adamw.step()
        # Each owner sends its updated tensors (4 P_own bytes, one message) to every rank: the replicas are equal
        # again. Async, issued in owner order on every rank, then waited for: the next forward reads them all.
        works = [dist.broadcast(flat, src=owner, async_op=True) for owner, flat in self.flats]
        with timers("broadcast_wait"):
            for work in works:
                work.wait()


@torch.no_grad()
def gather_full_state(model, optimizer, owner, masters):
    """The full checkpoint's model and optimizer dicts on rank 0 (None elsewhere), which holds the whole model
    meanwhile: each owner sends it its param, exp_avg, exp_avg_sq and step in one tensor (4 x (3 numel + 1) bytes).
    `owner`: {parameter: rank, None if persistent}; `masters`: {parameter: the tensor AdamW updates here}."""
    rank, params, optim = dist.get_rank(), {}, {}
    for name, p in model.named_parameters():
        src, n = owner[p] or 0, p.numel()  # a persistent tensor: rank 0's copy
        if rank == src:  # the fp32 master and its AdamW state
            m = masters[p]
            s = optimizer.state[m]
            packed = torch.cat([t.flatten().to(m) for t in (m, s["exp_avg"], s["exp_avg_sq"], s["step"])])
        elif rank == 0:
            packed = torch.empty(3 * n + 1, device=p.device)
        if src != 0 and rank in (0, src):
            dist.send(packed, dst=0) if rank == src else dist.recv(packed, src=src)
        if rank == 0:
            params[p], exp_avg, exp_avg_sq = (t.view_as(p).clone() for t in packed[:3 * n].chunk(3))
            optim[name] = {"step": packed[3 * n].cpu().clone(), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if rank != 0:
        return None, None
    return {k: params[v] for k, v in model.state_dict(keep_vars=True).items()}, optim  # both tied keys


def print_partition(owner, load, world_size, persistent_bytes, theirs=None):
    """Rank 0's banner: the tensors and bytes each rank owns; `theirs`: ZeroRedundancyOptimizer's, side by side."""
    owners = list(owner.values())
    print(f"partition: {owners.count(None)} persistent tensors of {persistent_bytes:,} bytes on every rank; owned:"
          + ("  (ours | ZeroRedundancyOptimizer's)" if theirs else ""))
    for r, n in enumerate(load):
        print(f"  rank {r}: {owners.count(r):3d} tensors, {n * 4:>12,} bytes ({n / max(1, sum(load)):.1%})" + (
            f" | {theirs[r][0]:3d} tensors, {theirs[r][1] * 4:>12,} bytes" if theirs else ""))
    if 0 in map(owners.count, range(world_size)):
        print(f"warning: some of the {world_size} ranks own no tensor (fewer partitioned tensors than "
              "ranks, or one tensor dominates); they only receive broadcasts", flush=True)


class ZeRO3:
    """The strategy behind the few methods the training loop calls: the GPT built on meta, each rank
    materialising only the tensors it owns (and the persistent ones), which Zero3 fetches and reduces."""
    dp_group = None  # the ranks that split the batch: all of them

    def __init__(self, config, args, device, state=None):
        self.args, self.device, self.rank, self.world_size = args, device, dist.get_rank(), dist.get_world_size()
        self.model = GPT(config, device="meta")  # shapes only; each rank then materialises what it keeps
        owner, load = partition([(n, p.shape) for n, p in self.model.named_parameters()], self.world_size,
                                args.persistence_threshold)
        # From a full checkpoint (any script, any world size) each rank takes only what it keeps here.
        masters = materialize_owned_(self.model, owner, self.rank, lambda name, shape: state[name] if state is not None
                                     else init_tensor(name, shape, config, args.seed), device,
                                     torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
        self.zero = Zero3(self.model, owner, self.rank, self.world_size, masters, args.prefetch,
                          args.max_reuse_distance)
        self.kept = [(n, masters[p]) for n, p in self.model.named_parameters() if p in masters]  # what AdamW updates
        if self.rank == 0:
            print_partition(owner, load, self.world_size, 4 * sum(p.numel() for p in self.zero.persistent))

    def local(self, full, p):
        return full.to(self.device, copy=True)  # this rank's part of a full tensor, laid out like p: all of it

    def configure_optimizer(self, args, state=None):
        optimizer = configure_optimizer(self.kept, args.weight_decay, args.learning_rate, (args.beta1, args.beta2))
        for name, p in self.kept if state else ():
            set_adamw_state(optimizer, p, state[name], lambda t: self.local(t, p))
        return optimizer

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its loss. sync=False: persistent gradients only accumulate locally."""
        self.zero.sync_persistent = sync
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        (loss / self.args.grad_accum_steps).backward()  # each micro-step is 1/A of this rank's rows
        self.zero.finish_backward()
        if sync:  # the gradients are complete: the reduces summed them over the ranks, the owner averages
            for p in self.zero.owned + self.zero.persistent:
                p.grad.div_(self.world_size)
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # Every gradient element is on exactly one rank (owned) or on all of them, equal (persistent).
        return clip_grad_norm_([p.grad for p in self.zero.owned], [p.grad for p in self.zero.persistent], max_norm)

    def full_state(self, optimizer):
        return gather_full_state(self.model, optimizer, self.zero.owner, self.zero.masters)

    def describe(self):
        return f"{num_params(self.model) / 1e6:.2f}M params, whole tensors owned by one of {self.world_size} rank(s)"


class ZeRO2(ZeRO3):
    """Stage 2 behind the same methods: the whole GPT on every rank, as in DDP; ReduceToOwner gives each owner its
    gradients, OwnedAdamW steps the owned tensors and broadcasts them."""

    def __init__(self, config, args, device, state=None):
        self.args, self.device, self.rank, self.world_size = args, device, dist.get_rank(), dist.get_world_size()
        self.model = GPT(config, seed=args.seed, device=device)
        if state is not None:  # a full checkpoint from any script: every rank loads all of it
            self.model.load_state_dict(state)
        named = list(self.model.named_parameters())
        owner, load = partition([(n, p.shape) for n, p in named], self.world_size, args.persistence_threshold)
        self.owner = {p: owner[n] for n, p in named}
        self.kept = [(n, p) for n, p in named if owner[n] in (None, self.rank)]  # AdamW state for these only
        # After the step each owner broadcasts its tensors in one message: they are views of one flat buffer.
        self.flats = [(r, flatten_([p for n, p in named if owner[n] == r])) for r in range(self.world_size) if load[r]]
        self.zero = self.gradients(owner)
        if self.rank == 0:
            print_partition(owner, load, self.world_size, 4 * sum(p.numel() for n, p in named if owner[n] is None))

    def gradients(self, owner):
        return ReduceToOwner(self.model, owner, self.rank, {p: p for _, p in self.kept})

    def configure_optimizer(self, args, state=None):
        optimizer = OwnedAdamW(self.model.named_parameters(), self.kept, self.flats, args)
        for name, p in self.kept if state else ():
            set_adamw_state(optimizer, p, state[name], lambda t: self.local(t, p))
        return optimizer

    def full_state(self, optimizer):
        return gather_full_state(self.model, optimizer, self.owner, {p: p for _, p in self.kept})

    def describe(self):
        sharded = "AdamW state" if self.args.stage == 1 else "AdamW state and gradients"
        return f"{num_params(self.model) / 1e6:.2f}M params on every rank, {sharded} of whole tensors owned by one " \
               f"of {self.world_size} rank(s)"


class ZeRO1(ZeRO2):
    """Stage 1: ZeRO2 with every gradient kept on every rank, averaged by GradientBuckets' all-reduces."""

    def gradients(self, owner):
        return GradientBuckets(list(self.model.parameters()), BUCKET_CAP_MB * 2**20)

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its loss. sync=False: accumulate only (set before the forward)."""
        self.zero.require_sync = sync
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        (loss / self.args.grad_accum_steps).backward()
        self.zero.finish_backward()
        return loss.detach().float()

    def clip_grad_norm_(self, max_norm):
        # Every rank holds every gradient, but the norm needs each element once: the owned ones, then all-reduced.
        return clip_grad_norm_([p.grad for p, r in self.owner.items() if r == self.rank],
                               [p.grad for p, r in self.owner.items() if r is None], max_norm)


def add_zero3_flags(group):
    group.add_argument("--stage", type=int, choices=[1, 2, 3], default=3,
                       help="ZeRO stage: shard the AdamW state (1), and the gradients (2), and the parameters (3)")
    group.add_argument("--persistence_threshold", type=int, default=0,
                       help="tensors with fewer elements stay replicated on every rank (0: partition all)")
    add_bool(group, "--prefetch", True, "broadcast the next module's tensors while the current one computes")
    group.add_argument("--max_reuse_distance", type=int, default=10**9,  # DeepSpeed's default
                       help="keep a fetched tensor used again within this many fetched elements (0: always free)")


def check_zero3_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns the DP size."""
    for flag in ("persistence_threshold", "max_reuse_distance"):
        if getattr(args, flag) < 0:
            die(f"--{flag}: must be >= 0, got {getattr(args, flag)}")
    if args.stage == 2 and args.implementation == "pytorch":  # see the README's design notes
        die("--stage: 2 has no PyTorch peer (torch's nearest, FSDP2 with reshard_after_forward=False, also shards "
            "the parameters between steps: fsdp_train.py --implementation pytorch --reshard_after_forward false)")
    for flag, default in dict(prefetch=True, max_reuse_distance=10**9).items():  # stages 1, 2 fetch nothing
        if args.stage < 3 and getattr(args, flag) != default:
            die(f"--{flag}: {str(getattr(args, flag)).lower()} applies to --stage 3 only")
    custom_only = dict(prefetch=True, persistence_threshold=0, max_reuse_distance=10**9)
    for flag, default in custom_only.items():  # FSDP2 shards every tensor, always prefetches, frees after use
        if args.implementation == "pytorch" and getattr(args, flag) != default:
            die(f"--{flag}: {str(getattr(args, flag)).lower()} is only supported by --implementation custom")
    check_batch_split(args, world_size)
    return world_size


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("zero3", add_zero3_flags, argv)
    D = check_zero3_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank, rows, micro = rank * D // world_size, B // D, B // D // A  # rows per DP rank; per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    model = STAGES[args.implementation][args.stage](config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start)
    if rank == 0:
        print(f"zero3 ({args.implementation}): {world_size} rank(s) on {device}, {model.describe()}; global batch "
              f"{B} x {T} tokens, {A} micro-step(s) of {micro} rows per data-parallel rank", flush=True)

    @torch.no_grad()
    def evaluate():
        """Mean loss over eval_iters fixed batches per split: each data-parallel rank evaluates its rows
        of each batch, and the means are averaged over those ranks (equal rows: the global mean)."""
        out = {}
        for split in ("train", "val"):
            total = torch.zeros((), device=device)
            for k in range(args.eval_iters):
                x, y = get_batch(split, k, B, T, args.seed + 1, args.dataset)
                total += model.eval_loss(x[mine].to(device), y[mine].to(device))
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=model.dp_group)
            out[split] = total.item() / args.eval_iters
        return out

    # ---- training loop -------------------------------------------------------------------
    profiler = Profiler(args, rank)
    for step in range(start, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            metrics.eval(step, evaluate())
        t0 = time.perf_counter()
        lr = get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch("train", step, B, T, args.seed, args.dataset)
        x, y = x[mine].to(device), y[mine].to(device)
        loss_sum = torch.zeros((), device=device)
        for j in range(A):  # gradients are synchronised on the last micro-step only
            loss_sum += model.forward_backward(x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro], j == A - 1)
        # Logged loss: the mean over all B*T tokens of the global batch (equal chunks: mean of means).
        loss_sum /= A
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=model.dp_group)
        norm = model.clip_grad_norm_(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # zero in place: gradients that are views stay views
        if device.type == "cuda":
            torch.cuda.synchronize()
        metrics.step(step, loss_sum.item(), lr, norm.item(), B * T, time.perf_counter() - t0, device, args.log_interval)
        profiler.step()
        if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0:
            checkpoint(step + 1, model, optimizer, config, args)
    profiler.stop()

    if args.eval_interval:
        metrics.eval(args.max_iters, evaluate())
    checkpoint(args.max_iters, model, optimizer, config, args)
    metrics.summary(model_state_bytes(optimizer), device)
    metrics.close()


# ---- PyTorch's own ZeRO-3, FSDP2, behind the same methods ----------------------------------

class TorchZeRO3(ZeRO3):
    """FSDP2 (fully_shard) on every block and on the root: every tensor a Shard(0) DTensor (N slices),
    all-gathered before each group's forward and backward, gradients reduce-scattered (averaged) every micro-step."""

    def __init__(self, config, args, device, state=None):
        self.args, self.device = args, device
        self.model = GPT(config, device="meta")
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if args.dtype == "bfloat16" else MixedPrecisionPolicy()  # bf16: gathers bf16, as Zero3 broadcasts it
        for block in self.model.transformer.h:
            fully_shard(block, mesh=self.mesh, mp_policy=mp)
        fully_shard(self.model, mesh=self.mesh, mp_policy=mp)
        self.model.to_empty(device=device)  # allocates only this rank's shards
        self.kept = list(self.model.named_parameters())
        with torch.no_grad():
            for name, p in self.kept:  # each rank cuts its shard from the full tensor
                full = state[name] if state is not None else init_tensor(name, p.shape, config, args.seed)
                p.copy_(self.local(full, p))

    def local(self, full, p):
        """Every rank has the full tensor: src_data_rank=None cuts this rank's shard, sending nothing."""
        return distribute_tensor(full.to(self.device), self.mesh, p.placements, src_data_rank=None).clone()

    def forward_backward(self, x, y, sync):
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        (loss / self.args.grad_accum_steps).backward()  # reduce-scatters on every micro-step, as Zero3 reduces
        return loss.detach().float()

    def clip_grad_norm_(self, max_norm):
        return clip_grad_norm_([p.grad.to_local() for p in self.model.parameters()], [], max_norm)

    def full_state(self, optimizer):
        full = lambda v: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()  # all-gathers a DTensor
        return ({k: full(v) for k, v in self.model.state_dict().items()},
                {n: {k: full(v) for k, v in optimizer.state[p].items()} for n, p in self.model.named_parameters()})

    def describe(self):
        return f"{num_params(self.model) / 1e6:.2f}M params, torch FSDP2 over {dist.get_world_size()} rank(s)"


class TorchZeRO1(ZeRO3):
    """Stage 1's peer: DistributedDataParallel (gradient buckets all-reduced during backward, as GradientBuckets)
    with torch.distributed.optim.ZeroRedundancyOptimizer(AdamW): each rank's AdamW over the whole parameters its
    greedy partition gives it (per param group, largest first), then a broadcast from each owner (one per owner: the
    parameters are views of a bucket per rank, parameters_as_bucket_view)."""

    def __init__(self, config, args, device, state=None):
        self.model, self.args, self.device = GPT(config, seed=args.seed, device=device), args, device
        if state is not None:
            self.model.load_state_dict(state)
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=BUCKET_CAP_MB,
            gradient_as_bucket_view=True)

    def configure_optimizer(self, args, state=None):
        named = list(self.model.named_parameters())
        contract = configure_optimizer(named, args.weight_decay, args.learning_rate, (args.beta1, args.beta2))
        optimizer = ZeroRedundancyOptimizer(contract.param_groups, torch.optim.AdamW, parameters_as_bucket_view=True)
        optimizer.state = optimizer.optim.state  # its own stays empty: the local AdamW's is this rank's state
        self.owned = [p for group in optimizer.optim.param_groups for p in group["params"]]
        names = {p: n for n, p in named}
        for p in self.owned if state else ():
            set_adamw_state(optimizer, p, state[names[p]], lambda t: self.local(t, p))
        if dist.get_rank() == 0:  # both partitions: ours (one greedy pass) and ZeRO's (a greedy pass per group)
            owner, load = partition([(n, p.shape) for n, p in named], dist.get_world_size(), 0)
            theirs = [[p for g in groups for p in g["params"]] for groups in optimizer._partition_parameters()]
            print_partition(owner, load, len(theirs), 0, [(len(t), sum(map(torch.numel, t))) for t in theirs])
        return optimizer

    def forward_backward(self, x, y, sync):
        with nullcontext() if sync else self.ddp.no_sync():
            with autocast(self.args, self.device):
                _, loss = self.ddp(x, y)
            (loss / self.args.grad_accum_steps).backward()
        return loss.detach().float()

    def clip_grad_norm_(self, max_norm):
        # DDP left every gradient on every rank: each element once, from its owner in ZeRO's partition
        return clip_grad_norm_([p.grad for p in self.owned], [], max_norm)

    def full_state(self, optimizer):
        optimizer.consolidate_state_dict(to=0)  # collective: every rank's AdamW state to rank 0 (pickled)
        if dist.get_rank() != 0:
            return None, None
        state = optimizer.state_dict()["state"]  # by position in param_groups
        names = {p: n for n, p in self.model.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return self.model.state_dict(), {names[p]: state[i] for i, p in enumerate(params)}

    def describe(self):
        return f"{num_params(self.model) / 1e6:.2f}M params, torch DDP + ZeroRedundancyOptimizer(AdamW)"


STAGES = {"custom": {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}, "pytorch": {1: TorchZeRO1, 3: TorchZeRO3}}  # --stage 2: no peer


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
