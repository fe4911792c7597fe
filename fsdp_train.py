"""FSDP: Fully Sharded Data Parallel, written by hand.

Each transformer block is one FSDP "unit", and the embeddings, final LayerNorm and the head (tied to
the embedding: one tensor) form the root unit. A unit's parameters live as one flat fp32 vector,
padded to a multiple of the N ranks and split in N equal shards: rank r keeps only shard r, its
`local_shard`, and the optimizer works on the shards, so params, grads and AdamW state are all
sharded: 16P/N bytes per rank instead of DDP's 16P, plus the units gathered at the moment.

Before a unit's forward its shards are all-gathered into a full flat buffer (`flat_param`) and the
module's parameters become views into that buffer; after the forward the buffer is freed (reshard
after forward). Backward gathers it again, computes the unit's gradient into one flat gradient, and
reduce-scatters it: every rank receives the mean over ranks of its own shard of the gradient. The
next unit's all-gather is started early (prefetch) and the reduce-scatters run while backward goes
on (at most two in flight, which bounds the unsharded gradients held), so communication
overlaps compute. Communication per step: 2 all-gathers of 4P bytes (forward
and backward) and 1 reduce-scatter of 4P bytes, each moving (N-1)/N of those bytes per rank: 1.5x
DDP's all-reduce (3 x (N-1)/N x 4P against 2 x (N-1)/N x 4P).

Choices: gradient accumulation reduce-scatters every micro-step into the sharded gradient (4P/N
bytes of gradient held, A x the reduce-scatter traffic) rather than holding 4P of unsharded
gradients until the last one. --dtype bfloat16 gathers bf16 params (half the all-gather bytes) and
reduce-scatters fp32 gradients (no bf16 rounding in the sum over ranks); shards and AdamW state
stay fp32. The root unit stays gathered from its forward to the end of its backward, like FSDP2's.

Run:
  python fsdp_train.py                                   # single process: one shard, the reference
  torchrun --standalone --nproc_per_node=2 fsdp_train.py # 2 ranks (2 GPUs, or 2 CPU processes)
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 fsdp_train.py       # 2 nodes x 8 GPUs (node_rank=1 on the other)
  python fsdp_train.py --implementation pytorch          # torch.distributed.fsdp.fully_shard (FSDP2)
  torchrun --standalone --nproc_per_node=2 fsdp_train.py --deferred_init --sharded_checkpoint
  torchrun --standalone --nproc_per_node=2 fsdp_train.py --resume_sharded out/fsdp/sharded
"""
import os
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from common.checkpoint import resume, save_atomic, save_checkpoint, set_adamw_state
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import get_batch
from common.distributed import autocast, setup, setup_data, teardown
from common.metrics import Metrics, peak_mem_bytes, tensor_bytes
from common.model import GPT, configure_optimizer, init_tensor


# ---- the strategy: flat-parameter units, gathered for use and sharded at rest -----------

class FlatParamUnit:
    """The parameters of one unit flattened into one vector of `numel` values, padded to N shards of
    `shard_size`. `tensors`: [(names, shape, owners)], a tied tensor listed once with every (module,
    attribute) that uses it. `value_of(name, shape)` gives a tensor's full value; only the tensors
    that overlap this rank's shard are asked for, one at a time (so deferred init never holds more
    than one full tensor besides the shards)."""

    def __init__(self, tensors, value_of, rank, world_size, device, compute_dtype):
        # Weight decay applies to tensors with >= 2 dims: they go first, so decay is one prefix range.
        self.tensors = sorted(tensors, key=lambda t: len(t[1]) < 2)
        self.numels = [torch.Size(shape).numel() for _, shape, _ in self.tensors]
        self.numel = sum(self.numels)
        self.shard_size = -(-self.numel // world_size)  # ceil: the padding (< N values) sits at the end
        self.padding = self.shard_size * world_size - self.numel
        self.start, self.device = rank * self.shard_size, device  # this shard's first index in the flat vector
        n_decay = sum(n for n, (_, shape, _) in zip(self.numels, self.tensors) if len(shape) >= 2)
        self.valid = max(0, min(self.shard_size, self.numel - self.start))  # real values (not padding) here
        self.decay = max(0, min(self.shard_size, n_decay - self.start))     # local_shard[:decay] is decayed
        self.local_shard = torch.nn.Parameter(self.shard_of(value_of))  # fp32: what AdamW updates
        self.local_shard.grad = torch.zeros_like(self.local_shard)
        for _, _, owners in self.tensors:
            for module, attr in owners:
                del module._parameters[attr]  # from now on a plain attribute, set by use_views()
        self.full_shape, self.compute_dtype = (self.shard_size * world_size,), compute_dtype
        self.flat_param = self.work = self.sent = None
        self.post_backward = None  # called with flat_param once its gradient is complete (set by the driver)

    def shard_of(self, value_of):
        """This rank's piece of the flat vector of the tensors value_of(name, shape), padding zero: how
        full tensors (the init, or a checkpoint's params and AdamW state) become a flat shard."""
        shard = torch.zeros(self.shard_size, device=self.device)
        offset = 0
        for (names, shape, _), n in zip(self.tensors, self.numels):
            lo, hi = max(offset, self.start), min(offset + n, self.start + self.shard_size)
            if lo < hi:
                shard[lo - self.start:hi - self.start] = value_of(names[0], shape).reshape(-1)[lo - offset:hi - offset]
            offset += n
        return shard

    def is_gathered(self):
        return self.flat_param is not None and self.flat_param.untyped_storage().nbytes() > 0

    def unshard(self):
        """Start gathering the full vector (async); a no-op when gathered or in flight."""
        if self.is_gathered():
            return
        if self.flat_param is None:
            # The gathered vector: a leaf in compute dtype, made at first use (so init never holds it);
            # the module's parameters become views of it, so autograd sums every view's gradient into
            # one flat_param.grad (the tied head and embedding included), ready to reduce-scatter
            # without a copy. Its storage exists only while gathered.
            self.flat_param = torch.empty(self.full_shape, dtype=self.compute_dtype, device=self.device,
                                          requires_grad=True)
            self.flat_param.register_post_accumulate_grad_hook(lambda p: self.post_backward(p))
        else:
            self.flat_param.untyped_storage().resize_(self.flat_param.numel() * self.flat_param.element_size())
        self.sent = self.local_shard.detach().to(self.flat_param.dtype)  # bf16: a shard-sized cast; fp32: no copy
        # Sends this rank's shard_size values to every rank and receives every rank's shard, in rank
        # order, straight into the flat buffer: (N-1) x shard_size x 2 or 4 bytes in. Written through
        # .data, which autograd does not version: the views that forward saved for backward stay valid
        # when backward gathers into the same storage again.
        # (all_gather_single is torch 2.13's name for all_gather_into_tensor.)
        self.work = dist.all_gather_single(self.flat_param.data, self.sent, async_op=True)

    def reshard(self):
        self.flat_param.untyped_storage().resize_(0)  # frees the buffer; the views keep their shapes

    def use_views(self):
        """Point the module's parameters at the gathered buffer: one split (one autograd node, so
        flat_param's gradient is accumulated once, when all of the unit's gradients exist)."""
        pieces = self.flat_param.split(self.numels + [self.padding])
        for (_, shape, owners), piece in zip(self.tensors, pieces):
            for module, attr in owners:
                setattr(module, attr, piece.view(shape))


def unit_tensors(module, prefix, skip=None):
    """[(names, shape, owners)] of the parameters under `module`, leaving out submodules whose name
    starts with `skip` (the blocks, when collecting the root unit). Tied tensors are listed once."""
    found = {}
    for mod_name, mod in module.named_modules(prefix=prefix.rstrip(".")):
        if skip and mod_name.startswith(skip):
            continue
        for attr, p in mod._parameters.items():
            if p is not None:
                names, _, owners = found.setdefault(id(p), ([], p.shape, []))
                names.append(f"{mod_name}.{attr}" if mod_name else attr)
                owners.append((mod, attr))
    return list(found.values())


class FullyShardedGPT:
    """Shards a GPT into units (one per block, plus the root) and drives them with module hooks:
    gather before forward, reshard after, gather again before backward, reduce-scatter after."""

    def __init__(self, model, value_of, rank, world_size, device, compute_dtype, reshard_after_forward, prefetch):
        make = partial(FlatParamUnit, value_of=value_of, rank=rank, world_size=world_size, device=device,
                       compute_dtype=compute_dtype)
        self.blocks = [make(unit_tensors(b, f"transformer.h.{i}.")) for i, b in enumerate(model.transformer.h)]
        self.root = make(unit_tensors(model, "", skip="transformer.h."))
        self.units = self.blocks + [self.root]
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.pending = []       # in-flight reduce-scatters: (unit, received shard, sent gradient, work)
        self.exposed_s = 0.0    # time spent waiting for communication (what overlap failed to hide)
        model.register_forward_pre_hook(self._root_pre_forward)
        model.register_forward_hook(self._root_post_forward)
        for i, block in enumerate(model.transformer.h):
            block.register_forward_pre_hook(partial(self._pre_forward, i))
            block.register_forward_hook(partial(self._post_forward, i))
        for unit in self.units:
            unit.post_backward = partial(self._post_backward, unit)

    def _ready(self, unit):
        unit.unshard()
        if unit.work is not None:
            t0 = time.perf_counter()
            unit.work.wait()
            self.exposed_s += time.perf_counter() - t0
            unit.work = unit.sent = None

    def _root_pre_forward(self, model, args):
        # The root stays gathered through forward and backward (its embedding is used first and its
        # head last), like FSDP2's root; it is freed once its gradient is complete.
        self._ready(self.root)
        self.root.use_views()
        if self.prefetch and self.blocks:
            self.blocks[0].unshard()

    def _pre_forward(self, i, block, args):
        self._ready(self.blocks[i])
        self.blocks[i].use_views()
        if self.prefetch and i + 1 < len(self.blocks):
            self.blocks[i + 1].unshard()  # overlaps block i's forward

    def _post_forward(self, i, block, args, out):
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.blocks[i].reshard()
        if torch.is_grad_enabled():
            out.register_hook(lambda grad: self._pre_backward(i))  # runs before block i's backward

    def _root_post_forward(self, model, args, out):
        if not torch.is_grad_enabled():
            self.root.reshard()
        elif self.prefetch and self.blocks:
            self.blocks[-1].unshard()  # the first block backward needs: overlaps the loss and head backward

    def _pre_backward(self, i):
        self._ready(self.blocks[i])
        if self.prefetch and i > 0:
            self.blocks[i - 1].unshard()  # overlaps block i's backward

    def _post_backward(self, unit, flat_param):
        # Runs once per backward, when autograd has summed all of the unit's gradients into flat_param.grad.
        grad = flat_param.grad.float()  # bf16 compute: gradients are reduced in fp32 (a copy); fp32: no copy
        flat_param.grad = None
        unit.reshard()
        shard = torch.empty(unit.shard_size, device=grad.device)
        # Each rank sends shard j of its flat gradient to rank j ((N-1) x shard_size x 4 bytes out) and
        # receives the others' shard `rank`, averaged: the mean over ranks of this rank's shard.
        # (reduce_scatter_single is torch 2.13's name for reduce_scatter_tensor.)
        work = dist.reduce_scatter_single(shard, grad, op=dist.ReduceOp.AVG, async_op=True)
        self.pending.append((unit, shard, grad, work))
        if len(self.pending) > 2:  # bound the full gradients held in flight to two units
            self._finish(self.pending.pop(0))

    def _finish(self, pending):
        unit, shard, _, work = pending
        t0 = time.perf_counter()
        work.wait()
        self.exposed_s += time.perf_counter() - t0
        # Accumulate into the sharded gradient (gradient accumulation reduce-scatters every micro-step:
        # 4P/N bytes of gradient held instead of 4P, for A x the reduce-scatter traffic).
        unit.local_shard.grad += shard

    def finish_backward(self):
        """The wait at the end of backward for the reduce-scatters still in flight."""
        while self.pending:
            self._finish(self.pending.pop(0))

    def local_grads(self):
        """This rank's gradient values, padding excluded."""
        return [u.local_shard.grad[:u.valid] for u in self.units]

    def gathered_bytes(self):
        return sum(u.flat_param.untyped_storage().nbytes() for u in self.units if u.flat_param is not None)


def clip_by_global_norm(grads, grad_clip):
    """The pinned global norm of sharded gradients: each rank sums the squares of its own values,
    all-reduce adds the N partial sums (one fp32 scalar each way). Then every shard is scaled by
    min(1, grad_clip / (norm + 1e-6)), the same factor on every rank. Returns the norm."""
    norm_sq = torch.stack([(g.float() * g.float()).sum() for g in grads]).sum()
    dist.all_reduce(norm_sq, op=dist.ReduceOp.SUM)
    norm = norm_sq.sqrt()
    if grad_clip > 0:
        clip = (grad_clip / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(clip)
    return norm


def add_fsdp_flags(group):
    add_bool(group, "--reshard_after_forward", True, "free gathered units after forward (false: keep until backward, like ZeRO-2)")
    add_bool(group, "--prefetch", True, "start the next unit's all-gather early (false: custom only)")
    add_bool(group, "--deferred_init", False, "custom only: build on the meta device, materialise one tensor at a time")
    add_bool(group, "--sharded_checkpoint", False, "custom only: also write out_dir/sharded/ (a file per rank + manifest)")
    group.add_argument("--resume_sharded", default=None, help="custom only: resume from this sharded checkpoint folder")


# ---- setup -------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("fsdp", add_fsdp_flags, argv)
    for flag, default in (("prefetch", True), ("deferred_init", False), ("sharded_checkpoint", False), ("resume_sharded", None)):
        if args.implementation == "pytorch" and getattr(args, flag) != default:  # FSDP2 always prefetches
            die(f"--{flag}: {str(getattr(args, flag)).lower()} is only supported by --implementation custom")
    if args.resume_sharded and not os.path.exists(os.path.join(args.resume_sharded, "manifest.pt")):
        die(f"--resume_sharded: no manifest.pt in {args.resume_sharded}")
    check_batch_split(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint from any script at any world size: re-sharded below
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    rows, micro = B // world_size, B // world_size // A  # this rank's rows; rows per micro-step
    compute_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32

    custom, saved = args.implementation == "custom", ckpt["optimizer"] if ckpt else {}
    model = GPT(config, seed=args.seed, device="meta" if custom and (args.deferred_init or ckpt) else device)
    state_keys = list(model.state_dict().keys())  # both tied names, in GPT's order
    if custom:
        # Resuming re-shards here: value_of reads the checkpoint's full tensors, and each rank cuts its own
        # flat shards from them (no communication), whatever the world size that wrote them.
        full = dict(model.named_parameters())
        value_of = (lambda name, shape: ckpt["model"][name]) if ckpt else \
            (lambda name, shape: init_tensor(name, shape, config, args.seed)) if args.deferred_init else \
            (lambda name, shape: full[name].detach())
        fsdp = FullyShardedGPT(model, value_of, rank, world_size, device, compute_dtype,
                               args.reshard_after_forward, args.prefetch)
        del full  # the whole model's tensors are freed here: only the shards remain
        shards = [u.local_shard for u in fsdp.units]
        optimizer = torch.optim.AdamW(shards, lr=args.learning_rate, betas=(args.beta1, args.beta2), eps=1e-8,
                                      weight_decay=0.0)  # decay is applied to each shard's decay range below
        for u in fsdp.units if saved else ():  # AdamW sees flat shards, not names: set its state directly,
            # the flat exp_avg/exp_avg_sq shards cut from the full tensors like the params
            optimizer.state[u.local_shard] = dict(step=saved[u.tensors[0][0][0]]["step"].clone(), **{
                k: u.shard_of(lambda name, shape: saved[name][k]) for k in ("exp_avg", "exp_avg_sq")})
        n_params = sum(u.numel for u in fsdp.units)
    else:
        fsdp = None
        if ckpt:
            model.load_state_dict(ckpt["model"])  # every rank loads it whole; fully_shard keeps its dim-0 shards
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if args.dtype == "bfloat16" else MixedPrecisionPolicy()
        for block in model.transformer.h:
            fully_shard(block, reshard_after_forward=args.reshard_after_forward, mp_policy=mp)
        fully_shard(model, reshard_after_forward=False, mp_policy=mp)  # the root stays gathered, as in ours
        # DTensor parameters keep their global shapes, so the >= 2-dim decay rule applies unchanged
        optimizer = configure_optimizer(model.named_parameters(), args.weight_decay, args.learning_rate,
                                        (args.beta1, args.beta2))
        for name, p in model.named_parameters() if saved else ():
            # each rank cuts its shard of the state from its own full copy (src_data_rank=None: no communication)
            set_adamw_state(optimizer, p, saved[name],
                            lambda t: distribute_tensor(t.to(device), p.device_mesh, p.placements, src_data_rank=None))
        n_params = sum(p.numel() for p in model.parameters())
    start = load_sharded(fsdp, optimizer, args.resume_sharded, world_size) if args.resume_sharded else \
        ckpt["step"] if ckpt else 0
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start)
    if rank == 0:
        print(f"fsdp ({args.implementation}): {world_size} rank(s) on {device}, {n_params / 1e6:.2f}M params, "
              f"global batch {B} x {T} tokens, {A} micro-step(s) of {micro} rows per rank"
              + (f", {len(fsdp.units)} units, shards of {[u.shard_size for u in fsdp.units]} values" if fsdp else ""),
              flush=True)

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
    exposed_ms = []
    for step in range(start, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            metrics.eval(step, evaluate())
        t0 = time.perf_counter()
        if fsdp is not None:
            fsdp.exposed_s = 0.0
        lr = get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch("train", step, B, T, args.seed, args.dataset)
        x, y = x[rank * rows:(rank + 1) * rows].to(device), y[rank * rows:(rank + 1) * rows].to(device)
        loss_sum = torch.zeros((), device=device)
        for j in range(A):
            with autocast(args, device):
                _, loss = model(x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro])
            (loss / A).backward()  # each micro-step is 1/A of this rank's rows
            if fsdp is not None:
                fsdp.finish_backward()
            loss_sum += loss.detach().float()
        # Logged loss: the mean over all B*T tokens of the global batch (equal chunks: mean of means).
        loss_sum /= A
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        # FSDP2's local tensors hold no padding; ours exclude it
        grads = fsdp.local_grads() if fsdp is not None else [p.grad.to_local() for p in model.parameters()]
        norm = clip_by_global_norm(grads, args.grad_clip)
        if fsdp is not None:
            with torch.no_grad():  # AdamW's decoupled weight decay, on the >= 2-dim range of each shard
                for u in fsdp.units:
                    u.local_shard[:u.decay].mul_(1 - lr * args.weight_decay)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if fsdp is not None:
            exposed_ms.append(1000 * fsdp.exposed_s)
        metrics.step(step, loss_sum.item(), lr, norm.item(), B * T, time.perf_counter() - t0, device,
                     args.log_interval)
        if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0:
            checkpoint(model, fsdp, optimizer, state_keys, step + 1, config, args)

    if args.eval_interval:
        metrics.eval(args.max_iters, evaluate())
    checkpoint(model, fsdp, optimizer, state_keys, args.max_iters, config, args)
    state = [u.local_shard for u in fsdp.units] if fsdp else [p.to_local() for p in model.parameters()]
    state_bytes = tensor_bytes(state) * 2 + tensor_bytes(
        getattr(v, "_local_tensor", v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, (state_bytes, peak_mem_bytes(device)))
    extra = {"exposed_comm_ms": sorted(exposed_ms)[len(exposed_ms) // 2]} if exposed_ms else {}
    metrics.summary([s for s, _ in per_rank], [m for _, m in per_rank], **extra)
    metrics.close()


def full_state(model, fsdp, optimizer, state_keys):
    """The full, unsharded model state_dict and AdamW state by parameter name (a collective: every
    rank calls it; the tensors are complete on every rank for custom, on rank 0 for pytorch)."""
    if fsdp is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(model, options=options),
                get_optimizer_state_dict(model, optimizer, options=options).get("state", {}))
    tensors, optim = {}, {}
    for unit in fsdp.units:
        state = optimizer.state.get(unit.local_shard, {})
        sources = {"param": unit.local_shard.detach(), **{k: state[k] for k in ("exp_avg", "exp_avg_sq") if k in state}}
        for key, shard in sources.items():
            gathered = shard.new_empty(unit.shard_size * dist.get_world_size())
            dist.all_gather_single(gathered, shard.contiguous())  # the shards of every rank, in rank order
            for (names, shape, _), piece in zip(unit.tensors, gathered.split(unit.numels + [unit.padding])):
                if key == "param":
                    tensors.update({name: piece.view(shape).cpu().clone() for name in names})
                else:
                    optim.setdefault(names[0], {"step": state["step"].clone()})[key] = piece.view(shape).cpu().clone()
    return {k: tensors[k] for k in state_keys}, optim


def checkpoint(model, fsdp, optimizer, state_keys, step, config, args):
    """Gather the full state (every rank takes part); rank 0 writes it in the full format."""
    save_checkpoint(*full_state(model, fsdp, optimizer, state_keys), step, config, args)
    if args.sharded_checkpoint:
        save_sharded(fsdp, optimizer, step, os.path.join(args.out_dir, "sharded"))


def save_sharded(fsdp, optimizer, step, path):
    """Each rank writes its own shards and their AdamW state (no communication); rank 0 adds a
    manifest. Loads on the same number of ranks; ckpt.pt is the portable, full format."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    save_atomic([{"local_shard": u.local_shard.detach(), **optimizer.state.get(u.local_shard, {})} for u in fsdp.units],
                os.path.join(path, f"rank{rank}.pt"))
    dist.barrier()  # the manifest, written last, says every rank's file is complete
    if rank == 0:
        save_atomic(dict(step=step, world_size=world_size, units=[[names for names, _, _ in u.tensors] for u in fsdp.units],
                         shard_sizes=[u.shard_size for u in fsdp.units]), os.path.join(path, "manifest.pt"))


def load_sharded(fsdp, optimizer, path, world_size):
    manifest = torch.load(os.path.join(path, "manifest.pt"), weights_only=False)
    if manifest["world_size"] != world_size or manifest["shard_sizes"] != [u.shard_size for u in fsdp.units]:
        die(f"--resume_sharded: {path} was written by {manifest['world_size']} ranks for another model")
    saved = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), map_location=fsdp.units[0].device)
    for unit, state in zip(fsdp.units, saved):
        with torch.no_grad():
            unit.local_shard.copy_(state.pop("local_shard"))
        if state:
            optimizer.state[unit.local_shard] = state
    return manifest["step"]


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
