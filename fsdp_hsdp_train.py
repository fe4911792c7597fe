"""HSDP: hybrid sharded data parallel, fsdp_train.py sharded within a node, replicated across.

The world is R x S ranks (--replicate_size R): the S consecutive ranks of a node form a shard
group, and the R ranks that hold the same shard, one a node, a replicate group. Within its shard
group a rank does exactly what fsdp_train.py does over the world: each unit (a block; the root:
embeddings, ln_f and the tied head) is one flat fp32 vector cut in S shards, all-gathered before
use and its gradient reduce-scattered after backward. Then each rank's 1/S gradient shard, summed
over the micro-steps, is all-reduced across its R replicas: the one collective that crosses
nodes. The replicas then take the same AdamW step on equal shards and stay equal.
  memory per rank:  16P/S bytes (params, grads, AdamW state sharded S ways) + the gathered units
  within a node:    all-gather 4P (forward), all-gather 4P_blocks (backward), reduce-scatter 4P
                    of gradients, each (S-1)/S of them per rank, every micro-step
  between nodes:    one all-reduce of the 4P/S gradient shard per step (a ring: 2(R-1)/R x 4P/S
                    bytes per rank), overlapped with the last micro-step's backward; FSDP over all
                    R x S ranks would send its 3 x 4P a micro-step across nodes instead.
  --replicate_size 1 is fsdp_train.py; --replicate_size N (S = 1) is DDP with flat buckets.

Run:
  python fsdp_hsdp_train.py                                  # single process: the reference
  torchrun --standalone --nproc_per_node=4 fsdp_hsdp_train.py --replicate_size 2   # 2 x 2 ranks
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 fsdp_hsdp_train.py --replicate_size 2  # shard in a node
  python fsdp_hsdp_train.py --implementation pytorch         # FSDP2 on a 2-D device mesh
The groups, the bytes on each link and when HSDP pays: docs/fsdp.md.
"""
import os
import time
import weakref
from functools import partial

import torch
import torch.distributed as dist

from common.checkpoint import (checkpoint as full_checkpoint, resume as full_resume,
                               set_adamw_state)
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import Batches, get_batch
from common.distributed import (all_gather_single, autocast, clip_grad_norm_,
                                reduce_scatter_single, setup, setup_data, teardown)
from common.metrics import MFU, Metrics, Profiler, activations, model_state_bytes, timers
from common.model import FUSED_ADAMW, GPT, compile_forward, init_tensor
from common.recompute import checkpoint_blocks
from common.sharded_checkpoint import load_sharded, resume_sharded, save_sharded
from torch.distributed.device_mesh import init_device_mesh
import peers.torch_fsdp


# ---- the strategy: flat-parameter units, gathered for use and sharded at rest -----------
# (all_gather_single, reduce_scatter_single: torch's collectives of those names, or on torch < 2.13
# all_gather_into_tensor and reduce_scatter_tensor: common.distributed picks the name)

class FlatParamUnit:
    """One unit's parameters as one flat vector of `numel` values, padded to N shards of
    `shard_size`. `tensors`: [(names, shape, owners)], a tied tensor once with all its owners.
    `value_of(name, shape)`: a full tensor, asked for one at a time, if it overlaps our shard."""

    def __init__(self, tensors, value_of, rank, world_size, device, compute_dtype, group):
        # Weight decay applies to tensors with >= 2 dims: they go first, so decay is a prefix range.
        self.tensors = sorted(tensors, key=lambda entry: len(entry[1]) < 2)  # (name, shape, module)
        self.numels = [torch.Size(shape).numel() for _, shape, _ in self.tensors]
        self.numel = sum(self.numels)
        self.shard_size = -(-self.numel // world_size)  # ceil: the padding (< N values) at the end
        self.padding = self.shard_size * world_size - self.numel
        self.start = rank * self.shard_size  # this shard's first index in the flat vector
        self.device, self.compute_dtype = device, compute_dtype
        self.group = group  # the shard group: the S ranks this unit is cut over
        n_decay = sum(n for n, (_, shape, _) in zip(self.numels, self.tensors) if len(shape) >= 2)
        self.valid = max(0, min(self.shard_size, self.numel - self.start))  # values, not padding
        self.decay = max(0, min(self.shard_size, n_decay - self.start))  # [:decay] is decayed
        self.local_shard = torch.nn.Parameter(self.shard_of(value_of))  # fp32: what AdamW updates
        self.local_shard.grad = torch.zeros_like(self.local_shard)
        for _, _, owners in self.tensors:
            for module, attr in owners:
                delattr(module, attr)  # no longer a registered parameter: use_views() sets it
        self.flat_param = None  # the gathered buffer, made at first use
        self.work = None  # the in-flight all-gather
        self.sent = None  # its input, alive until it completes
        self.post_backward = None  # called with flat_param once its gradient is complete

    def shard_of(self, value_of):
        """This rank's piece of the flat vector of the tensors value_of(name, shape), padding 0."""
        shard = torch.zeros(self.shard_size, device=self.device)
        end = self.start + self.shard_size
        offset = 0
        for (names, shape, _), n in zip(self.tensors, self.numels):
            lo = max(offset, self.start)  # [lo, hi): where this tensor and the shard overlap
            hi = min(offset + n, end)
            if lo < hi:
                value = value_of(names[0], shape).reshape(-1)
                shard[lo - self.start:hi - self.start] = value[lo - offset:hi - offset]
            offset += n
        return shard

    def is_gathered(self):
        return self.flat_param is not None and self.flat_param.untyped_storage().nbytes() > 0

    def unshard(self):
        """Start gathering the full vector (async); a no-op when gathered or in flight."""
        if self.is_gathered():
            return
        if self.flat_param is None:
            # A leaf made at first use, with storage only while gathered: the module's parameters
            # are views of it, so autograd sums all their gradients (the tied ones too) into one
            # flat_param.grad, ready to reduce-scatter without a copy.
            self.flat_param = torch.empty(self.numel + self.padding, dtype=self.compute_dtype,
                                          device=self.device, requires_grad=True)
            # The hook holds the unit weakly: a tensor keeps its hooks in C++, out of sight of
            # gc, so flat_param -> hook -> unit -> flat_param would outlive the run, and with it
            # the unit's process group (teardown would warn).
            unit = weakref.ref(self)
            self.flat_param.register_post_accumulate_grad_hook(lambda p: unit().post_backward(p))
        else:
            nbytes = self.flat_param.numel() * self.flat_param.element_size()
            self.flat_param.untyped_storage().resize_(nbytes)
        self.sent = self.local_shard.detach().to(self.flat_param.dtype)  # bf16 a cast; fp32 no copy
        # Sends this rank's shard_size values to every rank of its shard group (its node) and
        # receives theirs, in rank order, into the flat buffer: (S-1) x shard_size x 2 or 4 bytes
        # in. Written
        # through .data, which autograd does not version: the views that forward saved for
        # backward stay valid when backward gathers into the same storage again.
        self.work = all_gather_single(self.flat_param.data, self.sent, self.group, async_op=True)

    def reshard(self):
        self.flat_param.untyped_storage().resize_(0)  # frees the buffer; views keep their shapes

    def use_views(self):
        """The module's parameters as views of one split of the gathered buffer: one autograd node,
        so flat_param.grad is accumulated once, when all of the unit's gradients exist."""
        pieces = self.flat_param.split(self.numels + [self.padding])
        for (_, shape, owners), piece in zip(self.tensors, pieces):
            for module, attr in owners:
                setattr(module, attr, piece.view(shape))


def unit_tensors(module, prefix, skip=None):
    """[(names, shape, owners)] of the parameters under `module`, not under submodules `skip*`."""
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
    """Shards a GPT into units (one per block, plus the root) over the shard group and drives them
    with module hooks: gather before forward, reshard after, gather again before backward,
    reduce-scatter after, and on the last micro-step all-reduce the shard across the replicas."""

    def __init__(self, model, value_of, groups, device, compute_dtype, reshard_after_forward,
                 prefetch):
        self.shard_group, self.replicate_group = groups
        kw = dict(value_of=value_of, rank=dist.get_rank(self.shard_group), device=device,
                  world_size=dist.get_world_size(self.shard_group), group=self.shard_group,
                  compute_dtype=compute_dtype)
        self.blocks = [FlatParamUnit(unit_tensors(block, f"transformer.h.{i}."), **kw)
                       for i, block in enumerate(model.transformer.h)]
        self.root = FlatParamUnit(unit_tensors(model, "", skip="transformer.h."), **kw)
        self.units = self.blocks + [self.root]
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.pending = []  # in-flight reduce-scatters: (unit, received shard, sent gradient, work)
        self.across = []  # in-flight all-reduces of gradient shards across the replicas
        self.sync = True  # this micro-step is the step's last: its shards go across the replicas
        units = [self.root, *self.blocks]  # in forward's order
        modules = [model, *model.transformer.h]
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
            unit.work = None
            unit.sent = None
        if self.prefetch and next_unit is not None:
            next_unit.unshard()  # overlaps this unit's forward or backward

    def _pre_forward(self, unit, next_unit, module, args):
        self._gather(unit, next_unit)
        unit.use_views()

    def _post_forward(self, block, previous, module, args, out):
        if self.reshard_after_forward or not torch.is_grad_enabled():
            block.reshard()
        if torch.is_grad_enabled():  # runs before the block's backward; the previous block is next
            # --activation_checkpointing full: that backward starts by running the block's forward
            # again, on the parameters gathered here: the recompute costs no extra all-gather
            out.register_hook(lambda grad: self._gather(block, previous))

    def _root_post_forward(self, model, args, out):
        # The root stays gathered until its gradient is complete (embedding first, head last).
        if not torch.is_grad_enabled():
            self.root.reshard()
        elif self.prefetch and self.blocks:
            self.blocks[-1].unshard()  # backward's first block: overlaps the loss and head backward

    def _post_backward(self, unit, flat_param):
        # Runs once per backward, when autograd has summed the unit's gradients in flat_param.grad.
        grad = flat_param.grad.float()  # bf16: reduced in fp32 (a copy); fp32: no copy
        flat_param.grad = None
        unit.reshard()
        shard = torch.empty(unit.shard_size, device=grad.device)
        # Each rank sends shard j of its flat gradient to rank j of its shard group ((S-1) x
        # shard_size x 4 bytes out) and receives the others' shard `rank`, summed: the sum over
        # this node's S ranks of g/N (every loss was divided by all N = R x S ranks).
        work = reduce_scatter_single(shard, grad, group=self.shard_group, async_op=True)
        self.pending.append((unit, shard, grad, work))
        self.finish_backward(in_flight=2)  # bound the full gradients in flight to two units

    def finish_backward(self, in_flight=0):
        """Wait for the oldest reduce-scatters until `in_flight` remain (0: the end of backward)."""
        while len(self.pending) > in_flight:
            unit, shard, _, work = self.pending.pop(0)
            with timers("exposed_comm"):  # the part of the reduce-scatter backward did not hide
                work.wait()
            unit.local_shard.grad += shard  # accumulated over micro-steps in the sharded gradient
            if self.sync and dist.get_world_size(self.replicate_group) > 1:
                # The step's sum over this node, sent to the R-1 replicas that hold the same
                # shard (a ring: 2(R-1)/R x shard_size x 4 bytes, between nodes) and summed: the
                # sum over all N ranks of g/N, the mean. Async: the earlier units' backward runs
                # while it crosses the network. Every rank issues the units' reduce-scatters and
                # all-reduces in backward's order, the same on every rank: no NCCL hang.
                grad = unit.local_shard.grad
                self.across.append(dist.all_reduce(grad, group=self.replicate_group,
                                                   async_op=True))
        if in_flight == 0:
            with timers("exposed_comm"):  # the all-reduces backward did not hide
                for work in self.across:
                    work.wait()
            self.across = []


class ShardedAdamW(torch.optim.AdamW):
    """AdamW over the units' flat shards. Weight decay must skip biases and LayerNorm weights, which
    share a shard with the matrices: FlatParamUnit puts them last, so step() decays each shard's
    [:decay] range, as AdamW would each >= 2-dim tensor, then runs AdamW without decay."""

    def __init__(self, units, args):
        shards = [u.local_shard for u in units]
        betas = (args.beta1, args.beta2)
        super().__init__(shards, lr=args.learning_rate, betas=betas, eps=1e-8, weight_decay=0.0,
                         fused=FUSED_ADAMW)
        self.units = units
        self.decay_rate = args.weight_decay

    @torch.no_grad()
    def step(self, closure=None):
        lr = self.param_groups[0]["lr"]
        for u in self.units:
            u.local_shard[:u.decay].mul_(1 - lr * self.decay_rate)
        return super().step(closure)


def hsdp_groups(replicate_size):
    """(this rank's shard group, its replicate group). Rank r x S + s is shard s of replica r:
    torchrun numbers a node's ranks consecutively, so a shard group is one node (when S is the
    GPUs a node) and a replicate group holds one rank of each node. Every rank creates every group,
    in the same order, as new_group requires."""
    grid = torch.arange(dist.get_world_size()).view(replicate_size, -1)  # (R, S): r x S + s
    shard_group, _ = dist.new_subgroups_by_enumeration(grid.tolist())  # a row each
    replicate_group, _ = dist.new_subgroups_by_enumeration(grid.t().tolist())  # a column each
    return shard_group, replicate_group


class FSDP:
    """The strategy behind the few methods the training loop calls: the GPT's parameters as flat
    shards over the shard group, driven by FullyShardedGPT, updated by ShardedAdamW."""
    dp_group = None  # the ranks that split the batch: all of them (R x S)

    def __init__(self, config, args, device, state=None):
        # From a checkpoint (full tensors, any world size) or --deferred_init the GPT is built on
        # the meta device; each rank cuts its own shards from the full values, a tensor at a time.
        self.args, self.device = args, device
        on_meta = args.deferred_init or state is not None
        self.model = GPT(config, seed=args.seed, device="meta" if on_meta else device)
        self.state_keys = list(self.model.state_dict())  # both tied names, in GPT's order
        full = dict(self.model.named_parameters())  # freed with __init__'s locals: shards remain

        def value_of(name, shape):  # one full tensor, asked for only where it meets our shard
            if state is not None:
                return state[name]
            if args.deferred_init:
                return init_tensor(name, shape, config, args.seed)
            return full[name].detach()
        compute_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        rank = dist.get_rank()
        groups = hsdp_groups(args.replicate_size)
        self.sharded = FullyShardedGPT(self.model, value_of, groups, device, compute_dtype,
                                       args.reshard_after_forward, args.prefetch)
        self.units = self.sharded.units
        # --compile: each block's forward; the gather, reshard and backward-gather hooks around
        # it stay eager, and the root (its hooks wrap GPT.forward) with them; and the head (ln_f,
        # lm_head, the loss fused), inside the root's gather
        compile_forward(self.model.transformer.h, args.compile)
        compile_forward([self.model], args.compile, method="head")
        checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        self.sharded_state = None  # --resume_sharded: this rank's own file, a dict per unit
        if args.resume_sharded:
            self.sharded_state = load_sharded(args.resume_sharded, rank, device)
            for unit, saved in zip(self.units, self.sharded_state):  # the shards as saved
                if saved["local_shard"].numel() != unit.shard_size:
                    die(f"--resume_sharded: saved with shards of {saved['local_shard'].numel()} "
                        f"values, this run's have {unit.shard_size}: use its --replicate_size")
                unit.local_shard.data.copy_(saved.pop("local_shard"))

    def configure_optimizer(self, args, state=None):
        optimizer = ShardedAdamW(self.units, args)
        if state:  # a checkpoint's AdamW state by name (empty before a step): cut like the params
            for unit in self.units:
                unit_state = dict(step=state[unit.tensors[0][0][0]]["step"])  # all equal
                for k in ("exp_avg", "exp_avg_sq"):
                    unit_state[k] = unit.shard_of(lambda name, shape: state[name][k])
                set_adamw_state(optimizer, unit.local_shard, unit_state)
        if self.sharded_state is not None:  # --resume_sharded: this rank's own file
            for unit, saved in zip(self.units, self.sharded_state):
                set_adamw_state(optimizer, unit.local_shard, saved)  # ({} before a step)
        return optimizer

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its loss. Every one reduce-scatters within the node; sync (the
        last): the shards are also all-reduced across the replicas."""
        self.sharded.sync = sync
        with activations.first(), autocast(self.args, self.device):  # the bytes kept for backward
            _, loss = self.model(x, y)
        # Each micro-step is 1/A of this rank's rows and each rank 1/N of the batch: backward of
        # loss/(A*N) writes g/(A*N), and the reduce-scatters' sums are the mean (docs/design.md).
        N = dist.get_world_size()  # the ranks the reduce-scatters sum over
        (loss / (self.args.grad_accum_steps * N)).backward()
        self.sharded.finish_backward()
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # Each rank holds its shard of every gradient (no padding), equal on its R replicas:
        # squares summed over the shard group's ranks, which hold every shard once.
        shards = [u.local_shard.grad[:u.valid] for u in self.units]
        return clip_grad_norm_(shards, [], max_norm, group=self.sharded.shard_group)

    def full_state(self, optimizer):
        """The full model state_dict and AdamW state by name in rank 0's CPU memory (None
        elsewhere): one flat tensor of one unit gathered at a time, as forward gathers it, and
        copied to the CPU by rank 0 before the next; the other ranks keep nothing."""
        rank0 = dist.get_rank() == 0
        if dist.get_rank(self.sharded.replicate_group) != 0:
            return None, None  # the first replica (rank 0's node) holds every shard: the rest wait
        tensors, optim = {}, {}
        for unit in self.units:
            state = optimizer.state.get(unit.local_shard, {})
            shards = {"param": unit.local_shard.detach()}
            shards.update({k: state[k] for k in ("exp_avg", "exp_avg_sq") if k in state})
            for key, shard in shards.items():
                gathered = shard.new_empty(unit.numel + unit.padding)
                # the shard group's shards to each of its ranks, in order: (S-1) x shard_size x 4
                all_gather_single(gathered, shard.contiguous(), group=self.sharded.shard_group)
                if not rank0:
                    continue
                pieces = gathered.split(unit.numels + [unit.padding])
                for (names, shape, _), piece in zip(unit.tensors, pieces):
                    value = piece.view(shape).to("cpu", copy=True)
                    if key == "param":
                        tensors.update(dict.fromkeys(names, value))  # both tied names: one copy
                    else:
                        step = state["step"].to("cpu", copy=True)
                        optim.setdefault(names[0], {"step": step})[key] = value
        if not rank0:
            return None, None
        return {k: tensors[k] for k in self.state_keys}, optim

    def describe(self):
        return (f"{sum(u.numel for u in self.units) / 1e6:.2f}M params, {len(self.units)} units, "
                f"shards of {[u.shard_size for u in self.units]} values")


class TorchFSDP(peers.torch_fsdp.TorchFSDP, FSDP):
    """--implementation pytorch: torch's fully_shard (FSDP2) on a 2-D ("replicate", "shard")
    device mesh, FSDP2's HSDP, in place of FullyShardedGPT and ShardedAdamW (peers/torch_fsdp.py);
    the other methods are FSDP's."""

    def __init__(self, config, args, device, state=None):
        shape = (args.replicate_size, dist.get_world_size() // args.replicate_size)  # (R, S)
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
        self.norm_group = self.mesh.get_group("shard")  # each shard once
        super().__init__(config, args, device, state)

    def forward_backward(self, x, y, sync):
        self.model.set_requires_all_reduce(sync)  # across the replicas on the last micro-step
        return super().forward_backward(x, y, sync)


def add_fsdp_flags(group):
    add_bool(group, "--reshard_after_forward", True,
             "free gathered blocks after forward (false: ZeRO-2-like)")
    add_bool(group, "--prefetch", True,
             "start the next unit's all-gather early (false: custom only)")
    add_bool(group, "--deferred_init", False,
             "custom only: build on the meta device, materialise one tensor at a time")
    add_bool(group, "--sharded_checkpoint", False,
             "custom only: also write out_dir/sharded/, a file per rank")
    group.add_argument("--resume_sharded", default=None,
                       help="custom only: resume from this sharded checkpoint folder")
    group.add_argument("--replicate_size", type=int, default=1,
                       help="R: replicas, each sharded over world_size / R consecutive ranks")


def check_fsdp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns the DP size."""
    # the defaults of the flags FSDP2 has no counterpart for (it always prefetches)
    custom_only = dict(prefetch=True, deferred_init=False, sharded_checkpoint=False,
                       resume_sharded=None)
    for flag, default in custom_only.items():
        value = getattr(args, flag)
        if args.implementation == "pytorch" and value != default:
            die(f"--{flag}: {str(value).lower()} is only supported by --implementation custom")
    if args.replicate_size < 1 or world_size % args.replicate_size:
        die(f"--replicate_size: must be >= 1 and divide the world size {world_size}, "
            f"got {args.replicate_size}")
    check_batch_split(args, world_size)
    return world_size


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("fsdp", add_fsdp_flags, argv)
    D = check_fsdp_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank = rank * D // world_size
    rows = B // D  # rows per data-parallel rank
    micro = rows // A  # rows per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    Strategy = FSDP if args.implementation == "custom" else TorchFSDP
    model = Strategy(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    mfu = MFU(config, args, device, world_size)  # model FLOPs utilisation, per log line
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start, mfu=mfu)
    if rank == 0:
        print(f"fsdp ({args.implementation}): {world_size} rank(s) on {device} in {args.dtype}, "
              f"{args.replicate_size} replica(s) x {world_size // args.replicate_size} shards, "
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
        for j in range(A):  # each micro-step reduce-scatters its gradients (sharded: no no_sync)
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


# ---- checkpoints: the full one, and with --sharded_checkpoint this rank's shards beside it ------

def checkpoint(step, model, optimizer, config, args):
    """common's full checkpoint (ckpt.pt: gathered, portable); --sharded_checkpoint also writes each
    rank's flat shards and their AdamW state, with no communication, to out_dir/sharded/
    (common/sharded_checkpoint.py: a file per rank, for a run at the same world size)."""
    full_checkpoint(step, model, optimizer, config, args)
    if not args.sharded_checkpoint:
        return
    units = []
    for u in model.units:
        adamw_state = optimizer.state.get(u.local_shard, {})
        units.append({"local_shard": u.local_shard.detach(), **adamw_state})
    save_sharded(step, units, config, args)


def resume(args):
    """common's resume; with --resume_sharded, the sharded checkpoint's step (FSDP loads the rest
    from this rank's file in its __init__)."""
    ckpt = full_resume(args)
    if args.resume_sharded:
        ckpt = resume_sharded(args, ckpt)
    return ckpt


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
