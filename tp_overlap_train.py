"""TP with --tp_overlap: tp_train.py's Megatron TP, its collectives in pieces under the matmuls.

The tp_size ranks of a TP group split every matmul instead of the batch. In each block the first
linear is column-parallel (rank r owns a slice of its outputs: c_attn's q, k, v by whole heads, so
attention runs on n_head/tp_size local heads) and the second row-parallel (rank r owns the matching
inputs: a partial sum). Two conjugate operators join each pair: g all-reduces the (B, T, C) partial
sums after row-parallel in forward, f the input gradient before column-parallel in backward: 2 of
each per block, each about 2(tp_size-1)/tp_size x 4BTC bytes sent per rank. wte and the tied
lm_head are split by vocabulary: --loss_parallel's loss all-reduces B*T, then 2B*T numbers.
  memory per rank: about 16P/tp_size bytes (fp32 param + grad + AdamW state of this rank's shards,
                   plus the small replicated LayerNorms, row-parallel biases and wpe)
--sequence_parallel: between the linears the activations are split by sequence too (1/tp_size of
their memory): each all-reduce becomes a reduce-scatter after row-parallel and an all-gather before
column-parallel, the same bytes; the replicas' partial gradients are summed over TP after backward.
2D: N = D x tp_size ranks (--data_parallel_size D) in a grid, a row a TP group of consecutive ranks,
a column a DP group that splits the batch and, after backward, sums its gradients of loss / D.
--tp_overlap (on; false: tp_train.py's path): each f and g is fused with its matmul and sent in
pieces, each travelling while the next is multiplied (Megatron's --tp-comm-overlap): with SP in
tp_size - 1 ring passes, without SP the output's all-reduce in OVERLAP_CHUNKS pieces and the input
gradient's under the weight gradient. It needs a free engine for the bytes (a GPU's): on a CPU it
measured no faster (docs/tp.md).
Run (the derivations, the design and what was measured: docs/tp.md):
  python tp_overlap_train.py                                    # single process: the reference
  torchrun --standalone --nproc_per_node=2 tp_overlap_train.py  # TP=2 (GPUs, or CPU processes)
  torchrun --standalone --nproc_per_node=2 tp_overlap_train.py --sequence_parallel
  torchrun --standalone --nproc_per_node=4 tp_overlap_train.py --tensor_parallel_size 2  # DP2 x TP2
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 tp_overlap_train.py --tensor_parallel_size 8  # DP: nodes
"""
import os
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common.checkpoint import checkpoint, resume, set_adamw_state
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import Batches, get_batch
from common.distributed import all_gather_single, autocast, clip_grad_norm_, reduce_scatter_single
from common.distributed import setup, setup_data, teardown
from common.metrics import MFU, Metrics, Profiler, activations, held_bytes, model_state_bytes
from common.metrics import timers
from common.model import BLOCK_LINEARS, GPT, LOSS_CHUNK_ROWS, compile_forward, configure_optimizer
from common.model import cross_entropy, init_tensor
from common.recompute import checkpoint_blocks


# ---- the strategy: Megatron's conjugate operators, on the TP group -----------------------
# Shapes: B rows, T positions, C n_embd, V vocabulary, nh heads of hs numbers, tp = tp_size. A ring
# sends about 2(tp-1)/tp of a tensor's bytes per rank to all-reduce it, (tp-1)/tp for the others.

class TPGroup:
    """The tensor-parallel group: its size, this rank's place in it and its ring neighbours (global
    ranks), whether SP is on, and whether the collectives overlap the matmuls (--tp_overlap)."""
    def __init__(self, group, sequence_parallel, overlap=False):
        self.group, self.sp = group, sequence_parallel
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.overlap = overlap


def all_gather(x, group, dim):
    """The ranks' x concatenated in rank order along `dim`: (B, T/tp, C) shards -> (B, T, C)."""
    tp_size = dist.get_world_size(group)
    out = x.new_empty((tp_size * x.size(0),) + x.shape[1:])  # gloo wants the ranks along dim 0
    all_gather_single(out, x.contiguous(), group=group)  # x.numel() numbers from each rank
    return torch.cat(out.chunk(tp_size), dim=dim)


def reduce_scatter_seq(x, group):
    """(B, T, C) partial sums on the ranks -> (B, T/tp, C): this rank's shard of their sum."""
    tp_size = dist.get_world_size(group)
    chunks = torch.cat(x.chunk(tp_size, dim=1))  # (tp*B, T/tp, C): shard r at rows r*B..(r+1)*B
    out = chunks.new_empty((x.size(0),) + chunks.shape[1:])  # (B, T/tp, C)
    reduce_scatter_single(out, chunks, group=group)  # sends the others' shards, gets its own summed
    return out


class CopyToTP(torch.autograd.Function):
    """f, before a column-parallel matmul: identity forward, all-reduce of the partial input
    gradients backward. With SP: all-gather of sequence shards forward, reduce-scatter backward."""
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        if not tp.sp:
            return x
        with timers("exposed_comm"):  # every wait of the plain path is exposed
            return all_gather(x, tp.group, dim=1)  # (B, T/tp, C) -> (B, T, C)

    @staticmethod
    def backward(ctx, grad):
        with timers("exposed_comm"):
            if ctx.tp.sp:
                return reduce_scatter_seq(grad, ctx.tp.group), None
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.tp.group)  # B*T*C numbers: the partial input grads
            return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g, after a row-parallel matmul: all-reduce of the partial outputs forward, identity backward.
    With SP: reduce-scatter (sum and split by sequence in one step) forward, all-gather backward."""
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        with timers("exposed_comm"):
            if tp.sp:
                return reduce_scatter_seq(x, tp.group)  # (B, T, C) -> (B, T/tp, C)
            x = x.contiguous()
            dist.all_reduce(x, group=tp.group)  # B*T*C numbers: the sum of the tp partial outputs
            return x

    @staticmethod
    def backward(ctx, grad):
        if not ctx.tp.sp:
            return grad, None
        with timers("exposed_comm"):
            return all_gather(grad, ctx.tp.group, dim=1), None


# ---- the strategy: --tp_overlap, the collectives under the matmuls --------------------------
# gloo moves a message on its own thread (NCCL on its own stream) while the main thread multiplies:
# f and g are each fused with their matmul into one autograd Function, so that piece k of the
# collective travels while piece k + 1 is multiplied: the same numbers sent, the sums reordered.

OVERLAP_CHUNKS = 4  # without SP: pieces of the row-parallel output's all-reduce


def wait(works):
    with timers("exposed_comm"):  # the transfer time the matmuls did not hide
        for work in works:
            work.wait()


def pass_to_next(tensor, tp):
    """Sends tensor to the next rank of the ring and receives the previous rank's into a new one,
    tensor.numel() numbers each way. Both in one batch_isend_irecv: under NCCL a send may wait for
    its receive, and every rank posting its pair together cannot deadlock."""
    received = torch.empty_like(tensor)
    send = dist.P2POp(dist.isend, tensor, tp.next, tp.group)
    receive = dist.P2POp(dist.irecv, received, tp.prev, tp.group)
    works = dist.batch_isend_irecv([send, receive])
    return received, works


def ring_all_gather(x, tp, compute):
    """With SP: compute(shard) for every rank's sequence shard of x, each while the next travels
    round the ring (tp - 1 passes of x.numel() numbers: an all-gather's bytes). Returns the
    results and the shards, each concatenated in rank order along dim 1."""
    shards, results = [None] * tp.size, [None] * tp.size
    s = tp.rank  # the shard in hand: first its own, then rank - 1's, rank - 2's, ...
    for i in range(tp.size):
        if i < tp.size - 1:
            received, works = pass_to_next(x, tp)  # the shard in hand goes on to rank + 1...
        shards[s], results[s] = x, compute(x)  # ...while it is multiplied here
        if i < tp.size - 1:
            wait(works)
            x, s = received, (s - 1) % tp.size
    return torch.cat(results, dim=1), torch.cat(shards, dim=1)


def ring_reduce_scatter(term, tp):
    """With SP: this rank's sequence shard of the sum over ranks of term(s), a rank's term of
    shard s. At pass i rank r computes its term of shard (r - i - 1) % tp while the sum before
    travels, adds the sum received from rank r - 1 and sends it on; after tp - 1 passes (a
    reduce-scatter's bytes) its own shard's sum arrives, and its own term is the last added."""
    works = None
    for i in range(tp.size):
        partial = term((tp.rank - i - 1) % tp.size)  # multiplied while the last pass travels
        if works is not None:
            wait(works)
            partial = partial + received  # the sum of the ranks before, for the same shard
        if i < tp.size - 1:
            sent = partial  # kept alive until its send completes
            received, works = pass_to_next(sent, tp)
    return partial


def autocast_inputs(*tensors):
    """The tensors in the dtype autocast would multiply them in: a Function's backward runs
    outside autocast, so forward casts what it saves (None stays None)."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return [t if t is None else t.to(dtype) for t in tensors]


class OverlappedColumnParallel(torch.autograd.Function):
    """--tp_overlap: y = f(x) W_r^T + b_r in one Function.
    forward:  with SP the all-gather of x is the ring, each shard multiplied while the next
              travels; without SP nothing is sent.
    backward: dx = dy W_r is partial on each rank. With SP its reduce-scatter is the ring, each
              shard's dx computed while the sum before travels; without SP its all-reduce starts
              at once and travels while dW = dy^T x is computed (Megatron's async all-reduce)."""
    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.tp, ctx.dtypes, ctx.has_bias = tp, (x.dtype, weight.dtype), bias is not None
        x, weight, bias = autocast_inputs(x, weight, bias)
        if tp.sp:  # (B, T/tp, in) shards -> y (B, T, out/tp), and x (B, T, in)
            y, x = ring_all_gather(x, tp, lambda shard: F.linear(shard, weight, bias))
        else:
            y = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)  # x whole, as the plain path's F.linear saves it
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors  # (B, T, in), (out/tp, in)
        tp, dy = ctx.tp, dy.to(weight.dtype)
        if tp.sp:  # (B, T/tp, in)
            dx = ring_reduce_scatter(lambda s: dy.chunk(tp.size, dim=1)[s] @ weight, tp)
            works = []
        else:  # (B, T, in)
            dx = dy @ weight
            works = [dist.all_reduce(dx, group=tp.group, async_op=True)]  # B*T*in numbers
        dW = dy.flatten(0, 1).t() @ x.flatten(0, 1)  # computed while dx's all-reduce travels
        db = dy.sum((0, 1)).to(ctx.dtypes[1]) if ctx.has_bias else None
        wait(works)
        return dx.to(ctx.dtypes[0]), dW.to(ctx.dtypes[1]), db, None


class OverlappedRowParallel(torch.autograd.Function):
    """--tp_overlap: g(x_r W_r^T) in one Function (the bias is added after).
    forward:  with SP the reduce-scatter is the ring, each shard's term multiplied while the sum
              before travels; without SP the rows are multiplied in OVERLAP_CHUNKS pieces, each
              piece's all-reduce travelling while the next is multiplied: only the last waits.
    backward: with SP the all-gather of dy is the ring, each shard's dx computed while the next
              shard travels; without SP nothing is sent."""
    @staticmethod
    def forward(ctx, x, weight, tp):
        ctx.tp, ctx.dtypes = tp, (x.dtype, weight.dtype)
        x, weight = autocast_inputs(x, weight)
        ctx.save_for_backward(x, weight)
        if tp.sp:  # (B, T, in/tp) -> (B, T/tp, out)
            return ring_reduce_scatter(lambda s: F.linear(x.chunk(tp.size, dim=1)[s], weight), tp)
        pieces, works = [], []
        for rows in x.flatten(0, 1).chunk(OVERLAP_CHUNKS):  # (B*T/chunks, in/tp) each
            pieces.append(F.linear(rows, weight))  # multiplied while the piece before travels
            works.append(dist.all_reduce(pieces[-1], group=tp.group, async_op=True))
        wait(works)
        return torch.cat(pieces).view(x.shape[0], x.shape[1], -1)  # (B, T, out)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors  # (B, T, in/tp), (out, in/tp)
        tp, dy = ctx.tp, dy.to(weight.dtype)
        if tp.sp:  # (B, T/tp, out) shards -> dx (B, T, in/tp), and dy (B, T, out)
            dx, dy = ring_all_gather(dy.contiguous(), tp, lambda dy_shard: dy_shard @ weight)
        else:
            dx = dy @ weight
        dW = dy.flatten(0, 1).t() @ x.flatten(0, 1)
        return dx.to(ctx.dtypes[0]), dW.to(ctx.dtypes[1]), None


def column_parallel(x, weight, bias, tp):
    """f(x) W^T + b; with --tp_overlap, one Function whose collectives run under its matmuls."""
    if tp.overlap:
        return OverlappedColumnParallel.apply(x, weight, bias, tp)
    return F.linear(CopyToTP.apply(x, tp), weight, bias)


def row_parallel(x, weight, tp):
    """g(x W^T); with --tp_overlap, one Function whose collectives run under its matmuls."""
    if tp.overlap:
        return OverlappedRowParallel.apply(x, weight, tp)
    return ReduceFromTP.apply(F.linear(x, weight), tp)


# ---- the strategy: the parallel layers, and the loss from the vocabulary-split logits -----

class ColumnParallelLinear(nn.Module):
    """y_r = f(x) W_r^T + b_r: this rank's out_features/tp outputs, from the whole input."""
    def __init__(self, tp, in_features, out_features, bias):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp.size)) if bias else None

    def forward(self, x):  # f: x (B, T, in_features) whole, then the matmul: (B, T, out/tp)
        return column_parallel(x, self.weight, self.bias, self.tp)


class RowParallelLinear(nn.Module):
    """y = g(x_r W_r^T) + b: this rank's in_features/tp slice of the matmul, summed by g; b once."""
    def __init__(self, tp, in_features, out_features, bias):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x):  # this rank's (B, T, out) term, summed by g: (B, T/tp, out) with SP
        out = row_parallel(x, self.weight, self.tp)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Rank r owns rows [r*V/tp, (r+1)*V/tp): it looks up its ids, zeroes the others; g sums."""
    def __init__(self, tp, vocab_size, n_embd):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(vocab_size // tp.size, n_embd))
        self.vocab_start = tp.rank * (vocab_size // tp.size)

    def forward(self, idx):
        local = idx - self.vocab_start
        owned = (local >= 0) & (local < self.weight.size(0))  # the ids this rank holds
        rows = F.embedding(local.clamp(0, self.weight.size(0) - 1), self.weight)  # (B, T, C)
        return ReduceFromTP.apply(rows * owned.unsqueeze(-1), self.tp)  # the others' ids: zero


class GatherFromVocab(torch.autograd.Function):
    """--loss_parallel false: all-gather the (B, T, V/tp) logit slices; backward keeps its own."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        return all_gather(x, group, dim=-1)  # B*T*V/tp numbers from each rank

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), dim=-1)[ctx.rank], None


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


# ---- the strategy: the model, built from shards ------------------------------------------

def shard_dim(name):
    """The dimension along which parameter `name` of GPT is split over the TP group, or None."""
    if name.endswith(("wte.weight", "lm_head.weight")):
        return 0  # vocabulary rows
    if name.endswith(("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias")):
        return 0  # column-parallel: output features (and their biases)
    if name.endswith("c_proj.weight"):
        return 1  # row-parallel: input features
    return None   # replicated: LayerNorms, wpe, row-parallel biases (added once, after the sum)


def shard(name, full, rank, tp_size):
    """Rank `rank`'s slice of the full tensor `name`; c_attn's fused [q; k; v]: [q_r; k_r; v_r]."""
    dim = shard_dim(name)
    if "c_attn" in name:
        qkv = full.unflatten(0, (3, -1))  # (3, C, ...): q, k, v
        heads = qkv.chunk(tp_size, dim=1)[rank]  # (3, C/tp, ...): this rank's heads of each
        return heads.flatten(0, 1)  # (3C/tp, ...)
    return full if dim is None else full.chunk(tp_size, dim=dim)[rank]


def unshard(name, shards):
    """The inverse of shard(): the full tensor from the tp_size slices, in rank order."""
    dim = shard_dim(name)
    if "c_attn" in name:
        qkv = torch.cat([s.unflatten(0, (3, -1)) for s in shards], dim=1)  # (3, C, ...)
        return qkv.flatten(0, 1)  # (3C, ...) = [q; k; v]
    return shards[0] if dim is None else torch.cat(shards, dim=dim)


class TPAttention(nn.Module):
    """Causal self-attention on this rank's n_head/tp heads: c_attn gives their q, k, v whole, so
    attention itself needs no communication; c_proj's g sums the heads' contributions."""
    def __init__(self, tp, config):
        super().__init__()
        self.c_attn = ColumnParallelLinear(tp, config.n_embd, 3 * config.n_embd, config.bias)
        self.c_proj = RowParallelLinear(tp, config.n_embd, config.n_embd, config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head // tp.size  # this rank's heads
        self.dropout, self.tp_rank = config.dropout, tp.rank

    def forward(self, x):  # x: (B, T, C), or (B, T/tp, C) with SP; TorchTP runs it too
        qkv = self.c_attn(x)  # (B, T, 3C/tp) = [q_r, k_r, v_r]: this rank's heads, whole
        B, T, _ = qkv.shape
        # q, k, v: each (B, T, C/tp) -> (B, nh/tp, T, hs)
        q, k, v = [t.view(B, T, self.n_head, -1).transpose(1, 2) for t in qkv.chunk(3, dim=2)]
        out = self.attend(q, k, v)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, nh/tp, T, hs) -> (B, T, C/tp)
        return self.resid_dropout(self.c_proj(out))  # (B, T, C), or (B, T/tp, C) with SP

    def attend(self, q, k, v):
        """GPT's attention core on this rank's heads, its dropout masks from the rank's own stream
        (selective checkpointing recomputes it: the seed drawn again is the same)."""
        dropout_p = self.dropout if self.training else 0.0
        with tp_rank_rng(self.tp_rank, q.device) if dropout_p else nullcontext():  # own masks
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class TPGPT(GPT):
    """GPT with wte, attention and MLP linears swapped for the parallel ones (same names), each
    holding this rank's shard of init_tensor's value or of `state`; lm_head is the tied wte."""
    def __init__(self, tp, config, seed, device, loss_parallel=True, state=None):
        super().__init__(config, device="meta")
        self.tp, self.loss_parallel = tp, loss_parallel
        full_shapes = {n: p.shape for n, p in self.named_parameters()}
        C = config.n_embd
        with torch.device("meta"):
            self.transformer.wte = VocabParallelEmbedding(tp, config.vocab_size, C)
            for block in self.transformer.h:
                block.attn = TPAttention(tp, config)
                block.mlp.c_fc = ColumnParallelLinear(tp, C, 4 * C, config.bias)
                block.mlp.c_proj = RowParallelLinear(tp, 4 * C, C, config.bias)
        del self.lm_head
        self.to_empty(device=device)
        with torch.no_grad():  # deferred init: one full tensor at a time, keeping this rank's slice
            for name, p in self.named_parameters():
                full = state[name] if state else init_tensor(name, full_shapes[name], config, seed)
                p.copy_(shard(name, full, tp.rank, tp.size))
        if tp.sp:
            fork_sequence_parallel_dropouts(self, tp.rank)
        # with SP the replicated parameters see this rank's sequence shard: partial gradients
        replicated = [p for n, p in self.named_parameters() if shard_dim(n) is None]
        self.sequence_parallel_params = replicated if tp.sp else []

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        if self.tp.sp:  # this rank's positions [r*T/tp, (r+1)*T/tp)
            pos = pos.chunk(self.tp.size)[self.tp.rank]
        tok_emb = self.transformer.wte(idx)  # (B, T, C), or (B, T/tp, C) with SP
        pos_emb = self.transformer.wpe(pos)  # (T, C), or (T/tp, C) with SP
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        # f and lm_head, tied to wte: (B, T, C), or (B, T/tp, C) with SP -> (B, T, V/tp)
        logits = column_parallel(x, self.transformer.wte.weight, None, self.tp)
        if targets is None:
            return logits, None
        if self.loss_parallel:  # the (B*T, V/tp) slices, never gathered
            vocab_start = self.transformer.wte.vocab_start
            losses = VocabParallelCrossEntropy.apply(logits.view(B * T, -1), targets.view(-1),
                                                     vocab_start, self.tp.group)
            return logits, losses.mean()
        logits = GatherFromVocab.apply(logits, self.tp.group)  # (B, T, V)
        return logits, cross_entropy(logits.view(B * T, -1), targets.view(-1))  # (B*T, V)


def all_reduce_grads(grads, group):
    """One flat all-reduce (SUM) of these gradients over `group` (numel x 4 bytes), in place."""
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    for grad, flat_grad in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(flat_grad.view_as(grad))


class TensorParallel:
    """The strategy behind the few methods the training loop calls: TPGPT's shards on the TP group
    (a row of the D x tp_size grid), its gradients summed over the DP group (a column)."""
    def __init__(self, config, args, device, state=None):
        self.args, self.device = args, device
        self.tp_size = args.tensor_parallel_size
        # the D x tp_size grid: a row a TP group (consecutive ranks: a node's links), a column DP
        self.grid = torch.arange(dist.get_world_size()).view(-1, self.tp_size)
        self.tp_group, _ = dist.new_subgroups_by_enumeration(self.grid.tolist())
        self.dp_group, _ = dist.new_subgroups_by_enumeration(self.grid.t().tolist())
        self.share_rng(resumed=state is not None)
        tp = TPGroup(self.tp_group, args.sequence_parallel, args.tp_overlap)
        self.model = TPGPT(tp, config, args.seed, device, args.loss_parallel, state)
        # --compile: what lies between f and g; the linears (collectives) and SDPA (its RNG) eager
        compile_forward(self.model.transformer.h, args.compile, BLOCK_LINEARS + ("attn.attend",))
        # full: a block's recompute runs its forward collectives again in backward
        checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)

    def share_rng(self, resumed):
        """Dropout's shared stream, the default generators (CPU and device): equal on the TP group,
        once. Fresh: seeded by DP rank. Resumed: TP rank 0's go to the others (layouts differ)."""
        generators = [torch.default_generator, device_generator(self.device)]
        for generator in dict.fromkeys(generators):  # in order; the CPU's once on a CPU device
            if resumed:
                state = generator.get_state().to(self.device)  # nccl sends device tensors
                dist.broadcast(state, group=self.tp_group, group_src=0)  # 5 KB (CPU), 16 B (CUDA)
                generator.set_state(state.cpu())
            else:
                generator.manual_seed(self.args.seed + dist.get_rank(self.dp_group))

    def configure_optimizer(self, args, state=None):
        betas = (args.beta1, args.beta2)
        named = self.model.named_parameters()
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        if state:  # a checkpoint's AdamW state, keyed by parameter name
            for name, p in self.model.named_parameters():  # each full moment cut to this rank's
                set_adamw_state(optimizer, p, state[name], lambda t: self.local_piece(name, p, t))
        return optimizer

    def local_piece(self, name, p, full):
        """A new tensor laid out like parameter `p`: this rank's piece of the full tensor `name`."""
        return torch.empty_like(p).copy_(shard(name, full, self.model.tp.rank, self.tp_size))

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its loss. sync=False: accumulate only."""
        with activations.first(), autocast(self.args, self.device):  # kept for backward: SP shrinks
            _, loss = self.model(x, y)
        (loss / (self.args.grad_accum_steps * len(self.grid))).backward()  # see sum_over_dp
        if sync:
            self.sum_over_dp([p.grad for p in self.model.parameters()])
        if sync and self.model.sequence_parallel_params:  # each rank's from its shard only: sum
            all_reduce_grads([p.grad for p in self.model.sequence_parallel_params], self.tp_group)
        return loss.detach().float()

    def sum_over_dp(self, grads):
        """DP: the local gradients of losses / (A micro-steps x D ranks), summed over the DP group:
        the mean, by one flat all-reduce of about 4P/tp_size bytes after backward (no overlap)."""
        if len(self.grid) > 1:
            all_reduce_grads(grads, self.dp_group)

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # the sharded gradients' squares summed over the TP group, the replicated ones counted once
        named = list(self.model.named_parameters())
        sharded = [p.grad for n, p in named if shard_dim(n) is not None]
        replicated = [p.grad for n, p in named if shard_dim(n) is None]
        return clip_grad_norm_(sharded, replicated, max_norm, self.tp_group)

    def full_state(self, optimizer):
        """Collective: the full format in rank 0's CPU memory (None elsewhere), gathered from the TP
        group a tensor at a time, each copied to rank 0's CPU before the next."""
        rank0 = dist.get_rank() == 0
        model, optim = {}, {}
        for name, p in self.model.named_parameters():
            value = self.full_tensor(name, p.detach())
            if rank0:
                model[name] = value.to("cpu", copy=True)
            for key, value in optimizer.state.get(p, {}).items():
                if value.dim():  # exp_avg, exp_avg_sq (not step, a CPU scalar)
                    value = self.full_tensor(name, value)
                if rank0:
                    optim.setdefault(name, {})[key] = value.to("cpu", copy=True)
        if not rank0:
            return None, None
        model["lm_head.weight"] = model["transformer.wte.weight"]  # tied; last, as in GPT's
        return model, optim

    def full_tensor(self, name, tensor):
        """The whole tensor, on this rank's device: a sharded one all-gathered from the TP group."""
        if shard_dim(name) is not None:  # every rank sends its shard to every other rank
            shards = all_gather(tensor, self.tp_group, dim=0).chunk(self.tp_size)
            tensor = unshard(name, list(shards))
        return tensor

    def describe(self):
        grid = f"DP {len(self.grid)} x TP {self.tp_size} grid {self.grid.tolist()} (row = TP group)"
        mib = held_bytes(self.model.parameters()) / 2**20
        return (f"{grid}, sequence_parallel {self.args.sequence_parallel}, loss_parallel "
                f"{self.args.loss_parallel}, {mib:.2f} MiB of parameters per rank")


# ---- the strategy: dropout's two random streams, as in Megatron (--dropout, 0 by default) ----
# Activations every TP rank holds whole draw the same masks from the shared stream (share_rng);
# a rank's own heads, and with SP its sequence shard, draw from the rank's own stream, forked here.

def device_generator(device):
    """The generator the device's ops draw from: CUDA ops the GPU's, not the CPU's."""
    cuda = device.type == "cuda"
    return torch.cuda.default_generators[device.index] if cuda else torch.default_generator


@contextmanager
def tp_rank_rng(tp_rank, device):
    """Seeds the device's generator with seed + tp_rank, seed drawn from the shared CPU stream (no
    device sync), and puts the shared state back on exit: restored with it from a checkpoint."""
    seed, generator = int(torch.randint(2**62, ())), device_generator(device)
    shared = generator.get_state()
    generator.manual_seed(seed + tp_rank)
    try:
        yield
    finally:
        generator.set_state(shared)


class TPRankDropout(nn.Dropout):
    """--sequence_parallel: GPT's nn.Dropouts act on sequence shards: the rank's own stream."""
    def __init__(self, dropout, tp_rank):
        super().__init__(dropout)
        self.tp_rank = tp_rank

    def forward(self, x):
        return self.on_rank_stream(x) if self.training and self.p else super().forward(x)

    @torch.compiler.disable  # --compile: generator states are host objects; the graph breaks here
    def on_rank_stream(self, x):
        with tp_rank_rng(self.tp_rank, x.device):
            return super().forward(x)


def fork_sequence_parallel_dropouts(model, tp_rank):  # every nn.Dropout becomes a TPRankDropout
    for name, module in list(model.named_modules()):  # listed first: the loop replaces modules
        if type(module) is nn.Dropout:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, TPRankDropout(module.p, tp_rank))


def add_tp_flags(group):
    group.add_argument("--tensor_parallel_size", type=int, default=None,
                       help="tp_size (default: world size / D)")
    group.add_argument("--data_parallel_size", type=int, default=None,
                       help="D (default: world size / tp_size, else 1)")
    add_bool(group, "--sequence_parallel", False, "split activations between linears by sequence")
    add_bool(group, "--loss_parallel", True, "vocab-parallel cross-entropy (false: gather logits)")
    add_bool(group, "--tp_overlap", True,
             "split the activations' collectives into pieces that travel under the matmuls")


def check_tp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Sets both grid sizes on
    args (--tensor_parallel_size, --data_parallel_size) and returns D."""
    if args.implementation == "pytorch":
        die("--implementation: custom only; torch's async TP needs torch.compile and CUDA's "
            "symmetric memory (tp_train.py --implementation pytorch: DTensor's TP)")
    tp_size, D = args.tensor_parallel_size, args.data_parallel_size
    for flag, size in (("--tensor_parallel_size", tp_size), ("--data_parallel_size", D)):
        if size is not None and size <= 0:
            die(f"{flag}: must be > 0, got {size}")
    tp_size = tp_size or world_size // (D or 1)
    D = D or world_size // max(tp_size, 1)
    dims = [("--n_head", args.n_head), ("--n_embd", args.n_embd), ("--vocab_size", args.vocab_size)]
    dims += [("--block_size", args.block_size)] * args.sequence_parallel  # SP splits the sequence
    for flag, value in dims:
        if tp_size and value % tp_size:
            die(f"{flag}: {value} must be divisible by --tensor_parallel_size ({tp_size})")
    if tp_size * D != world_size or tp_size == 0:
        die(f"--tensor_parallel_size: {tp_size} x --data_parallel_size {D} != {world_size} ranks")
    check_batch_split(args, D)
    args.tensor_parallel_size, args.data_parallel_size = tp_size, D
    return D


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("tp", add_tp_flags, argv)
    D = check_tp_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank = rank * D // world_size
    rows = B // D  # rows per data-parallel rank
    micro = rows // A  # rows per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    model = TensorParallel(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    mfu = MFU(config, args, device, world_size)  # model FLOPs utilisation, per log line
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start, mfu=mfu)
    if rank == 0:
        print(f"tp ({args.implementation}): {world_size} rank(s) on {device} in {args.dtype}, "
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
        # logged: the mean over the global batch's B*T tokens (equal chunks: the mean of means)
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
