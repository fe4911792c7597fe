"""FSDP: Fully Sharded Data Parallel, written by hand.

Each transformer block is one FSDP unit; the embeddings, final LayerNorm and the head (tied to the
embedding: one tensor) form the root unit. A unit's parameters live as one flat fp32 vector, padded
to a multiple of the N ranks and cut in N equal shards: rank r keeps only shard r, its `local_shard`,
and AdamW updates the shards. Before a unit's forward its shards are all-gathered into a full flat
buffer (`flat_param`) whose views become the module's parameters; after the forward it is freed.
Backward gathers it again and reduce-scatters the unit's flat gradient: each rank receives the mean
over ranks of its own shard. The next unit's all-gather starts early (prefetch) and up to two
reduce-scatters run while backward goes on. The root stays gathered through backward, like FSDP2's.
  memory per rank:  16P/N bytes (params, grads, AdamW state: all sharded) + the gathered units
  communication:    all-gather 4P bytes (forward), all-gather 4P (backward), reduce-scatter 4P of
                    gradients, each (N-1)/N of them per rank: 1.5x DDP's all-reduce. Accumulation
                    reduce-scatters every micro-step (A x that, but 4P/N gradient bytes held, not
                    4P). --dtype bfloat16 gathers bf16 (half the bytes), reduce-scatters fp32.

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
import shutil
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from common.checkpoint import checkpoint as full_checkpoint, config_mismatch, load, resume as full_resume, save_atomic, \
    set_adamw_state
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import get_batch
from common.distributed import (all_gather_single, autocast, clip_grad_norm_, die_on_any,
                                reduce_scatter_single, setup, setup_data, teardown)
from common.metrics import Metrics, Profiler, model_state_bytes, timers
from common.model import GPT, configure_optimizer, init_tensor, num_params


# ---- the strategy: flat-parameter units, gathered for use and sharded at rest -----------
# (all_gather_single, reduce_scatter_single: torch's collectives of those names, or on torch < 2.13
# all_gather_into_tensor and reduce_scatter_tensor: common.distributed picks the name)

class FlatParamUnit:
    """One unit's parameters as one flat vector of `numel` values, padded to N shards of `shard_size`.
    `tensors`: [(names, shape, owners)], a tied tensor once with every (module, attribute) using it.
    `value_of(name, shape)`: a full tensor, asked for one at a time, only if it overlaps this rank's shard."""

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
        for module, attr in [owner for _, _, owners in self.tensors for owner in owners]:
            delattr(module, attr)  # no longer a registered parameter: a plain attribute, set by use_views()
        self.compute_dtype, self.flat_param, self.work, self.sent = compute_dtype, None, None, None
        self.post_backward = None  # called with flat_param once its gradient is complete (set by the driver)

    def shard_of(self, value_of):
        """This rank's piece of the flat vector of the tensors value_of(name, shape), padding zero."""
        shard, offset = torch.zeros(self.shard_size, device=self.device), 0
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
            # The gathered vector, a leaf made at first use (init never holds it): the module's parameters
            # are views of it, so autograd sums all their gradients (the tied head's and embedding's too)
            # into one flat_param.grad, ready to reduce-scatter without a copy. Storage only while gathered.
            self.flat_param = torch.empty(self.numel + self.padding, dtype=self.compute_dtype, device=self.device,
                                          requires_grad=True)
            self.flat_param.register_post_accumulate_grad_hook(lambda p: self.post_backward(p))
        else:
            self.flat_param.untyped_storage().resize_(self.flat_param.numel() * self.flat_param.element_size())
        self.sent = self.local_shard.detach().to(self.flat_param.dtype)  # bf16: a shard-sized cast; fp32: no copy
        # Sends this rank's shard_size values to every rank and receives every rank's shard, in rank
        # order, straight into the flat buffer: (N-1) x shard_size x 2 or 4 bytes in. Written through
        # .data, which autograd does not version: the views that forward saved for backward stay valid
        # when backward gathers into the same storage again.
        self.work = all_gather_single(self.flat_param.data, self.sent, async_op=True)

    def reshard(self):
        self.flat_param.untyped_storage().resize_(0)  # frees the buffer; the views keep their shapes

    def use_views(self):
        """The module's parameters as views of one split of the gathered buffer: one autograd node, so
        flat_param.grad is accumulated once, when all of the unit's gradients exist."""
        for (_, shape, owners), piece in zip(self.tensors, self.flat_param.split(self.numels + [self.padding])):
            for module, attr in owners:
                setattr(module, attr, piece.view(shape))


def unit_tensors(module, prefix, skip=None):
    """[(names, shape, owners)] of the parameters under `module`, but not under submodules `skip*`."""
    found = {}
    for mod_name, mod in module.named_modules(prefix=prefix.rstrip(".")):
        if skip and mod_name.startswith(skip):
            continue
        for attr, p in mod.named_parameters(recurse=False):
            names, _, owners = found.setdefault(id(p), ([], p.shape, []))
            names.append(f"{mod_name}.{attr}" if mod_name else attr)
            owners.append((mod, attr))
    return list(found.values())


class FullyShardedGPT:
    """Shards a GPT into units (one per block, plus the root) and drives them with module hooks:
    gather before forward, reshard after, gather again before backward, reduce-scatter after."""

    def __init__(self, model, value_of, rank, world_size, device, compute_dtype, reshard_after_forward, prefetch):
        kw = dict(value_of=value_of, rank=rank, world_size=world_size, device=device, compute_dtype=compute_dtype)
        self.blocks = [FlatParamUnit(unit_tensors(block, f"transformer.h.{i}."), **kw)
                       for i, block in enumerate(model.transformer.h)]
        self.root = FlatParamUnit(unit_tensors(model, "", skip="transformer.h."), **kw)
        self.units = self.blocks + [self.root]
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.pending = []  # in-flight reduce-scatters: (unit, received shard, sent gradient, work)
        units, modules = [self.root, *self.blocks], [model, *model.transformer.h]  # in forward's order
        for unit, module, next_unit in zip(units, modules, [*self.blocks, None]):
            module.register_forward_pre_hook(partial(self._pre_forward, unit, next_unit))
        for block, module, previous in zip(self.blocks, model.transformer.h, [None, *self.blocks]):
            module.register_forward_hook(partial(self._post_forward, block, previous))
        model.register_forward_hook(self._root_post_forward)
        for unit in self.units:
            unit.post_backward = partial(self._post_backward, unit)

    def _gather(self, unit, next_unit):
        """Wait for unit's all-gather (started now if not prefetched), then start next_unit's."""
        unit.unshard()
        if unit.work is not None:
            with timers("exposed_comm"):  # the part of the all-gather that prefetch did not hide
                unit.work.wait()
            unit.work = unit.sent = None
        if self.prefetch and next_unit is not None:
            next_unit.unshard()  # overlaps this unit's forward or backward

    def _pre_forward(self, unit, next_unit, module, args):
        self._gather(unit, next_unit)
        unit.use_views()

    def _post_forward(self, block, previous, module, args, out):
        if self.reshard_after_forward or not torch.is_grad_enabled():
            block.reshard()
        if torch.is_grad_enabled():  # runs before the block's backward, which needs the block before it next
            out.register_hook(lambda grad: self._gather(block, previous))

    def _root_post_forward(self, model, args, out):
        # The root stays gathered until its gradient is complete: its embedding runs first, its head last.
        if not torch.is_grad_enabled():
            self.root.reshard()
        elif self.prefetch and self.blocks:
            self.blocks[-1].unshard()  # the first block backward needs: overlaps the loss and head backward

    def _post_backward(self, unit, flat_param):
        # Runs once per backward, when autograd has summed all of the unit's gradients into flat_param.grad.
        grad = flat_param.grad.float()  # bf16 compute: gradients are reduced in fp32 (a copy); fp32: no copy
        flat_param.grad = None
        unit.reshard()
        shard = torch.empty(unit.shard_size, device=grad.device)
        # Each rank sends shard j of its flat gradient to rank j ((N-1) x shard_size x 4 bytes out) and
        # receives the others' shard `rank`, averaged: the mean over ranks of this rank's shard.
        work = reduce_scatter_single(shard, grad, op=dist.ReduceOp.AVG, async_op=True)
        self.pending.append((unit, shard, grad, work))
        self.finish_backward(in_flight=2)  # bound the full gradients held in flight to two units

    def finish_backward(self, in_flight=0):
        """Wait for the oldest reduce-scatters until `in_flight` remain (0: the end of backward)."""
        while len(self.pending) > in_flight:
            unit, shard, _, work = self.pending.pop(0)
            with timers("exposed_comm"):  # the part of the reduce-scatter that backward did not hide
                work.wait()
            unit.local_shard.grad += shard  # accumulated over micro-steps in the sharded gradient


class ShardedAdamW(torch.optim.AdamW):
    """AdamW over the units' flat shards. Its decoupled weight decay must skip biases and LayerNorm
    weights, which share a shard with the matrices: FlatParamUnit puts them last, so step() decays
    each shard's [:decay] range, as AdamW would each >= 2-dim tensor, then runs AdamW without decay."""

    def __init__(self, units, args):
        super().__init__([u.local_shard for u in units], lr=args.learning_rate, betas=(args.beta1, args.beta2),
                         eps=1e-8, weight_decay=0.0)
        self.units, self.decay_rate = units, args.weight_decay

    @torch.no_grad()
    def step(self, closure=None):
        for u in self.units:
            u.local_shard[:u.decay].mul_(1 - self.param_groups[0]["lr"] * self.decay_rate)
        return super().step(closure)


class FSDP:
    """The strategy behind the few methods the training loop calls: the GPT's parameters as flat
    shards driven by FullyShardedGPT, updated by ShardedAdamW."""
    dp_group = None  # the ranks that split the batch: all of them, which also share every unit

    def __init__(self, config, args, device, state=None):
        # From a checkpoint (full tensors, any world size) or --deferred_init (init_tensor) the GPT is built
        # on the meta device; each rank cuts its own shards from the full values, one tensor at a time.
        self.args, self.device = args, device
        self.model = GPT(config, seed=args.seed, device="meta" if args.deferred_init or state is not None else device)
        self.state_keys = list(self.model.state_dict())  # both tied names, in GPT's order
        full = dict(self.model.named_parameters())  # freed with __init__'s locals: only the shards remain
        value_of = (lambda name, shape: state[name]) if state is not None else \
            (lambda name, shape: init_tensor(name, shape, config, args.seed)) if args.deferred_init else \
            (lambda name, shape: full[name].detach())
        compute_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        self.fsdp = FullyShardedGPT(self.model, value_of, dist.get_rank(), dist.get_world_size(), device,
                                    compute_dtype, args.reshard_after_forward, args.prefetch)
        self.units = self.fsdp.units
        self.sharded_state = torch.load(sharded_file(args.resume_sharded, dist.get_rank()), map_location=device,
                                        weights_only=True)["units"] if args.resume_sharded else ()
        for unit, saved in zip(self.units, self.sharded_state):  # this rank's own file: the shards as saved
            unit.local_shard.data.copy_(saved.pop("local_shard"))

    def configure_optimizer(self, args, state=None):
        optimizer = ShardedAdamW(self.units, args)
        for unit in self.units if state else ():  # exp_avg, exp_avg_sq: cut into flat shards like the params
            optimizer.state[unit.local_shard] = dict(step=state[unit.tensors[0][0][0]]["step"].clone(), **{
                k: unit.shard_of(lambda name, shape: state[name][k]) for k in ("exp_avg", "exp_avg_sq")})
        for unit, saved in zip(self.units, self.sharded_state):  # --resume_sharded: this rank's own file
            optimizer.state[unit.local_shard] = saved  # its AdamW state ({} if saved before a step)
        return optimizer

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its loss. Each one reduce-scatters (see finish_backward): sync is not needed."""
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        (loss / self.args.grad_accum_steps).backward()  # each micro-step is 1/A of this rank's rows
        self.fsdp.finish_backward()
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # Each rank holds its own shard of every gradient (padding left out): squares summed over the ranks.
        return clip_grad_norm_([u.local_shard.grad[:u.valid] for u in self.units], [], max_norm)

    def full_state(self, optimizer):
        """The full model state_dict and AdamW state by name, gathered: complete on every rank."""
        tensors, optim = {}, {}
        for unit in self.units:
            state = optimizer.state.get(unit.local_shard, {})
            for key in ["param"] + [k for k in ("exp_avg", "exp_avg_sq") if k in state]:
                shard = unit.local_shard.detach() if key == "param" else state[key]
                gathered = shard.new_empty(unit.numel + unit.padding)
                # every rank's shard to every rank, in rank order: (N-1) x shard_size x 4 bytes in
                all_gather_single(gathered, shard.contiguous())
                for (names, shape, _), piece in zip(unit.tensors, gathered.split(unit.numels + [unit.padding])):
                    value = piece.view(shape).cpu()
                    if key == "param":
                        tensors.update({name: value.clone() for name in names})
                    else:
                        optim.setdefault(names[0], {"step": state["step"].clone()})[key] = value.clone()
        return {k: tensors[k] for k in self.state_keys}, optim

    def describe(self):
        return (f"{sum(u.numel for u in self.units) / 1e6:.2f}M params, {len(self.units)} units, "
                f"shards of {[u.shard_size for u in self.units]} values")


def add_fsdp_flags(group):
    add_bool(group, "--reshard_after_forward", True, "free gathered blocks after forward (false: ZeRO-2-like)")
    add_bool(group, "--prefetch", True, "start the next unit's all-gather early (false: custom only)")
    add_bool(group, "--deferred_init", False, "custom only: build on the meta device, materialise one tensor at a time")
    add_bool(group, "--sharded_checkpoint", False, "custom only: also write out_dir/sharded/, a file per rank")
    group.add_argument("--resume_sharded", default=None, help="custom only: resume from this sharded checkpoint folder")


def check_fsdp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns the DP size."""
    custom_only = dict(prefetch=True, deferred_init=False, sharded_checkpoint=False, resume_sharded=None)
    for flag, default in custom_only.items():
        if args.implementation == "pytorch" and getattr(args, flag) != default:  # FSDP2 always prefetches
            die(f"--{flag}: {str(getattr(args, flag)).lower()} is only supported by --implementation custom")
    check_batch_split(args, world_size)
    return world_size


# ---- the sharded checkpoint: a file per rank beside the full one -------------------------

def checkpoint(step, model, optimizer, config, args):
    """common's full checkpoint (ckpt.pt: gathered, portable). --sharded_checkpoint also writes, with no
    tensor communication, a checkpoint for the same world size only, under out_dir/sharded/:
      step_<N>/rank<r>.pt  rank r's shards and AdamW state ("units"), stamped with the save's header:
                           step, world_size, every GPTConfig field, folder, save (an id)
      manifest.pt          the header of the published save, written last (an atomic rename) by rank 0
                           once every rank's file is on disk
    Each save goes to a new folder, so a save that dies midway leaves the previous one published;
    the older folders are removed once the new one is published."""
    full_checkpoint(step, model, optimizer, config, args)
    if not args.sharded_checkpoint:
        return
    root, rank, header = os.path.join(args.out_dir, "sharded"), dist.get_rank(), [None]
    if rank == 0:  # the folder (never the published one: step_<N>_b when that is step_<N>), for every rank
        published = (load_file(os.path.join(root, "manifest.pt"))[0] or {}).get("folder")
        folder = f"step_{step}" + ("_b" if published == f"step_{step}" else "")
        shutil.rmtree(os.path.join(root, folder), ignore_errors=True)  # what a save that died there left
        header[0] = dict(step=step, world_size=dist.get_world_size(), **config.__dict__, folder=folder,
                         save=time.time_ns())
    dist.broadcast_object_list(header, src=0)
    header = header[0]
    save_atomic(dict(header, units=[{"local_shard": u.local_shard.detach(), **optimizer.state.get(u.local_shard, {})}
                                    for u in model.units]), os.path.join(root, header["folder"], f"rank{rank}.pt"))
    dist.barrier()  # every rank's file is written and fsync'd before the manifest publishes the folder
    if rank == 0:
        save_atomic(header, os.path.join(root, "manifest.pt"))
        for old in os.listdir(root):
            if old.startswith("step_") and old != header["folder"]:
                shutil.rmtree(os.path.join(root, old))


def load_file(path):
    """(what torch saved at path, None), or (None, why it cannot be read: missing, truncated, not torch's)."""
    saved, e = load(path)
    return saved, e and f"{path} cannot be read ({type(e).__name__})"


def sharded_file(path, rank):
    """Rank's file in the folder that the manifest of the sharded checkpoint at path publishes."""
    return os.path.join(path, load_file(os.path.join(path, "manifest.pt"))[0]["folder"], f"rank{rank}.pt")


def check_sharded(args, rank, world_size):
    """None if this rank can resume from the sharded checkpoint at args.resume_sharded, else the error line:
    the manifest must fit this run's world size and model flags, and this rank's file the manifest."""
    path = args.resume_sharded
    manifest, error = load_file(os.path.join(path, "manifest.pt"))
    if error or not isinstance(manifest, dict) or "folder" not in manifest:
        return f"--resume_sharded: {error or f'{path}/manifest.pt is not a sharded checkpoint manifest'}"
    if manifest["world_size"] != world_size:
        return f"--resume_sharded: {path} was written by {manifest['world_size']} ranks, this run has {world_size}"
    mismatch = config_mismatch(manifest, args)  # every GPTConfig field but dropout, as --resume checks
    if mismatch is not None:
        key, saved, value = mismatch
        return f"--resume_sharded: {path} was saved with {key}={saved}, this run has --{key} {value}"
    if manifest["step"] > args.max_iters:
        return f"--resume_sharded: {path} is at step {manifest['step']}, past --max_iters {args.max_iters}"
    file = os.path.join(path, manifest["folder"], f"rank{rank}.pt")
    saved, error = load_file(file)
    if error or not isinstance(saved, dict):
        return f"--resume_sharded: {error or f'{file} is not a sharded checkpoint file'}"
    for key, value in manifest.items():  # a file of another save (a mixed set) differs in step or save
        if saved.get(key) != value:
            return (f"--resume_sharded: {file} is not of the save that {path}/manifest.pt publishes "
                    f"({key} {saved.get(key)}, not {value})")
    return None


def resume(args):
    """common's resume; with --resume_sharded, the sharded checkpoint's step (FSDP loads the rest), once every
    rank has checked its own file: the verdicts are gathered, so a bad one ends all ranks with one line."""
    ckpt = full_resume(args)
    if args.resume_sharded:
        die_on_any(check_sharded(args, dist.get_rank(), dist.get_world_size()))
        manifest = load_file(os.path.join(args.resume_sharded, "manifest.pt"))[0]
        ckpt = dict(ckpt or dict(model=None, optimizer=None), step=manifest["step"])
    return ckpt


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("fsdp", add_fsdp_flags, argv)
    D = check_fsdp_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank, rows, micro = rank * D // world_size, B // D, B // D // A  # rows per DP rank; per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    model = (FSDP if args.implementation == "custom" else TorchFSDP)(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start)
    if rank == 0:
        print(f"fsdp ({args.implementation}): {world_size} rank(s) on {device}, {model.describe()}; global batch "
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


# ---- PyTorch's own FSDP, behind the same methods -------------------------------------------

class TorchFSDP(FSDP):
    """torch.distributed.fsdp.fully_shard (FSDP2) on every block and on the root: each parameter a
    DTensor sharded on dim 0, all-gathered by per-module hooks, gradients reduce-scattered."""

    def __init__(self, config, args, device, state=None):
        self.model, self.args, self.device = GPT(config, seed=args.seed, device=device), args, device
        if state is not None:
            self.model.load_state_dict(state)  # every rank loads it whole; fully_shard keeps its dim-0 shards
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if args.dtype == "bfloat16" else MixedPrecisionPolicy()
        for block in self.model.transformer.h:
            fully_shard(block, reshard_after_forward=args.reshard_after_forward, mp_policy=mp)
        fully_shard(self.model, reshard_after_forward=False, mp_policy=mp)  # the root stays gathered, as in ours

    def configure_optimizer(self, args, state=None):
        # DTensor parameters keep their global shapes, so the >= 2-dim decay rule applies unchanged
        optimizer = configure_optimizer(self.model.named_parameters(), args.weight_decay, args.learning_rate,
                                        (args.beta1, args.beta2))
        for name, p in self.model.named_parameters() if state else ():
            # each rank cuts its shard of the state from its own full copy (src_data_rank=None: no communication)
            set_adamw_state(optimizer, p, state[name], lambda t: distribute_tensor(
                t.to(self.device), p.device_mesh, p.placements, src_data_rank=None))
        return optimizer

    def forward_backward(self, x, y, sync):
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        (loss / self.args.grad_accum_steps).backward()  # FSDP2 reduce-scatters every micro-step too
        return loss.detach().float()

    def clip_grad_norm_(self, max_norm):
        # the local tensors of FSDP2's DTensor gradients: this rank's dim-0 rows, no padding
        return clip_grad_norm_([p.grad.to_local() for p in self.model.parameters()], [], max_norm)

    def full_state(self, optimizer):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # complete on rank 0
        return (get_model_state_dict(self.model, options=options),
                get_optimizer_state_dict(self.model, optimizer, options=options).get("state", {}))

    def describe(self):
        return f"{num_params(self.model) / 1e6:.2f}M params, torch FSDP2 (fully_shard)"


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
