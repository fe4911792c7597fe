"""EP: expert parallelism for a mixture-of-experts GPT, written by hand.

Each block's MLP is E experts, k of them per token, picked by a router (common/model.py's MoE). The
experts are sharded over the EP ranks, E/EP a rank; the rest of the model (attention, embeddings,
routers) is on every rank and data-parallel, each rank on its own rows. In each MoE layer a rank
sends every row to the ranks that hold its k experts and gets their outputs back: all-to-alls with
uneven splits, whose sizes are known only after routing, in forward and again in backward.
  memory per rank:  16 bytes a parameter (fp32 params, grads, AdamW) of the Pd non-expert ones,
                    and of Pe/EP of the Pe expert ones (torch DDP holds all Pe on every rank)
  communication:    per MoE layer and micro-step, the counts (8E bytes) and the rows (N*k rows
                    of C values out, as many back in all; again in backward), then per step the
                    4Pd non-expert gradient bytes all-reduced over all ranks, in buckets during
                    the last backward; with --data_parallel_size > 1 (EP x DP), the 4Pe/EP expert
                    gradient bytes over each shard's replicas. Torch DDP all-reduces 4(Pd + Pe).
  on the device:    each rank's experts in stacked weights, one grouped matmul a projection, and
                    one host sync a MoE layer and micro-step: the all-to-alls' sizes.

Run:
  python ep_train.py                                    # single process: the reference
  torchrun --standalone --nproc_per_node=2 ep_train.py  # EP 2: 4 of the 8 experts a rank
  torchrun --standalone --nproc_per_node=4 ep_train.py --data_parallel_size 2   # EP 2 x DP 2
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 ep_train.py --n_experts 64 --data_parallel_size 2
  python ep_train.py --implementation pytorch           # torch DDP, every expert on every rank
The dispatch's layout, the bytes, the auxiliary loss: docs/ep.md.
"""
import os
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common.checkpoint import checkpoint, gather_to_rank0, resume, set_adamw_state
from common.config import check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import Batches, get_batch
from common.distributed import autocast, clip_grad_norm_, setup, setup_data, teardown
from common.metrics import MFU, Metrics, Profiler, activations, expert_load, model_state_bytes
from common.metrics import timers
from common.model import GPT, combine, configure_optimizer, init_tensor, invert, num_params
from common.model import sort_by_expert
from common.recompute import checkpoint_blocks
import peers.torch_ep


# ---- the strategy: experts sharded over the ranks, rows sent to them by all-to-all -----------

class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits, which has no autograd: forward sends send_splits[r]
    rows to rank r and receives recv_splits[r] rows from it; backward sends each row's gradient
    back the way the row came: the same call with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        received = rows.new_empty((sum(recv_splits), rows.size(1)))
        # Rank r gets rows' r-th block: send_splits[r] x C values of rows.element_size() bytes
        # (the rows are sorted by destination, so each block is contiguous); what comes in is
        # laid out by source rank, in rank order, each block in its sender's order.
        with timers("all_to_all"):  # the step's time in them: the summary's median
            dist.all_to_all_single(received, rows, recv_splits, send_splits, group=group)
        return received

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        grad_rows = grad.new_empty((sum(send_splits), grad.size(1)))
        # The forward's bytes the other way: the gradient of each received row goes to the rank
        # it came from, into the place that rank sent it from.
        with timers("all_to_all"):
            dist.all_to_all_single(grad_rows, grad.contiguous(), send_splits, recv_splits,
                                   group=ctx.group)
        return grad_rows, None, None, None


def grouped_mm_runs(device, dtype):
    """Whether torch._grouped_mm runs here without a host sync: on the CPU (torch >= 2.9), and on
    CUDA in bf16 from compute capability 9.0 (its kernel; elsewhere it falls back to a loop that
    reads the offsets back). Else the experts run one matmul pair each, as one process does."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        fast = dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
        if not fast:
            return False
    a, b = torch.ones(16, 16, device=device, dtype=dtype), torch.ones(2, 16, 16, device=device,
                                                                        dtype=dtype)
    try:
        torch._grouped_mm(a, b, offs=torch.tensor([8, 16], device=device, dtype=torch.int32))
    except (RuntimeError, NotImplementedError):  # no kernel for this device or dtype
        return False
    return True


class StackedLinear(nn.Module):
    """One projection of a rank's experts: weight (n, out, in) and bias (n, out), expert j's
    nn.Linear being weight[j] and bias[j]. `grouped`: one torch._grouped_mm for all of them, each
    expert's block of rows found by the offsets on the device; else one matmul an expert."""

    def __init__(self, n, fan_in, fan_out, bias, grouped):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, fan_out, fan_in))
        self.bias = nn.Parameter(torch.empty(n, fan_out)) if bias else None
        self.grouped = grouped

    def forward(self, rows, offsets, expert_of_row, sizes):
        """rows (R, in) in expert order -> (R, out); offsets (n,) int32: each expert's end row;
        expert_of_row (R,): its local expert; sizes: the rows per expert, as ints."""
        if not self.grouped or rows.size(0) == 0:  # grouped_mm's backward fails on 0 rows
            biases = [None] * len(sizes) if self.bias is None else self.bias
            parts = zip(rows.split(sizes), self.weight, biases)
            return torch.cat([F.linear(part, w, b) for part, w, b in parts])
        # Autocast has no rule for grouped_mm: the fp32 weights cast by hand, as F.linear's are
        weight = self.weight.to(rows.dtype).transpose(1, 2)  # (n, out, in) -> (n, in, out)
        out = torch._grouped_mm(rows, weight, offs=offsets)  # (R, out): row r times its expert's
        if self.bias is None:
            return out
        return out + self.bias.to(rows.dtype)[expert_of_row]  # (R, out): each row its bias


class GroupedExperts(nn.Module):
    """This rank's experts of one MoE layer, the weights of each projection stacked in one 3-D
    tensor, as torchtitan keeps them: two grouped matmuls run them all. `held`: their global
    indices; expert held[j]'s one-process `experts.{i}.c_fc.weight` is `c_fc.weight[j]` here, and
    checkpoints keep the one-process names (EP.one_process)."""

    def __init__(self, held, config, grouped):
        super().__init__()
        self.held = held
        n, C, H = len(held), config.n_embd, config.expert_hidden
        self.c_fc = StackedLinear(n, C, H, config.bias, grouped)
        self.c_proj = StackedLinear(n, H, C, config.bias, grouped)

    def forward(self, rows, expert_of_row, counts, sizes):
        """rows (R, C) in expert order, each row's local expert, the rows per expert on the device
        (counts) and on the host (sizes) -> (R, C). An expert with no rows gets a zero gradient."""
        offsets = counts.cumsum(0).to(torch.int32)  # (n,): each expert's end row, no host sync
        hidden = F.gelu(self.c_fc(rows, offsets, expert_of_row, sizes))  # (R, H)
        return self.c_proj(hidden, offsets, expert_of_row, sizes)


class ExpertParallel:
    """One MoE layer's dispatch_combine over the EP group: each row to the ranks that hold its k
    experts (rank r holds experts r*E/EP .. (r+1)*E/EP - 1), computed there, and back, in place
    of common/model.py's one-process version, which it follows step by step. One host sync a
    layer and micro-step: the sizes of the splits (plan)."""

    def __init__(self, experts, config, group, recompute=False):
        self.experts = experts  # this rank's experts: a GroupedExperts
        self.n_experts, self.top_k, self.group = config.n_experts, config.top_k, group
        self.ep_size = dist.get_world_size(group)
        self.n_local = config.n_experts // self.ep_size
        self.recompute = recompute  # --activation_checkpointing full: backward runs us again
        self.kept = []  # the plan of each forward that backward will recompute

    def plan(self, counts):
        """The splits, from this rank's slots per expert (counts (E,)): the counts' all-to-all,
        then the one read back to the host of the layer: all_to_all_single takes host lists."""
        ep, n_local = self.ep_size, self.n_local
        counts_in = torch.empty_like(counts)
        # The counts first, in their own all-to-all: rank r gets counts[r*E/EP:(r+1)*E/EP], how
        # many of this rank's rows each of its experts will get (E/EP x 8 bytes to each rank,
        # 8E in all). The rows' all-to-all needs every size before it starts.
        with timers("all_to_all"):  # where a rank first waits for a slower one
            dist.all_to_all_single(counts_in, counts, group=self.group)
        counts_in = counts_in.view(ep, n_local)  # (E,) -> (source rank, local expert)
        per_rank = counts.view(ep, n_local).sum(dim=1)  # (E,) -> (ep,): rows to each rank
        sizes = torch.cat([per_rank, counts_in.sum(dim=1), counts_in.sum(dim=0)]).tolist()
        return counts_in, sizes

    def __call__(self, rows, experts, gates):
        ep, n_local = self.ep_size, self.n_local
        order, counts = sort_by_expert(experts, self.n_experts)  # counts (E,), on the device
        # In expert order is in destination order: rank r holds the consecutive experts
        # r*E/EP .. (r+1)*E/EP - 1, so each rank's rows are one consecutive block of send.
        send = rows[order // self.top_k]  # (N*k, C): by destination rank, then by its expert
        if torch._C._current_graph_task_id() != -1:  # inside backward: the recompute of forward
            counts_in, sizes = self.kept.pop()  # the same routing: its plan, no second sync
        else:
            counts_in, sizes = self.plan(counts)
            if self.recompute and torch.is_grad_enabled():
                self.kept.append((counts_in, sizes))
        send_splits, recv_splits, per_expert = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
        received = AllToAll.apply(send, recv_splits, send_splits, self.group)  # (R, C)
        # Received rows come by source rank, then local expert: a stable sort of their local
        # expert index puts them in expert order, each expert's rows by source rank (the global
        # batch's order in the EP group), as one process orders them.
        local = torch.arange(n_local, device=rows.device).repeat(ep)  # (ep * n_local,)
        local = local.repeat_interleave(counts_in.flatten(), output_size=sum(recv_splits))
        by_expert = local.argsort(stable=True)  # (R,)
        out = self.experts(received[by_expert], local[by_expert], counts_in.sum(dim=0), per_expert)
        returned = AllToAll.apply(out[invert(by_expert)], send_splits, recv_splits, self.group)
        return combine(returned, order, gates)  # returned (N*k, C): in send's order


BUCKET_CAP_MB = 25  # the dense gradients' bucket size: torch DDP's default


class GradientBuckets:
    """The non-expert gradients summed over all ranks while backward runs, as ddp_train.py sends
    them: buckets of about BUCKET_CAP_MB, each the all-reduce of a slice of one flat buffer (the
    .grads are views of it, in registration order), cut from its end, as backward makes the last
    parameters' gradients first. A bucket's all-reduce starts, async, when its last gradient has
    been accumulated (a post-accumulate-grad hook); `require_sync = False` (the step's earlier
    micro-steps) only accumulates. The order is the same on every rank, all-to-alls included:
    every rank runs the same autograd graph (the same ops; only the rows' counts differ), whose
    engine runs its nodes, the all-to-alls' backward and the gradients' accumulations, in one
    order that depends on the graph alone, and a full bucket waits for the buckets before it.
    NCCL needs that order: collectives of two groups started in two orders can hang."""

    def __init__(self, params, group=None):
        self.flat = flat_grads(params)  # whole, the clip's norm reads it
        self.group, self.require_sync = group, True
        self.buckets, self.bucket_of, end, numel = [], {}, self.flat.numel(), 0
        for p in reversed(params):  # the buffer's slices from its end
            if numel and (numel + p.numel()) * 4 > BUCKET_CAP_MB * 2**20:
                self.buckets.append(self.flat[end - numel:end])
                end, numel = end - numel, 0
            self.bucket_of[p] = len(self.buckets)
            numel += p.numel()
        self.buckets.append(self.flat[end - numel:end])
        self.sizes = [list(self.bucket_of.values()).count(b) for b in range(len(self.buckets))]
        self.pending, self.works = list(self.sizes), []  # per bucket: gradients still to come
        # The hook holds the buckets weakly (param -> hook -> buckets -> param is a cycle in C++)
        buckets = weakref.ref(self)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: buckets().grad_ready(p))

    def grad_ready(self, p):
        self.pending[self.bucket_of[p]] -= 1
        while self.require_sync and len(self.works) < len(self.buckets):
            if self.pending[len(self.works)] > 0:
                break  # the next bucket in order is not full yet: the ones after it wait too
            self.all_reduce(len(self.works))

    def all_reduce(self, b):
        # Bucket b (its slice: numel x 4 bytes) to every rank, summed: each rank's gradients are
        # g/(A*N) of its rows, so the sum over the N ranks is the batch's mean. Async: backward
        # computes the earlier layers while it is on the wire.
        self.works.append(dist.all_reduce(self.buckets[b], group=self.group, async_op=True))

    def flush(self):
        """After each backward: the buckets not sent yet, in order (when syncing); returns the
        works to wait for, and resets the counts for the next backward."""
        while self.require_sync and len(self.works) < len(self.buckets):
            self.all_reduce(len(self.works))
        works, self.works, self.pending = self.works, [], list(self.sizes)
        return works


def one_process_layout(model):
    """(parameter, its names in the one-process model, stacked) for each parameter here: a dense
    one has its own name; a stacked expert tensor, experts.c_fc.weight, one name an expert it
    holds (experts.{i}.c_fc.weight), in its order. Checkpoints and init read these names."""
    for name, p in model.named_parameters():
        layer, stacked, tensor = name.partition(".experts.")
        if not stacked:
            yield p, [name], False
        else:
            held = model.get_submodule(layer + ".experts").held
            yield p, [f"{layer}.experts.{i}.{tensor}" for i in held], True


class EP:
    """The strategy behind the few methods the training loop calls: on every rank the GPT with its
    E/EP experts of each layer (ExpertParallel moving the rows), each rank on its own rows."""
    dp_group = None  # the ranks that split the batch, whose losses the loop averages: all

    def __init__(self, config, args, device, state=None):
        replicas = args.data_parallel_size
        ep_size = dist.get_world_size() // replicas
        # The replicas x EP grid: row d is an EP group (consecutive ranks: one node's fast links)
        # that holds every expert once; column e holds expert shard e's replicas.
        self.grid = torch.arange(dist.get_world_size()).view(replicas, ep_size)
        self.ep_group, _ = dist.new_subgroups_by_enumeration(self.grid.tolist())
        self.replica_group, _ = dist.new_subgroups_by_enumeration(self.grid.t().tolist())
        ep_rank = dist.get_rank() % ep_size
        n_local = config.n_experts // ep_size
        held = list(range(ep_rank * n_local, (ep_rank + 1) * n_local))
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        self.grouped = grouped_mm_runs(device, dtype)
        recompute = args.activation_checkpointing == "full"
        self.model = GPT(config, device="meta")
        for block in self.model.transformer.h:
            with torch.device("meta"):
                block.mlp.experts = GroupedExperts(held, config, self.grouped)
            block.mlp.dispatch_combine = ExpertParallel(block.mlp.experts, config, self.ep_group,
                                                        recompute)
        self.model.to_empty(device=device)
        self.model.tie_weights()  # to_empty replaced the Parameter objects
        self.layout = list(one_process_layout(self.model))
        self.args, self.device = args, device
        # Every tensor's value is the one-process model's, by name: its init depends on (seed,
        # name) only (no broadcast needed), or a full checkpoint from any script holds it.
        with torch.no_grad():
            for p, names, stacked in self.layout:
                shape = p.shape[1:] if stacked else p.shape  # one expert's, or the tensor's
                values = [init_tensor(name, shape, config, args.seed) if state is None
                          else state[name] for name in names]
                p.copy_(stack(values, stacked))
        checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        self.buckets = GradientBuckets([p for p, _, stacked in self.layout if not stacked])
        self.expert_grads = flat_grads([p for p, _, stacked in self.layout if stacked])

    def configure_optimizer(self, args, state=None):
        betas = (args.beta1, args.beta2)
        named = self.model.named_parameters()
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        if state is not None:  # a checkpoint's AdamW state, keyed by one-process name
            for p, names, stacked in self.layout:
                moments = {key: stack([state[name][key] for name in names], stacked)
                           for key in ("exp_avg", "exp_avg_sq")}  # an expert's step is any's
                moments["step"] = state[names[0]]["step"]
                set_adamw_state(optimizer, p, moments, self.to_device)
        return optimizer

    def to_device(self, tensor):
        return tensor.to(self.device, copy=True)

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its (loss, aux_loss, then each layer's slots per expert, fp32).
        sync: the step's last micro-step, whose backward sums the gradients over the ranks."""
        self.buckets.require_sync = sync  # before backward, where the hooks read it
        with activations.first(), autocast(self.args, self.device):  # the bytes kept for backward
            _, loss = self.model(x, y)
        aux_loss = self.model.aux_loss()
        load = self.model.expert_load().flatten()  # (L, E) -> (L*E,): this rank's slots
        # Divided by A*N (N: all ranks), backward writes g/(A*N) of this rank's rows; an expert's
        # gradient also gets, through the all-to-all's backward, those of every row of the EP
        # group that chose it. The sums over the ranks then make both the batch's mean.
        N = dist.get_world_size()
        objective = loss + self.args.aux_loss_coef * aux_loss
        (objective / (self.args.grad_accum_steps * N)).backward()
        self.finish_backward(sync)
        return torch.cat([torch.stack([loss, aux_loss]), load]).detach().float()

    def finish_backward(self, sync):
        # The dense buckets left (4Pd bytes in all, most already sent during backward)
        works = self.buckets.flush()
        # The expert gradients (4Pe/EP bytes) summed over the replicas of this rank's shard: each
        # EP group saw 1/replicas of the batch. Without EP x DP each shard is alone: no call.
        if sync and dist.get_world_size(self.replica_group) > 1:
            works.append(dist.all_reduce(self.expert_grads, group=self.replica_group,
                                         async_op=True))
        with timers("all_reduce_wait"):  # what backward did not hide
            for work in works:
                work.wait()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # The expert gradients are sharded over the EP group (and equal over the replicas): their
        # squares summed over the group (one fp32 all-reduce, 4 bytes); the rest is equal on every
        # rank and counted once.
        dense = [self.buckets.flat]
        return clip_grad_norm_([self.expert_grads], dense, max_norm, self.ep_group)

    def full_state(self, optimizer):
        """The full checkpoint on rank 0, in the one-process layout: EP group 0's ranks send their
        experts (parameters and AdamW state, one message an expert's tensor), rank 0 also the rest
        (gather_to_rank0)."""
        first_group = dist.get_rank() < self.grid.size(1)
        entries = []
        for p, names, stacked in self.layout:
            if not first_group or (dist.get_rank() != 0 and not stacked):
                continue  # rank 0 sends it, or (experts) a rank of EP group 0
            values = {"param": p.detach(), **optimizer.state.get(p, {})}
            for j, name in enumerate(names):
                for key, value in values.items():
                    if stacked and key != "step":
                        value = value[j]  # expert j's (out, in) of the stacked (n, out, in)
                    value = value.to(self.device)
                    entries.append((name, key, value.shape, value.dtype, lambda value=value: value))
        return gather_to_rank0(entries, first_group, self.model.config, self.device)

    def describe(self):
        replicas, ep_size = self.grid.shape
        config = self.model.config
        path = "one grouped_mm" if self.grouped else "a loop of matmuls"
        return (f"EP {ep_size} x DP {replicas} grid {self.grid.tolist()} (row = EP group), "
                f"{config.n_experts // ep_size} of {config.n_experts} experts a rank ({path} a "
                f"projection), top-{config.top_k}, {num_params(self.model) / 1e6:.2f}M params here")


def stack(tensors, stacked):
    """A parameter's value from its one-process tensors: stacked (expert, ...), or the one."""
    return torch.stack(tensors) if stacked else tensors[0]


def flat_grads(params):
    """One flat fp32 buffer that the .grads of params are views of: autograd accumulates straight
    into it, and its all-reduce needs no copy in or out."""
    buffer = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    for p, view in zip(params, buffer.split([p.numel() for p in params])):
        p.grad = view.view_as(p)
    return buffer


class TorchEP(peers.torch_ep.TorchEP, EP):
    """--implementation pytorch: torch DDP on the same model, every expert on every rank
    (peers/torch_ep.py); the other methods are EP's."""


def add_ep_flags(group):
    group.add_argument("--data_parallel_size", type=int, default=1,
                       help="replicas of each expert shard (EP = world size / replicas)")


def check_ep_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns the number of
    ranks that split the batch: all of them."""
    replicas = args.data_parallel_size
    if args.n_experts <= 0:
        die(f"--n_experts: ep_train.py shards the experts: must be > 0, got {args.n_experts}")
    if replicas <= 0 or world_size % replicas:
        die(f"--data_parallel_size: {replicas} must be > 0 and divide the world size "
            f"({world_size})")
    ep_size = world_size // replicas
    if args.n_experts % ep_size:
        die(f"--n_experts: {args.n_experts} must be divisible by the EP size ({ep_size} = world "
            f"size {world_size} / --data_parallel_size {replicas})")
    check_batch_split(args, world_size)
    return world_size


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("ep", add_ep_flags, argv)
    D = check_ep_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank = rank * D // world_size
    rows = B // D  # rows per data-parallel rank
    micro = rows // A  # rows per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    Strategy = EP if args.implementation == "custom" else TorchEP
    model = Strategy(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    mfu = MFU(config, args, device, world_size)  # model FLOPs utilisation, per log line
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start, mfu=mfu)
    if rank == 0:
        print(f"ep ({args.implementation}): {world_size} rank(s) on {device} in {args.dtype}, "
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
        # (loss, aux_loss, each layer's slots per expert)
        loss_sum = torch.zeros(2 + config.n_layer * config.n_experts, device=device)
        for j in range(A):  # gradients are synchronised on the last micro-step only
            part = slice(j * micro, (j + 1) * micro)
            loss_sum += model.forward_backward(x[part], y[part], sync=j == A - 1)
        batches.prefetch(step + 1)  # built and copied while the device runs this step
        # Logged loss: the mean over all B*T tokens of the global batch (equal chunks: mean of
        # means); the slots per expert too (the load is a ratio to their mean: no scale).
        loss_sum /= A
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=model.dp_group)
        norm = model.clip_grad_norm_(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # zero in place: gradients that are views stay views
        loss, aux_loss, *slots, norm = torch.cat([loss_sum, norm[None]]).tolist()  # one host sync
        dt = time.perf_counter() - t0  # the step's kernels have run
        metrics.step(step, loss, lr, norm, B * T, dt, device, args.log_interval, aux_loss,
                     expert_load(slots, config.n_experts))
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
