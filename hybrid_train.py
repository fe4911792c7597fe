"""Hybrid: DP x TP x PP x CP in one run (4D parallelism), by hand.

The N ranks form a grid, ranks = arange(N).view(dp, pp, cp, tp): each axis is a process group of
the ranks that differ in that coordinate only. TP varies fastest (one node's fast links: it talks in
every block), DP slowest (across nodes, once a step), as in torchtitan and Megatron. Each part is
its script's, shortened: tp_train.py (f and g, the vocabulary-parallel embedding, head and loss,
SP: --sequence_parallel), cp_train.py (the zigzag ring, over a TP rank's heads), pp_train.py (1F1B
over --n_microbatches), ddp_train.py (over the dp x cp ranks: equal shares of the tokens). The tied
wte and lm_head, split by vocabulary, sum their gradients over the pp ends.
Per rank, P parameters, b rows a micro-batch, C = n_embd, 4 bytes a number:
  model state  16 bytes a parameter (param, grad, AdamW's two moments) of about P/(tp*pp): its
               stage's TP shards, the replicated LayerNorms, wpe and row-parallel biases, and on
               the last stage (pp > 1) the head's copy of wte's vocab/tp rows.
  tp           per block and micro-batch 2 all-reduces of b*T/cp*C numbers forward, 2 backward
               (SP: an all-gather or reduce-scatter each, the same bytes); the embedding adds 1
               forward; the head 1 backward and the loss all-reduces of b*T/cp and 2b*T/cp.
  cp           per block and micro-batch cp-1 ring sends of K, V (2b*T/cp*C/tp numbers) forward,
               2cp-1 backward (K, V again, and the dK, dV accumulators: cp hops).
  pp           per micro-batch an activation forward and its gradient back: b*T/cp*C (SP: /tp).
  dp x cp      one all-reduce of the stage's gradients a step (4 bytes a local parameter).
  pp ends      one all-reduce of the tied gradient a step: vocab/tp*C numbers (pp > 1).

Run:
  python hybrid_train.py                                               # one process: the reference
  torchrun --standalone --nproc_per_node=8 hybrid_train.py --data_parallel_size 2 \\
           --tensor_parallel_size 2 --pipeline_parallel_size 2 --print_grid     # dp2 x tp2 x pp2
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 hybrid_train.py --tensor_parallel_size 8 \\
           --pipeline_parallel_size 2                        # TP inside a node, PP across nodes
The grid's groups, seams, tests and PyTorch's version (peers/torch_hybrid.py): docs/hybrid.md.
"""
import datetime
import math
import os
import time
import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common import flash
from common.checkpoint import checkpoint, gather_to_rank0, resume, set_adamw_state
from common.config import add_bool, die, get_lr, gpt_config, parse_args
from common.data import Batches, get_batch
from common.distributed import all_gather_single, autocast, clip_grad_norm_, reduce_scatter_single
from common.distributed import setup, setup_data, teardown
from common.metrics import MFU, Metrics, Profiler, activations, held_bytes, model_state_bytes
from common.model import BLOCK_LINEARS, GPT, LOSS_CHUNK_ROWS, compile_forward, configure_optimizer
from common.model import init_tensor
from common.recompute import checkpoint_blocks
import peers.torch_hybrid

WTE_NAME = "transformer.wte.weight"  # lm_head.weight is tied to it: the last stage holds a copy


# ---- the grid: every rank's coordinates and groups -------------------------------------------

AXES = ("dp", "pp", "cp", "tp")  # slowest-varying first: rank = ((d*pp + s)*cp + c)*tp + t
GROUPS = (("tp",), ("cp",), ("pp",), ("dp", "cp"), ("pp", "tp"))  # each: the axes it spans
SIZE_FLAGS = dict(dp="data_parallel_size", pp="pipeline_parallel_size",
                  cp="context_parallel_size", tp="tensor_parallel_size")  # each axis' flag, less --


def rank_grid(dp, pp, cp, tp):
    return torch.arange(dp * pp * cp * tp).view(dp, pp, cp, tp)


def coordinates(grid, rank):
    """{axis: rank's index along it}."""
    return dict(zip(AXES, (int(i) for i in (grid == rank).nonzero()[0])))


def axis_groups(grid, axes):
    """Every group along `axes`: the ranks that differ only in those coordinates, in grid order."""
    along = [AXES.index(axis) for axis in axes]
    others = [i for i in range(len(AXES)) if i not in along]
    size = math.prod(grid.shape[i] for i in along)
    return grid.permute(others + along).reshape(-1, size).tolist()  # (groups, ranks of each)


def tied_pairs(grid):
    """The pp-ends groups: [first stage's rank, last stage's rank] of each (dp, cp, tp) place."""
    ends = grid[:, [0, -1]]  # (dp, 2, cp, tp)
    return ends.permute(0, 2, 3, 1).reshape(-1, 2).tolist()


def grid_error(sizes, world_size):
    """None, or why the sizes {axis: size or None} make no grid of `world_size` (dp: the rest)."""
    for axis in AXES:
        if sizes[axis] is not None and sizes[axis] <= 0:
            return f"--{SIZE_FLAGS[axis]}: must be > 0, got {sizes[axis]}"
    model = math.prod(sizes[axis] or 1 for axis in ("pp", "cp", "tp"))
    dp = sizes["dp"] or world_size // model
    if dp * model != world_size or dp == 0:
        shape = " x ".join(f"--{SIZE_FLAGS[a]} {sizes[a] or 1}" for a in ("tp", "pp", "cp"))
        return f"--data_parallel_size: {dp} x {shape} must equal the world size ({world_size})"
    return None


class Grid:
    """This rank's coordinates, GROUPS' process groups by name ("dpxcp"), the pp ends' group."""

    def __init__(self, dp, pp, cp, tp, timeout):
        self.ranks = rank_grid(dp, pp, cp, tp)
        self.size = dict(zip(AXES, (dp, pp, cp, tp)))
        self.coords = coordinates(self.ranks, dist.get_rank())
        def my_group(groups):  # every rank makes every group, in one order (new_group's rule)
            return dist.new_subgroups_by_enumeration(groups, timeout=timeout)[0]
        # nccl: each group connects here (new_group inherits setup's device_id), so the pp group's
        # first batch_isend_irecv may be stages 0 and 1 alone; a lazy one would need every rank.
        self.groups = {"x".join(axes): my_group(axis_groups(self.ranks, axes)) for axes in GROUPS}
        self.tied_group = my_group(tied_pairs(self.ranks)) if pp > 1 else None  # the pp ends

    def table(self):
        """--print_grid: every rank's coordinates and groups, a line each."""
        lines = []
        for rank in range(self.ranks.numel()):
            place = " ".join(f"{a}={i}" for a, i in coordinates(self.ranks, rank).items())
            groups = [f"{'x'.join(axes)} {g}" for axes in GROUPS
                      for g in axis_groups(self.ranks, axes) if rank in g]
            lines.append(f"rank {rank}: {place}; " + ", ".join(groups))
        return "\n".join(lines)


# ---- TP: Megatron's conjugate operators on the TP group (tp_train.py has the full lesson) ----

def all_gather(x, group, dim):
    """The ranks' x concatenated in rank order along `dim`: (b, L/tp, C) shards -> (b, L, C)."""
    tp_size = dist.get_world_size(group)
    out = x.new_empty((tp_size * x.size(0),) + x.shape[1:])  # gloo wants the ranks along dim 0
    all_gather_single(out, x.contiguous(), group=group)  # x.numel() numbers from each rank
    return torch.cat(out.chunk(tp_size), dim=dim)


def reduce_scatter_seq(x, group):
    """(b, L, C) partial sums on the ranks -> (b, L/tp, C): this rank's shard of their sum."""
    tp_size = dist.get_world_size(group)
    chunks = torch.cat(x.chunk(tp_size, dim=1))  # (tp*b, L/tp, C): shard r at rows r*b..(r+1)*b
    out = chunks.new_empty((x.size(0),) + chunks.shape[1:])
    reduce_scatter_single(out, chunks, group=group)  # b*L*C numbers in, b*L/tp*C out
    return out


class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward (SP: all-gather the sequence, reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return all_gather(x, tp.group, dim=1) if tp.sp else x

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp.sp:
            return reduce_scatter_seq(grad, ctx.tp.group), None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.tp.group)  # b*L*C numbers: the partial input gradients
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (SP: reduce-scatter, all-gather)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        if tp.sp:
            return reduce_scatter_seq(x, tp.group)
        x = x.contiguous()
        dist.all_reduce(x, group=tp.group)  # b*L*C numbers: the sum of the tp partial outputs
        return x

    @staticmethod
    def backward(ctx, grad):
        return (all_gather(grad, ctx.tp.group, dim=1) if ctx.tp.sp else grad), None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from (N, V/p) logit slices in their own dtype (bf16 under autocast),
    one per rank of `group`: loss = log(sum_v exp(z_v - m)) - (z_t - m), m the global max, from
    one all-reduce (MAX) of N numbers and one (SUM) of 2N: each slice's sum of exp and the target's
    logit (in one slice only). fp32 only LOSS_CHUNK_ROWS rows at a time: no fp32 copy of the slice
    exists. Backward sends nothing: d loss / d z = softmax - onehot(t), a chunk at a time."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        m = logits.amax(dim=-1).float()  # (N,): exact in any dtype
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # N numbers, for stability
        local = targets - vocab_start
        owned = (local >= 0) & (local < logits.size(-1))  # targets whose logit this rank holds
        local = local.clamp(0, logits.size(-1) - 1)
        picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float()  # (N,)
        chunks = zip(logits.split(LOSS_CHUNK_ROWS), m.split(LOSS_CHUNK_ROWS))  # fp32: m is
        sum_exp = torch.cat([(z - m_z.unsqueeze(-1)).exp_().sum(-1) for z, m_z in chunks])
        sums = torch.stack([sum_exp, torch.where(owned, picked - m, 0.0)])  # (2, N)
        dist.all_reduce(sums, group=group)  # 2N numbers: sums of exp, the targets' logits
        ctx.save_for_backward(logits, m + sums[0].log(), local, owned)  # log-sum-exp (N,) fp32
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad):
        logits, lse, local, owned = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.size(0), LOSS_CHUNK_ROWS):
            rows = slice(start, start + LOSS_CHUNK_ROWS)
            out = grad_logits[rows]  # a view, written in place in the logits' dtype
            torch.exp(logits[rows] - lse[rows, None], out=out)  # softmax
            out.scatter_add_(-1, local[rows, None], -owned[rows, None].to(out.dtype))  # - onehot
            out.mul_(grad[rows, None])  # times each row's upstream gradient
        return grad_logits, None, None, None


def shard_dim(name):
    """The dimension along which parameter `name` is split over the TP group, or None."""
    if name.endswith(("wte.weight", "lm_head.weight")):
        return 0  # vocabulary rows
    if name.endswith(("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias")):
        return 0  # column-parallel: output features
    if name.endswith("c_proj.weight"):
        return 1  # row-parallel: input features
    return None  # replicated: LayerNorms, wpe, row-parallel biases


def shard(name, full, rank, tp_size):
    """TP rank `rank`'s slice of the full tensor `name`; c_attn's: the same heads of q, k and v."""
    if "c_attn" in name:
        return full.unflatten(0, (3, -1)).chunk(tp_size, dim=1)[rank].flatten(0, 1)  # (3C/tp, *)
    dim = shard_dim(name)
    return full if dim is None else full.chunk(tp_size, dim=dim)[rank]


class ParallelLinear(nn.Module):
    """Column-parallel: f, then this rank's out_features/tp outputs. Row-parallel: this rank's
    in_features/tp slice of the matmul, summed by g, the bias added once after."""

    def __init__(self, tp, in_features, out_features, bias, column):
        super().__init__()
        self.tp, self.column = tp, column
        if column:
            self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features))
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        self.bias = nn.Parameter(torch.empty(self.weight.size(0))) if bias else None

    def forward(self, x):
        if self.column:
            return F.linear(CopyToTP.apply(x, self.tp), self.weight, self.bias)
        out = ReduceFromTP.apply(F.linear(x, self.weight), self.tp)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """TP rank r looks up the ids in its vocabulary rows, zeroes the others; g sums the ranks."""

    def __init__(self, tp, vocab_size, n_embd):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(vocab_size // tp.size, n_embd))
        self.vocab_start = tp.rank * (vocab_size // tp.size)

    def forward(self, idx):
        local = idx - self.vocab_start
        owned = (local >= 0) & (local < self.weight.size(0))  # ids whose row this rank holds
        rows = F.embedding(local.clamp(0, self.weight.size(0) - 1), self.weight)
        return ReduceFromTP.apply(rows * owned.unsqueeze(-1), self.tp)


# ---- CP: ring attention with the zigzag split (cp_train.py has the full lesson) ---------------

def causal_window(q_pos, k_pos):
    """The part of a (query block, key block) pair the causal mask keeps: queries from `first` on,
    the first `keys` keys, and the mask inside that window (None: it keeps all)."""
    first = int((q_pos < k_pos[0]).sum())
    keys = int((k_pos <= q_pos[-1]).sum())
    mask = k_pos[None, :keys] > q_pos[first:, None]
    return first, keys, (mask if mask.any() else None)


class CPGroup:
    """The CP group, its ring neighbours (global ranks), my positions and my windows."""

    def __init__(self, group, T, device):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        chunks = torch.arange(T).chunk(2 * self.size)  # zigzag: rank r holds r and 2cp-1-r
        every = [torch.cat([chunks[r], chunks[-1 - r]]) for r in range(self.size)]  # ascending
        self.positions = every[self.rank].to(device)
        self.windows = []  # ring step i's: my queries against the key block of CP rank - i
        for i in range(self.size):
            first, keys, mask = causal_window(every[self.rank], every[(self.rank - i) % self.size])
            self.windows.append((first, keys, None if mask is None else mask.to(device)))


def block_forward(q, kv, window, out, lse, scale):
    """Attends my queries to one key block, merged into out, lse in place, as cp_train.py; returns
    what flash's backward wants. q: (b, nh/tp, T/cp, hs); out: fp32 q; kv: (2,) + q's shape."""
    first, keys, mask = window
    if keys == 0 or first == q.size(-2):
        return None
    q, k, v = q[..., first:, :], kv[0, ..., :keys, :], kv[1, ..., :keys, :]  # the window's
    rest = None
    with torch.autocast(q.device.type, enabled=False):
        if flash.fused(q):  # a mask: the causal triangle of a square window
            block_out, block_lse, rest = flash.block_attention(q, k, v, mask is not None, scale)
        else:
            scores = q.float() @ k.float().transpose(-2, -1) * scale  # (b, nh/tp, queries, keys)
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            block_lse = scores.logsumexp(-1, keepdim=True)
            block_out = (scores - block_lse).exp() @ v.float()
        new_lse = torch.logaddexp(lse[..., first:, :], block_lse)
        old_out = out[..., first:, :] * (lse[..., first:, :] - new_lse).exp()
        out[..., first:, :] = old_out + block_out.float() * (block_lse - new_lse).exp()
        lse[..., first:, :] = new_lse
    return rest


def block_backward(q, kv, window, dout, out, lse, dq, scale, rest):
    """Adds this key block's part of dq in place; returns its [dK; dV]; rest: block_forward's."""
    first, keys, mask = window
    dkv = torch.zeros(kv.shape, device=q.device)  # (2, b, nh/tp, T/cp, hs)
    if keys == 0 or first == q.size(-2):
        return dkv
    q, k, v = q[..., first:, :], kv[0, ..., :keys, :], kv[1, ..., :keys, :]  # the window's
    dout, out, lse = dout[..., first:, :], out[..., first:, :], lse[..., first:, :]
    with torch.autocast(q.device.type, enabled=False):
        if flash.fused(q):
            dq_kept, dk, dv = flash.block_backward(dout, q, k, v, out, lse, mask is not None,
                                                   scale, rest)
        else:
            q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
            scores = q @ k.transpose(-2, -1) * scale
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            probs = (scores - lse).exp()
            delta = (dout * out).sum(-1, keepdim=True)
            ds = probs * (dout @ v.transpose(-2, -1) - delta) * scale
            dq_kept, dk, dv = ds @ k, ds.transpose(-2, -1) @ q, probs.transpose(-2, -1) @ dout
        dq[..., first:, :] += dq_kept
        dkv[0, ..., :keys, :] = dk
        dkv[1, ..., :keys, :] = dv
    return dkv


def pass_to_next(tensor, cp):
    """tensor to the next CP rank, the previous one's received: posted together, as NCCL needs."""
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, cp.next, cp.group),
           dist.P2POp(dist.irecv, received, cp.prev, cp.group)]
    return received, dist.batch_isend_irecv(ops)


def wait(works):
    for work in works:
        work.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of my queries over every CP rank's keys: K, V blocks go round the ring."""

    @staticmethod
    def forward(ctx, q, k, v, cp):
        kv = torch.stack([k, v])  # (2, b, nh/tp, T/cp, hs): my TP rank's heads only
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full(q.shape[:-1] + (1,), float("-inf"), device=q.device)
        scale = q.size(-1) ** -0.5
        ctx.cp, ctx.rests = cp, []  # rests: what each step's flash kernel wants back
        for i in range(cp.size):  # step i: the block of CP rank - i; the next one on the wire
            received, works = pass_to_next(kv, cp) if i < cp.size - 1 else (kv, [])  # last: none
            ctx.rests.append(block_forward(q, kv, cp.windows[i], out, lse, scale))
            wait(works)
            kv = received
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        (q, k, v, out, lse), cp = ctx.saved_tensors, ctx.cp
        kv = torch.stack([k, v])
        dq = torch.zeros_like(q, dtype=torch.float32)
        scale = q.size(-1) ** -0.5
        dkv, dkv_works = torch.zeros((), device=q.device), []  # my block's accumulator: zero yet
        # Block j's dK, dV accumulator follows it round the ring, a step behind: from j back to j.
        for i in range(cp.size):
            received, works = pass_to_next(kv, cp) if i < cp.size - 1 else (kv, [])
            share = block_backward(q, kv, cp.windows[i], dout, out, lse, dq, scale, ctx.rests[i])
            wait(dkv_works)  # dkv: this block's accumulator, from rank - 1
            sent = share.add_(dkv)  # kept until its send completes
            dkv, dkv_works = pass_to_next(sent, cp)  # 2BTC/cp fp32 to the block's next holder
            wait(works)
            kv = received
        wait(dkv_works)  # my block's accumulator, back with every rank's share
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


# ---- the stage: a TP-sharded, CP-attending piece of the GPT ------------------------------------

class HybridAttention(nn.Module):
    """Attention on this TP rank's n_head/tp heads over this CP rank's T/cp positions."""

    def __init__(self, tp, cp, config):
        super().__init__()
        self.c_attn = ParallelLinear(tp, config.n_embd, 3 * config.n_embd, config.bias, column=True)
        self.c_proj = ParallelLinear(tp, config.n_embd, config.n_embd, config.bias, column=False)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout, self.cp = config.n_head // tp.size, config.dropout, cp

    def forward(self, x):  # (b, T/cp, C), or (b, T/cp/tp, C) with SP
        qkv = self.c_attn(x)  # (b, T/cp, 3C/tp): my heads' q, k, v at my CP positions
        b, L, _ = qkv.shape
        # q, k, v: (b, nh/tp, T/cp, hs) each
        q, k, v = (t.view(b, L, self.n_head, -1).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        y = self.attend(q, k, v).transpose(1, 2).reshape(b, L, -1)  # (b, T/cp, C/tp)
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q, k, v):
        """The attention core: the CP ring; with cp = 1, SDPA (which has dropout)."""
        if self.cp.size > 1:
            return RingAttention.apply(q, k, v, self.cp)
        dropout_p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class StageGPT(nn.Module):
    """Pipeline stage `stage` of GPT (GPT's names), wte/wpe first, ln_f and the head last: this TP
    rank's shards of init_tensor's values or of `state`. The head: wte, or with pp > 1 lm_head."""

    def __init__(self, tp, cp, config, stage, n_stages, seed, device, state=None):
        super().__init__()
        self.tp = tp
        self.first, self.last = stage == 0, stage == n_stages - 1
        C, V = config.n_embd, config.vocab_size
        full = GPT(config, device="meta").transformer  # the whole model without storage
        per_stage = config.n_layer // n_stages
        blocks = {}
        with torch.device("meta"):
            for i in range(stage * per_stage, (stage + 1) * per_stage):
                block = full.h[i]
                block.attn = HybridAttention(tp, cp, config)
                block.mlp.c_fc = ParallelLinear(tp, C, 4 * C, config.bias, column=True)
                block.mlp.c_proj = ParallelLinear(tp, 4 * C, C, config.bias, column=False)
                blocks[str(i)] = block
            pieces = dict(h=nn.ModuleDict(blocks))
            if self.first:
                pieces.update(wte=VocabParallelEmbedding(tp, V, C), wpe=full.wpe, drop=full.drop)
            if self.last:
                pieces.update(ln_f=full.ln_f)
            self.transformer = nn.ModuleDict(pieces)
            if self.last and not self.first:
                self.lm_head = nn.Linear(C, V // tp.size, bias=False)
        self.to_empty(device=device)
        self.vocab_start = tp.rank * (V // tp.size)
        self.full_shapes = {n: p.shape for n, p in GPT(config, device="meta").named_parameters()}
        with torch.no_grad():  # one full tensor at a time, keeping this rank's slice
            for name, p in self.named_parameters():
                name = WTE_NAME if name == "lm_head.weight" else name  # the copy starts as wte
                shape = self.full_shapes[name]
                value = state[name] if state is not None else init_tensor(name, shape, config, seed)
                p.copy_(shard(name, value, tp.rank, tp.size))

    def head(self):
        return self.lm_head.weight if hasattr(self, "lm_head") else self.transformer.wte.weight

    def forward(self, x, targets, pos):
        """x: token ids (first stage) or the stage before's output; the last stage: my mean loss."""
        if self.first:  # (b, T/cp, C), with SP reduce-scattered to (b, T/cp/tp, C)
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(pos))
        for block in self.transformer.h.values():
            x = block(x)
        if not self.last:
            return x
        x = self.transformer.ln_f(x)
        logits = F.linear(CopyToTP.apply(x, self.tp), self.head())  # (b, T/cp, vocab/tp)
        flat_logits = logits.flatten(0, 1)  # (b*T/cp, vocab/tp)
        return VocabParallelCrossEntropy.apply(flat_logits, targets.flatten(), self.vocab_start,
                                               self.tp.group).mean()


# ---- the strategy behind the loop's methods: DP's flat gradients, the grid, the stage, 1F1B --

def flat_grads(params):
    """One flat fp32 buffer that the .grads of params are views of: autograd accumulates straight
    into it, and its all-reduce needs no copy in or out."""
    buffer = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    for p, view in zip(params, buffer.split([p.numel() for p in params])):
        p.grad = view.view_as(p)
    return buffer


class Hybrid:
    """This rank's grid place: a TP shard of a stage's blocks, its CP positions, its DP rows."""

    def __init__(self, config, args, device, state=None):
        self.config, self.args, self.device = config, args, device
        sizes = [getattr(args, SIZE_FLAGS[axis]) for axis in AXES]
        self.grid = Grid(*sizes, timeout=datetime.timedelta(seconds=args.timeout_s))
        if args.print_grid and dist.get_rank() == 0:
            print(self.grid.table(), flush=True)
        self.tp = types.SimpleNamespace(group=self.grid.groups["tp"], size=self.grid.size["tp"],
                                        rank=self.grid.coords["tp"], sp=args.sequence_parallel)
        self.cp = CPGroup(self.grid.groups["cp"], args.block_size, device)
        self.M = args.n_microbatches
        stage, n_stages = self.grid.coords["pp"], self.grid.size["pp"]
        self.n_warmup = min(n_stages - 1 - stage, self.M)  # 1F1B: the forwards before the first B
        self.model = StageGPT(self.tp, self.cp, config, stage, n_stages, args.seed, device, state)
        # --compile: the block between its collectives; f, g and the CP ring run eagerly
        blocks = self.model.transformer.h.values()
        compile_forward(blocks, args.compile, BLOCK_LINEARS + ("attn.attend",))
        # full: a block's recompute runs its f, g and the CP ring again, at the B of its micro-batch
        checkpoint_blocks(blocks, args.activation_checkpointing)
        self.grads = flat_grads(list(self.model.parameters()))  # DP's one all-reduce, as ep's
        # a micro-batch is 1/(M*A) of my rows, the dp*cp ranks summed hold equal shares: sum = mean
        self.loss_scale = 1 / (self.M * args.grad_accum_steps * self.grid.size["dp"] * self.cp.size)
        pp_group = self.grid.groups["pp"]  # my stage's neighbours (global ranks), None past an end
        self.prev_stage = None if self.model.first else dist.get_global_rank(pp_group, stage - 1)
        self.next_stage = None if self.model.last else dist.get_global_rank(pp_group, stage + 1)
        self.pos = self.cp.positions  # my tokens' positions; with SP my TP rank's share of them
        if args.sequence_parallel:
            self.pos = self.cp.positions.chunk(self.tp.size)[self.tp.rank]
        self.loss_ranks = dist.get_world_size() // n_stages  # the last stage's, a mean each

    def configure_optimizer(self, args, state=None):
        named = list(self.model.named_parameters())
        betas = (args.beta1, args.beta2)
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        if state:  # a checkpoint's AdamW state, keyed by GPT name: this rank's piece of it
            for name, p in named:
                name = WTE_NAME if name == "lm_head.weight" else name
                set_adamw_state(optimizer, p, state[name], lambda full, n=name: shard(
                    n, full, self.tp.rank, self.tp.size).to(self.device, copy=True))
        return optimizer

    def p2p(self, peer, send=None, shape=None):
        """With the neighbouring stage `peer` (None past an end): `send`, and a receive of `shape`,
        posted together (NCCL: a send may wait for its receive); b x T/cp x C numbers (SP: /tp)."""
        if peer is None:
            return None
        ops, received = [], None
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, peer, self.grid.groups["pp"]))
        if shape is not None:
            received = torch.empty(shape, device=self.device)
            ops.append(dist.P2POp(dist.irecv, received, peer, self.grid.groups["pp"]))
        wait(dist.batch_isend_irecv(ops))
        return received

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its loss on the last stage, else 0."""
        loss = self.one_f_one_b(x, y, self.n_warmup)
        if sync:  # else accumulate only (DDP's no_sync)
            # my gradients, 4 bytes a local parameter, summed over dp x cp (loss_scale: sum = mean)
            dist.all_reduce(self.grads, group=self.grid.groups["dpxcp"])
            self.finish_gradients()
        return loss

    def one_f_one_b(self, x, y, n_warmup):
        """M micro-batches through this stage by 1F1B, as pp_train.py: n_warmup forwards (M: only
        forwards, evaluation), one forward one backward, then backwards. Returns the loss."""
        xs, ys = x[:, self.cp.positions].chunk(self.M), y[:, self.cp.positions].chunk(self.M)
        shape = (xs[0].size(0), len(self.pos), self.config.n_embd)
        stash = []  # (input, output) of each micro-batch between its F and its B
        loss_sum = torch.zeros((), device=self.device)
        def forward(i, received):
            inp = xs[i] if self.model.first else received.requires_grad_(torch.is_grad_enabled())
            with activations.first(), autocast(self.args, self.device):
                out = self.model(inp, ys[i], self.pos)
            if self.model.last:
                loss_sum.add_(out.detach().float() / self.M)
                out = out * self.loss_scale
            stash.append((inp, out))
            return None if self.model.last else out.detach()
        def backward(i, grad_out):
            inp, out = stash.pop(0)
            torch.autograd.backward(out, grad_out)  # accumulates into self.grads
            return None if self.model.first else inp.grad

        for i in range(n_warmup):
            received = self.p2p(self.prev_stage, shape=shape)
            self.p2p(self.next_stage, send=forward(i, received))
        n_steady = self.M - n_warmup
        if n_steady:
            received = self.p2p(self.prev_stage, shape=shape)
        for i in range(n_steady):
            grad_out = self.p2p(self.next_stage, send=forward(n_warmup + i, received), shape=shape)
            grad_in = backward(i, grad_out)
            last = i == n_steady - 1
            received = self.p2p(self.prev_stage, send=grad_in, shape=None if last else shape)
        if not torch.is_grad_enabled():  # evaluation: the M forwards were all there is
            return loss_sum
        for i in range(n_steady, self.M):
            grad_out = self.p2p(self.next_stage, shape=shape)
            self.p2p(self.prev_stage, send=backward(i, grad_out))
        return loss_sum

    def finish_gradients(self):
        """After DP's sum: SP's partial gradients summed over TP, the tied ones over pp ends."""
        if self.tp.sp:  # the replicated parameters saw this rank's sequence shard: partial sums
            grads = [p.grad for n, p in self.model.named_parameters() if shard_dim(n) is None]
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            dist.all_reduce(flat, group=self.tp.group)  # 4 bytes a number: the TP ranks' sum
            for grad, flat_grad in zip(grads, flat.split([grad.numel() for grad in grads])):
                grad.copy_(flat_grad.view_as(grad))
        if self.grid.tied_group is not None and (self.model.first or self.model.last):
            dist.all_reduce(self.model.head().grad, group=self.grid.tied_group)  # vocab/tp*C

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        loss = self.one_f_one_b(x, y, self.M)  # forwards only
        self.model.train()
        return loss

    def clip_grad_norm_(self, max_norm):
        # squares summed over (pp, tp): a replicated gradient on TP rank 0 only, lm_head's never
        named = list(self.model.named_parameters())
        counted = [p.grad for n, p in named if n != "lm_head.weight"
                   and (shard_dim(n) is not None or self.tp.rank == 0)]
        norm = clip_grad_norm_(counted, [], 0, self.grid.groups["ppxtp"])  # 0: measure only
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_([p for _, p in named], max_norm, norm)
        return norm

    def full_tensor(self, name, tensor):
        """The whole tensor: a TP-sharded one all-gathered from my TP group (shard()'s inverse)."""
        if self.tp.size == 1 or tensor.dim() == 0 or shard_dim(name) is None:
            return tensor
        if "c_attn" in name:  # each rank's q, k and v rows: gathered within each of the three
            return all_gather(tensor.unflatten(0, (3, -1)), self.tp.group, dim=1).flatten(0, 1)
        return all_gather(tensor, self.tp.group, dim=shard_dim(name))

    def full_state(self, optimizer):
        return gather_full_state(self, optimizer)  # checkpoint plumbing: after main()

    def describe(self):
        sizes = " x ".join(f"{axis} {self.grid.size[axis]}" for axis in AXES)
        mib = held_bytes(self.model.parameters()) / 2**20
        return (f"grid {sizes}, sequence_parallel {self.args.sequence_parallel}, 1F1B over "
                f"{self.M} micro-batches, {mib:.2f} MiB of parameters per rank")


class TorchHybrid(peers.torch_hybrid.TorchHybrid, Hybrid):
    """--implementation pytorch: peers/torch_hybrid.py's grid; describe and full_state: Hybrid's."""


def add_hybrid_flags(group):
    group.add_argument("--data_parallel_size", type=int, default=None,
                       help="dp (default: world size / (tp x pp x cp))")
    group.add_argument("--tensor_parallel_size", type=int, default=None, help="tp (default 1)")
    group.add_argument("--pipeline_parallel_size", type=int, default=None, help="pp (default 1)")
    group.add_argument("--context_parallel_size", type=int, default=None, help="cp (default 1)")
    add_bool(group, "--sequence_parallel", False, "TP: split the activations by sequence (SP)")
    group.add_argument("--n_microbatches", type=int, default=None,
                       help="PP: micro-batches per micro-step (default 4; 1 without PP)")
    add_bool(group, "--print_grid", False, "print every rank's coordinates and groups")


def check_hybrid_args(args, world_size):
    """Bad input: one line, before anything is built. Fills in the four sizes; returns dp."""
    sizes = {axis: getattr(args, SIZE_FLAGS[axis]) for axis in AXES}  # None: not given
    if error := grid_error(sizes, world_size):
        die(error)
    tp, pp, cp = (sizes[axis] or 1 for axis in ("tp", "pp", "cp"))
    dp = world_size // (tp * pp * cp)
    T = args.block_size
    splits = [("--n_head", args.n_head, tp, "--tensor_parallel_size"),
              ("--n_embd", args.n_embd, tp, "--tensor_parallel_size"),
              ("--vocab_size", args.vocab_size, tp, "--tensor_parallel_size"),
              ("--n_layer", args.n_layer, pp, "--pipeline_parallel_size"),
              ("--block_size", T, 2 * cp, "2 x --context_parallel_size, the zigzag split,")]
    for flag, value, size, what in splits:
        if value % size:
            die(f"{flag}: {value} must be divisible by {what} ({size})")
    if args.sequence_parallel and (T // cp) % tp:
        die(f"--block_size: {T} / --context_parallel_size ({cp}) must be divisible by "
            f"--tensor_parallel_size ({tp}) with --sequence_parallel")
    if args.dropout > 0 and tp * cp > 1:
        die("--dropout: must be 0 with tensor or context parallelism here (the ring has no "
            "attention dropout; tp_train.py shows TP's two dropout streams)")
    if args.n_microbatches is None:
        args.n_microbatches = 4 if pp > 1 else 1
    if args.n_microbatches <= 0:
        die("--n_microbatches: must be > 0")
    if args.batch_size % (dp * args.grad_accum_steps * args.n_microbatches):
        die(f"--batch_size: {args.batch_size} must be divisible by --data_parallel_size ({dp}) x "
            f"--grad_accum_steps ({args.grad_accum_steps}) x --n_microbatches "
            f"({args.n_microbatches})")
    peers.torch_hybrid.check_args(args, dict(dp=dp, tp=tp, pp=pp, cp=cp))
    args.data_parallel_size, args.tensor_parallel_size = dp, tp
    args.pipeline_parallel_size, args.context_parallel_size = pp, cp
    return dp


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("hybrid", add_hybrid_flags, argv)
    D = check_hybrid_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank = rank * D // world_size
    rows = B // D  # rows per data-parallel rank
    micro = rows // A  # rows per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    Strategy = Hybrid if args.implementation == "custom" else TorchHybrid
    model = Strategy(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    mfu = MFU(config, args, device, world_size)  # model FLOPs utilisation, per log line
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start, mfu=mfu)
    if rank == 0:
        print(f"hybrid ({args.implementation}): {world_size} rank(s) on {device} in {args.dtype}, "
              f"{model.describe()}; global batch {B} x {T} tokens, "
              f"{A} micro-step(s) of {micro} rows per data-parallel rank", flush=True)

    @torch.no_grad()
    def evaluate():
        """Mean loss over eval_iters fixed batches per split, combined as the logged loss below."""
        out = {}
        for split in ("train", "val"):
            total = torch.zeros((), device=device)
            for i in range(args.eval_iters):
                x, y = get_batch(split, i, B, T, args.seed + 1, args.dataset)
                x, y = x[mine].to(device), y[mine].to(device)
                total += model.eval_loss(x, y)
            dist.all_reduce(total)  # 4 bytes
            out[split] = total.item() / model.loss_ranks / args.eval_iters
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
        # Logged loss: the mean over all B*T tokens of the global batch: the last stage's ranks'
        # means (equal token counts), summed over every rank (the others add 0), and divided.
        dist.all_reduce(loss_sum)  # 4 bytes
        loss_sum /= A * model.loss_ranks
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


# ---- checkpoint: the grid's tensors gathered into one full checkpoint ----------------------

def gather_full_state(hybrid, optimizer):
    """The full checkpoint's dicts, by GPT name, on rank 0's CPU (None elsewhere): each tensor of
    stage s all-gathered by the TP group (dp 0, s, cp 0), sent on by its TP rank 0 (not lm_head)."""
    c = hybrid.grid.coords
    entries = []  # only my stage's first TP group takes part
    for name, p in hybrid.model.named_parameters():
        if name == "lm_head.weight" or c["dp"] or c["cp"]:
            continue
        values = {"param": p.detach(), **optimizer.state.get(p, {})}  # step: a CPU scalar
        for key, value in values.items():
            value = value.to(hybrid.device)
            shape = hybrid.model.full_shapes[name] if value.dim() else value.shape  # step: ()
            make = lambda name=name, value=value: hybrid.full_tensor(name, value)
            entries.append((name, key, shape, value.dtype, make))
    return gather_to_rank0(entries, c["tp"] == 0, hybrid.config, hybrid.device)


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
