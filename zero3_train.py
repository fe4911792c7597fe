"""ZeRO, stages 1 to 3 (DeepSpeed style), written by hand: each tensor is owned whole by one rank.

ZeRO removes data parallelism's copies of the model state in three steps (--stage): 1 the AdamW
state, 2 the gradients too, 3 the parameters too; a rank keeps those only for the tensors it owns
(FSDP instead slices every tensor over the N ranks). Greedy partition, largest tensor first onto
the least-loaded rank: no rank owns more than P/N + the largest tensor (P_own: about P/N).
Memory per rank, fp32 (AdamW state: 8 bytes an element):
  stage 1:  4P params + 4P grads + 8P_own.
  stage 2:  4P params + 4P_own grads + 8P_own + the non-owned gradients in flight: <= 25 MiB.
  stage 3:  16P_own (its params, grads, AdamW state) + the non-owned tensors fetched at the moment.
What moves, per step of A micro-steps (bytes each rank hands to the collectives):
  stage 1:  the gradients' flat buffers all-reduced after the step's last backward, as DDP's
            (4P); AdamW steps the owned tensors only, then each owner broadcasts them (4P, one
            message: one flat buffer).
  stage 2:  each gradient goes to its owner with an async reduce as soon as backward has
            accumulated it, on every micro-step (A x 4P); a non-owner drops it once the reduce is
            waited for. Then stage 1's broadcasts (4P).
  stage 3:  stage 2's reduces, and no broadcast after the step: before each module's forward its
            tensors are broadcast from their owners, the next module's already in flight
            (--prefetch); after it the non-owners free them, but the tied wte stays until the head.
            Backward fetches and frees them again: per micro-step 2 broadcasts + 1 reduce of 4P,
            less one broadcast of wpe (a lookup's backward reads no weight) and of the tied wte.
  --dtype bfloat16: stages 1 and 2 autocast fp32 parameters, as ddp. Stage 3 computes with bf16
            parameters, broadcast in bf16 (2P bytes), and AdamW updates the owners' fp32 masters.
DeepSpeed's tuning knobs (--persistence_threshold, --reduce_bucket_mb, --max_reuse_distance) are
in zero3_tuning_train.py.

Run:
  python zero3_train.py                                   # single process: rank 0 owns everything
  torchrun --standalone --nproc_per_node=2 zero3_train.py # 2 ranks (2 GPUs, or 2 CPU processes)
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 zero3_train.py     # 2 nodes x 8 GPUs (node_rank=1 on node 2)
  torchrun --standalone --nproc_per_node=2 zero3_train.py --stage 1   # or 2; default 3
  python zero3_train.py --implementation pytorch          # FSDP2 (fully_shard): torch's own ZeRO-3
  python zero3_train.py --stage 1 --implementation pytorch  # DDP + ZeroRedundancyOptimizer(AdamW)
The traffic against DDP's, the measurements and the design choices: docs/zero3.md.
"""
import os
import time
from collections import deque
from functools import partial

import torch
import torch.distributed as dist

from common.checkpoint import checkpoint, gather_to_rank0, resume, set_adamw_state
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import Batches, get_batch
from common.distributed import autocast, clip_grad_norm_, setup, setup_data, teardown
from common.metrics import MFU, Metrics, Profiler, activations, model_state_bytes, timers
from common.model import GPT, compile_forward, configure_optimizer, init_tensor, num_params
from common.recompute import checkpoint_blocks
import peers.torch_zero3


# ---- stage 1: the AdamW state sharded; the gradients all-reduced, as in DDP -----------------

def partition(named_shapes, world_size):
    """{name: owner rank}, and the elements per rank. Greedy (LPT): largest tensor first, each onto
    the rank with the fewest elements so far (lowest rank on ties). Bound: when the most-loaded
    rank got its last tensor it was the least loaded, so max(load) <= P / N + largest."""
    sizes = {name: torch.Size(shape).numel() for name, shape in named_shapes}
    owner = dict.fromkeys(sizes)  # model order
    load = [0] * world_size
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # stable: equal sizes keep model order
        owner[name] = min(range(world_size), key=lambda r: load[r])
        load[owner[name]] += sizes[name]
    return owner, load


def flatten_(tensors):
    """One flat buffer whose views `tensors` become (a lone tensor is its own), values kept; with
    0 bytes when they hold none (stage 3: not fetched here)."""
    if len(tensors) == 1:
        return tensors[0]
    held = tensors[0].untyped_storage().nbytes() > 0  # a buffer's tensors: all held, or none
    sizes = [tensor.numel() for tensor in tensors]
    if held:
        flat = torch.cat([tensor.detach().flatten() for tensor in tensors])
    else:
        flat = torch.empty(sum(sizes), dtype=tensors[0].dtype, device=tensors[0].device)
    for tensor, view in zip(tensors, flat.split(sizes)):
        tensor.data = view.view_as(tensor)
    if not held:
        flat.untyped_storage().resize_(0)
    return flat


class OwnedAdamW(torch.optim.Optimizer):
    """Stages 1 and 2's optimizer, laid out as ZeroRedundancyOptimizer: param_groups hold every
    parameter, for the loop's lr and zero_grad; `adamw`, on the `kept` (name, tensor) pairs this
    rank owns, alone has state and steps. `owner`: {parameter: rank}."""

    def __init__(self, named_params, kept, owner, args):
        hyper = (args.weight_decay, args.learning_rate, (args.beta1, args.beta2))
        super().__init__(configure_optimizer(named_params, *hyper).param_groups, {})
        self.adamw = configure_optimizer(kept, *hyper)
        self.state = self.adamw.state  # 8 bytes (exp_avg, exp_avg_sq) per kept element, + the step
        self.flats = []  # (owner, its flat buffer: parameters_as_bucket_view), in rank order
        for rank in sorted(set(owner.values())):
            self.flats.append((rank, flatten_([p for p, r in owner.items() if r == rank])))

    @torch.no_grad()
    def step(self):
        for group, kept_group in zip(self.param_groups, self.adamw.param_groups):
            kept_group["lr"] = group["lr"]
        self.adamw.step()
        # Each owner sends its updated tensors (4 P_own bytes, one message) to every rank: the
        # replicas are equal again. Async, in owner order on every rank.
        works = [dist.broadcast(flat, src=owner, async_op=True) for owner, flat in self.flats]
        with timers("broadcast_wait"):
            for work in works:
                work.wait()


class GradientBuckets:
    """Flat buffers of about bucket_cap_mb that the .grads are views of: autograd accumulates
    straight into them, and the all-reduce needs no copy in or out. ddp_train.py also overlaps
    them with backward; stage 1 keeps the lesson on the optimizer (docs/zero3.md)."""

    def __init__(self, model, bucket_cap_mb):
        self.buffers = []
        bucket, size = [], 0
        params = [p for p in model.parameters() if p.requires_grad][::-1]  # backward's order
        for p in params + [None]:  # None: the end, which closes the last bucket
            if bucket and (p is None or size + 4 * p.numel() > bucket_cap_mb * 2**20):
                buffer = torch.zeros(size // 4, device=bucket[0].device)  # fp32
                for q, view in zip(bucket, buffer.split([q.numel() for q in bucket])):
                    q.grad = view.view_as(q)
                self.buffers.append(buffer)
                bucket, size = [], 0
            if p is not None:
                bucket.append(p)
                size += 4 * p.numel()

    def all_reduce(self):
        # Each buffer (numel x 4 bytes) to every rank, summed: every rank's gradients are already
        # g/N (its loss was divided by N), so the sum is the mean.
        works = [dist.all_reduce(flat, async_op=True) for flat in self.buffers]
        with timers("all_reduce_wait"):
            for work in works:
                work.wait()


class ZeRO1:
    """Stage 1 behind the loop's methods: the whole GPT and every gradient on every rank, as in DDP;
    OwnedAdamW keeps the owned tensors' AdamW state. Stages 2, 3 override methods (map: ZeRO3)."""
    dp_group = None  # the ranks that split the batch: all of them
    bucket_cap_mb = 25  # GradientBuckets' size, and stage 2's window: DDP's default
    sharded = "AdamW state"  # what describe() says is owned

    def __init__(self, config, args, device, state=None):
        self.args, self.device = args, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        shapes = [(n, p.shape) for n, p in GPT(config, device="meta").named_parameters()]
        owner = self.assign_owners(shapes)  # {name: rank}
        self.model, self.masters = self.build_model(config, owner, state)
        # --compile: each block, as ddp (one whole-model graph would leave every reduce to its end);
        # the head too (ln_f, lm_head, loss) but in stage 3, whose fetch hooks stay eager.
        compile_forward(self.model.transformer.h, args.compile)
        compile_forward([self.model], args.compile and args.stage < 3, method="head")
        checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        named = list(self.model.named_parameters())
        self.owner = {p: owner[n] for n, p in named}  # parameter -> its rank
        self.kept = [(n, self.masters[p]) for n, p in named if p in self.masters]  # AdamW's
        self.reduce_gradients()

    def assign_owners(self, named_shapes):
        """partition() over the ranks: {name: owner rank}, which rank 0 prints."""
        owner, load = partition(named_shapes, dist.get_world_size())
        if dist.get_rank() == 0:
            print_partition(owner, load)
        return owner

    def build_model(self, config, owner, state):
        """The whole model on every rank; returns it and {owned parameter: its master}: itself."""
        model = GPT(config, seed=self.args.seed, device=self.device)
        if state is not None:  # a full checkpoint from any script: every rank loads all of it
            model.load_state_dict(state)
        masters = {p: p for name, p in model.named_parameters() if owner[name] == self.rank}
        return model, masters

    def reduce_gradients(self):
        self.buckets = GradientBuckets(self.model, self.bucket_cap_mb)

    def configure_optimizer(self, args, state=None):
        optimizer = OwnedAdamW(self.model.named_parameters(), self.kept, self.owner, args)
        self.load_adamw_state(optimizer, state)
        return optimizer

    def load_adamw_state(self, optimizer, state):
        if state:  # a checkpoint's AdamW state by name: each rank loads what it keeps
            for name, p in self.kept:
                set_adamw_state(optimizer, p, state[name], partial(self.local, p))

    def local(self, p, full):
        """This rank's part of a full tensor, laid out like p: a whole tensor, all of it."""
        return full.to(self.device, copy=True)

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its loss. sync: the step's last micro-step."""
        with activations.first(), autocast(self.args, self.device):  # the bytes kept for backward
            _, loss = self.model(x, y)
        # Loss / (A*N): the buckets' plain sum over the ranks is the mean (docs/zero3.md).
        (loss / (self.args.grad_accum_steps * self.world_size)).backward()
        self.sync_gradients(sync)
        return loss.detach().float()

    def sync_gradients(self, sync):
        if sync:  # the earlier micro-steps only accumulated (DDP's no_sync)
            self.buckets.all_reduce()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # Each gradient element once: the owned ones, summed over the ranks (stage 1 holds all).
        owned = [self.masters[p].grad for p, r in self.owner.items() if r == self.rank]
        return clip_grad_norm_(owned, [], max_norm)

    def full_state(self, optimizer):
        return gather_full_state(self.model, optimizer, self.owner, self.masters)

    def describe(self):
        n = num_params(self.model) / 1e6
        return (f"{n:.2f}M params on every rank, {self.sharded} of whole tensors owned by one "
                f"of {self.world_size} rank(s)")


class TorchZeRO1(peers.torch_zero3.TorchZeRO1, ZeRO1):
    """--implementation pytorch --stage 1: DDP + ZeroRedundancyOptimizer (peers/torch_zero3.py)."""


# ---- stage 2: the gradients sharded too, each reduced to its owner -------------------------

class ReduceToOwner:
    """Stage 2's (and 3's) gradient reduces (module docstring). Hooks fire in the same order on
    every rank, so all issue the same reduces. `owner`: {parameter: rank}; `masters`: {owned
    parameter: its fp32 master}."""

    def __init__(self, owner, rank, masters, reduce_bucket_bytes):
        self.owner, self.masters = owner, masters
        self.owned = [masters[p] for p, r in owner.items() if r == rank]
        self.reduces = deque()  # (gradient, its in-flight reduce), oldest first
        self.in_flight = 0  # the bytes of those gradients
        self.window = reduce_bucket_bytes  # the most bytes in flight
        self.first_micro_step = True  # the next backward's gradients replace zero_grad's zeros
        for p in owner:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p):
        # Each rank sends p's fp32 gradient (numel x 4 bytes; tied wte: once, both uses summed) to
        # the owner, which receives the sum; the owner's holds the earlier micro-steps' sums too.
        master = self.masters.get(p)  # None: owned elsewhere
        if master is p:  # owned, fp32: autograd accumulates the micro-steps into p.grad
            grad = p.grad
        elif master is None:  # owned elsewhere: this micro-step's, dropped here (the reduce has it)
            grad = p.grad.float()  # bf16: an fp32 copy
            p.grad = None
        else:  # owned, bf16: the micro-steps accumulate into the fp32 master's gradient
            if self.first_micro_step:  # in place of zero_grad's zeros: no pass to add them
                master.grad = p.grad.float()
            else:
                master.grad.add_(p.grad.float())
            grad = master.grad
            p.grad = None
        # At most `window` bytes in flight (DeepSpeed's reduce_bucket_size): wait for the oldest.
        nbytes = grad.numel() * grad.element_size()
        while self.reduces and self.in_flight + nbytes > self.window:
            self._wait_oldest()
        self.reduces.append((grad, dist.reduce(grad, dst=self.owner[p], async_op=True)))
        self.in_flight += nbytes

    def _wait_oldest(self):
        # CUDA: the compute stream waits; the gradient's memory serves the kernels queued after.
        grad, work = self.reduces.popleft()
        with timers("reduce_wait"):  # exposed communication: what the overlap did not hide
            work.wait()
        self.in_flight -= grad.numel() * grad.element_size()

    def finish_backward(self, sync):
        """Wait for the gradient reduces; afterwards no rank holds a non-owned gradient. sync: this
        was the step's last micro-step."""
        while self.reduces:
            self._wait_oldest()
        self.first_micro_step = sync  # after the step's last, a step starts


class ZeRO2(ZeRO1):
    """Stage 2: ZeRO1 with ReduceToOwner in place of GradientBuckets."""
    sharded = "AdamW state and gradients"

    def reduce_gradients(self):
        window = int(self.bucket_cap_mb * 2**20)  # bytes: one DDP bucket in flight, at most
        self.reducer = ReduceToOwner(self.owner, self.rank, self.masters, window)

    def sync_gradients(self, sync):
        self.reducer.finish_backward(sync)  # the reduces left during backward, on every micro-step


# ---- stage 3: the parameters sharded too, fetched around each module -------------------------

def materialize_owned_(model, owner, rank, values, device, dtype=torch.float32):
    """Deferred init of the meta `model`: storage and a value (`values[name]`) only for the fp32
    masters this rank owns; returns {parameter: master}. In fp32 the model computes with them; else,
    as with those owned elsewhere, with `dtype` parameters of 0 bytes, which a broadcast fills."""
    made = {}  # meta parameter -> the parameter the model computes with
    masters = {}  # meta parameter -> its fp32 master, for the owned ones
    for name, p in model.named_parameters():  # the tied weight appears once
        if owner[name] == rank:
            masters[p] = torch.nn.Parameter(values[name].to(device, torch.float32, copy=True))
        if p in masters and dtype == torch.float32:
            made[p] = masters[p]
        else:  # allocated and at once given back: at most one tensor's bytes, once
            made[p] = torch.nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype))
            made[p].untyped_storage().resize_(0)
    for name, p in model.named_parameters(remove_duplicate=False):  # lm_head gets wte's: still tied
        module, _, local = name.rpartition(".")
        setattr(model.get_submodule(module), local, made[p])
    return {made[p]: master for p, master in masters.items()}


class ParamFetcher:
    """Stage 3's parameters, broadcast around each module's forward and backward; every rank keeps
    the same `fetched`, so all issue the same broadcasts. `owner`: {parameter: rank}; `masters`:
    materialize_owned_'s."""

    def __init__(self, model, owner, rank, masters, prefetch=True):
        self.rank, self.prefetch = rank, prefetch
        self.units = [model.transformer.wte, model.transformer.wpe, *model.transformer.h,
                      model.transformer.ln_f, model.lm_head]  # the modules, in forward order
        # One broadcast per (module, owner): that owner's tensors of a module are one flat buffer.
        self.unit_buffers = []  # per module: {owner's rank: its flat buffer}, in rank order
        self.flat_master = {}  # flat buffer this rank owns -> its fp32 flat master
        for unit in self.units:
            buffers = {}
            for r in sorted({owner[p] for p in unit.parameters()}):
                params = [p for p in unit.parameters() if owner[p] == r]
                buffers[r] = self._buffer(params, r, masters)
            self.unit_buffers.append(buffers)
        # Module i's forward keeps (keep[i]) the buffers a later module uses again: the tied wte.
        self.keep = []
        for i, buffers in enumerate(self.unit_buffers):
            later = {flat for unit in self.unit_buffers[i + 1:] for flat in unit.values()}
            self.keep.append(set(buffers.values()) & later)
        # an embedding lookup's backward reads no weight: only the others are fetched again
        lookups = [i for i, unit in enumerate(self.units) if isinstance(unit, torch.nn.Embedding)]
        self.backward_order = [i for i in reversed(range(len(self.units))) if i not in lookups]
        self.fetched = {}  # flat buffer -> in-flight broadcast work, or None once it has arrived
        forward_order = range(len(self.units))
        for i, unit in enumerate(self.units):
            unit.register_forward_pre_hook(lambda m, inputs, i=i: self._before(i, forward_order))
            unit.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, args, out))

    def _buffer(self, params, owner, masters):
        """The flat buffer of `params` (tied wte: one for both modules), owned by `owner`, who also
        keeps their fp32 masters flat: in fp32 the buffer itself."""
        flat = flatten_(params)
        if owner == self.rank:
            owned = [masters[p] for p in params]
            self.flat_master[flat] = flat if owned[0] is params[0] else flatten_(owned)
        return flat

    def _fetch(self, i):
        for src, flat in self.unit_buffers[i].items():
            if flat in self.fetched:  # here already, or on its way
                continue
            master = self.flat_master.get(flat)  # this rank's fp32 master of it, if it owns it
            if master is not flat:  # held only while used: owned elsewhere, or a bf16 buffer
                flat.untyped_storage().resize_(flat.numel() * flat.element_size())
                if master is not None:
                    flat.data.copy_(master.detach())  # bf16: the owner casts its fp32 master
            # The owner sends its tensors (numel x 4 bytes; bf16: 2) to every rank, async. Through
            # .data: no version counter moves on the views autograd saved (bf16 too: no casts).
            self.fetched[flat] = dist.broadcast(flat.data, src=src, async_op=True)

    def _free(self, i, keep=()):
        for flat in self.unit_buffers[i].values():
            if flat in keep:
                continue
            if self.fetched.pop(flat, None) is not None:
                raise RuntimeError("freeing a tensor whose broadcast is still in flight")
            if self.flat_master.get(flat) is not flat:
                flat.untyped_storage().resize_(0)  # shapes kept; the bytes go back to the allocator

    def _before(self, i, order):
        """Before module i's forward (or backward): its tensors here, the next one's on the way."""
        self._fetch(i)
        if self.prefetch and i != order[-1]:
            self._fetch(order[order.index(i) + 1])  # the next module's broadcasts overlap this one
        with timers("broadcast_wait"):  # exposed communication: what the overlap did not hide
            for flat in self.unit_buffers[i].values():
                if self.fetched[flat] is not None:
                    self.fetched[flat].wait()
                    self.fetched[flat] = None

    def _after_forward(self, i, inputs, out):
        if out.requires_grad and i in self.backward_order:  # training: this module has a backward
            # Backward (docs/zero3.md): fetch at its output node's pre-hook; free once its input's
            # gradient is whole. Tensor hooks run first: freed before the previous one is fetched.
            out.grad_fn.register_prehook(lambda grads: self._before(i, self.backward_order))
            inputs[0].register_hook(lambda grad: self._free(i))
        if i != len(self.units) - 1 or not out.requires_grad:  # the head's wte stays for backward
            self._free(i, self.keep[i])


class ZeRO3(ZeRO2):
    """Stage 3: ZeRO2 with the GPT on meta, each rank materialising its own, and ParamFetcher.
    The calls, stage 1 -> 2 -> 3 (each method in the class named):
      ZeRO3(): ZeRO1.__init__: assign_owners -> ZeRO3.build_model (materialize_owned_) -> compile,
        recompute -> ZeRO2.reduce_gradients (ReduceToOwner's hooks); then ParamFetcher's hooks.
      forward_backward: ZeRO3's wraps ZeRO1's (forward, backward: ParamFetcher fetches and frees,
        ReduceToOwner._grad_ready sends each gradient), which ends in ZeRO2.sync_gradients.
      configure_optimizer: ZeRO3's; eval_loss, clip_grad_norm_, full_state: ZeRO1's."""

    def __init__(self, config, args, device, state=None):
        super().__init__(config, args, device, state)
        self.fetcher = ParamFetcher(self.model, self.owner, self.rank, self.masters, args.prefetch)

    def build_model(self, config, owner, state):
        """The GPT on meta, with storage only for what this rank owns (materialize_owned_)."""
        model = GPT(config, device="meta")  # shapes only
        owned = [(n, p) for n, p in model.named_parameters() if owner[n] == self.rank]
        if state is not None:  # a full checkpoint (any script, any world size): what is owned
            values = {n: state[n] for n, p in owned}
        else:
            values = {n: init_tensor(n, p.shape, config, self.args.seed) for n, p in owned}
        # bf16: computes with bf16 parameters, updates fp32 masters
        dtype = torch.bfloat16 if self.args.dtype == "bfloat16" else torch.float32
        masters = materialize_owned_(model, owner, self.rank, values, self.device, dtype)
        return model, masters

    def configure_optimizer(self, args, state=None):
        # Plain AdamW on the owned tensors: ParamFetcher broadcasts them when next used.
        betas = (args.beta1, args.beta2)
        optimizer = configure_optimizer(self.kept, args.weight_decay, args.learning_rate, betas)
        self.load_adamw_state(optimizer, state)
        return optimizer

    def forward_backward(self, x, y, sync):
        loss = super().forward_backward(x, y, sync)
        assert not self.fetcher.fetched, "a fetched tensor was not freed"
        return loss

    def describe(self):
        n = num_params(self.model) / 1e6
        return f"{n:.2f}M params, whole tensors owned by one of {self.world_size} rank(s)"


class TorchZeRO3(peers.torch_zero3.TorchZeRO3, ZeRO3):
    """--implementation pytorch: FSDP2 (fully_shard) in place of ParamFetcher and ReduceToOwner."""


STAGES = {"custom": {1: ZeRO1, 2: ZeRO2, 3: ZeRO3},
          "pytorch": {1: TorchZeRO1, 3: TorchZeRO3}}  # --stage 2: no peer
TUNING_KNOBS = ("persistence_threshold", "reduce_bucket_mb", "max_reuse_distance")


def add_zero3_flags(group):
    group.add_argument("--stage", type=int, choices=[1, 2, 3], default=3,
                       help="ZeRO stage: shard the AdamW state (1), and the gradients (2), "
                            "and the parameters (3)")
    add_bool(group, "--prefetch", True,
             "broadcast the next module's tensors while the current one computes")
    for flag in TUNING_KNOBS:
        group.add_argument(f"--{flag}", nargs="?", const=True, help="moved: zero3_tuning_train.py")


def check_zero3_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns the DP size."""
    for flag in TUNING_KNOBS:
        if getattr(args, flag) is not None:
            die(f"--{flag}: DeepSpeed's tuning knobs are in zero3_tuning_train.py")
    if args.stage < 3 and not args.prefetch:  # stages 1, 2 fetch nothing
        die("--prefetch: false applies to --stage 3 only")
    peers.torch_zero3.check_args(args, dict(prefetch=True))
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
    dp_rank = rank * D // world_size
    rows = B // D  # rows per data-parallel rank
    micro = rows // A  # rows per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    Strategy = STAGES[args.implementation][args.stage]
    model = Strategy(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    mfu = MFU(config, args, device, world_size)  # model FLOPs utilisation, per log line
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start, mfu=mfu)
    if rank == 0:
        print(f"zero3 ({args.implementation}): {world_size} rank(s) on {device} in {args.dtype}, "
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
        for j in range(A):  # stage 1 syncs gradients on the last micro-step only; 2, 3 on each
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


# ---- the full checkpoint and the partition banner ------------------------------------------

@torch.no_grad()
def gather_full_state(model, optimizer, owner, masters):
    """The full checkpoint's model and optimizer dicts in rank 0's CPU memory (None elsewhere):
    each owner sends rank 0 its fp32 masters, exp_avg, exp_avg_sq (4 x numel bytes each) and step
    (4 bytes), a tensor a message (gather_to_rank0). `owner`: {parameter: rank};
    `masters`: {parameter: the tensor AdamW updates here}."""
    entries = []
    for name, p in model.named_parameters():
        if owner[p] != dist.get_rank():
            continue
        state = optimizer.state[masters[p]]
        for key in ("param", "exp_avg", "exp_avg_sq", "step"):
            value = masters[p] if key == "param" else state[key]  # step: a CPU tensor
            make = lambda value=value, device=p.device: value.to(device, torch.float32)
            entries.append((name, key, () if key == "step" else p.shape, torch.float32, make))
    return gather_to_rank0(entries, True, model.config, next(model.parameters()).device)


def print_partition(owner, load):
    """Rank 0's banner: the tensors and bytes each rank owns."""
    owners = list(owner.values())
    print("partition: whole tensors, each owned by one rank:")
    for r, n in enumerate(load):
        print(f"  rank {r}: {owners.count(r):3d} tensors, {n * 4:>12,} bytes "
              f"({n / max(1, sum(load)):.1%})")
    if 0 in [owners.count(r) for r in range(len(load))]:
        print(f"warning: some of the {len(load)} ranks own no tensor (fewer tensors than ranks, "
              "or one tensor dominates); they only receive broadcasts", flush=True)


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
