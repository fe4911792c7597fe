"""TP: Megatron tensor parallelism (+ sequence and loss parallelism, and 2D DP x TP), written by hand.

The T ranks of a tensor-parallel group split every matmul of the model instead of the batch. In
each block the first linear is column-parallel (rank r owns output columns r: c_attn's q, k, v by
whole heads, so attention runs locally on n_head/T heads; c_fc's 4C/T hidden units) and the second
is row-parallel (rank r owns the matching input rows and makes a partial sum). So one all-reduce of
the (B, S, C) activation per linear pair per pass joins them: 2 per block in forward ("g" after
attn.c_proj and mlp.c_proj) and 2 in backward ("f" before c_attn and c_fc). The embedding is split
by vocabulary (masked lookup + all-reduce); lm_head is tied to it, so logits come out split by
vocabulary and --loss_parallel computes the cross-entropy from three all-reduces of (B, S) numbers
(max, sum of exp, target logit) without ever gathering the (B, S, V) logits. Memory per rank: the
sharded weights (most of them) / T plus the replicated LayerNorms, row biases and wpe, x 16 bytes
(fp32 param + grad + AdamW state): about 16P/T.

--sequence_parallel: between the row- and column-parallel linears (LayerNorms, dropout, residual)
activations are split along the sequence too, so they cost 1/T of the memory: the all-reduce
becomes a reduce-scatter (after row-parallel) + all-gather (before column-parallel), the same bytes.
(The column-parallel matmul still saves its gathered input for backward; Megatron saves the shard
and all-gathers it again in backward, one more all-gather per linear: not done here.)
The replicated parameters used on sequence shards (LayerNorms, row biases, wpe) then get partial
gradients that are summed over the TP group after backward.

2D: --tensor_parallel_size T x --data_parallel_size D = world size. Ranks form a D x T grid (row =
TP group of consecutive ranks, column = DP group); each DP group splits the global batch as in
ddp_train.py and averages gradients with its bucketed, overlapped all-reduce (GradientBuckets).

Deferred init: each rank builds its shards directly, one full tensor at a time (init_tensor's, or on
resume the checkpoint's, whichever script and world size wrote it), keeping its slice.

Run:
  python tp_train.py                                        # single process: the reference
  torchrun --standalone --nproc_per_node=2 tp_train.py      # TP=2 (2 GPUs, or 2 CPU processes)
  torchrun --standalone --nproc_per_node=2 tp_train.py --sequence_parallel
  torchrun --standalone --nproc_per_node=4 tp_train.py --tensor_parallel_size 2 --data_parallel_size 2
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
           tp_train.py --tensor_parallel_size 8 --data_parallel_size 2   # TP inside a node, DP across
  torchrun --standalone --nproc_per_node=2 tp_train.py --implementation pytorch   # DTensor, same loop
"""
import os
import time
import types
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

from common.checkpoint import resume, save_checkpoint, set_adamw_state
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import get_batch
from common.distributed import autocast, setup, setup_data, teardown
from common.metrics import Metrics, SavedActivations, peak_mem_bytes, tensor_bytes
from common.model import GPT, LayerNorm, configure_optimizer, init_tensor
from ddp_train import GradientBuckets


# ---- the strategy: Megatron's conjugate operators, on the TP group -----------------------
# Each moves one activation (or its gradient) of B x S x C fp32 numbers; in a ring each rank sends
# about 2(T-1)/T of its bytes for an all-reduce and (T-1)/T for an all-gather or reduce-scatter.

class CopyToTP(torch.autograd.Function):
    """f: identity forward; backward all-reduce. Before a column-parallel linear every rank uses the
    same input, and each rank's weight slice contributes a partial input gradient: sum them."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # B*S*C floats to/from every TP rank: the summed input grad
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward; identity backward. After a row-parallel linear each rank holds a
    partial sum of the output; the sum is the output, and its gradient reaches every rank whole."""
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)  # B*S*C floats: sum of the T partial outputs
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_gather(x, group, dim):
    """The T ranks' x concatenated in rank order along `dim`: (B, S/T, C) sequence shards -> (B, S, C)."""
    T = dist.get_world_size(group)
    out = x.new_empty((T * x.size(0),) + x.shape[1:])  # gloo wants the ranks stacked along dim 0
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)  # x.numel() floats from each rank
    return torch.cat(out.chunk(T), dim=dim)


def _reduce_scatter_seq(x, group):
    """(B, S, C) partial sums on T ranks -> (B, S/T, C): this rank's sequence shard of the sum."""
    chunks = torch.cat(x.chunk(dist.get_world_size(group), dim=1))  # (T*B, S/T, C): shard r is rows r*B..
    out = chunks.new_empty((x.size(0),) + chunks.shape[1:])
    dist.reduce_scatter_tensor(out, chunks, group=group)  # each rank sends T-1 shards, gets its summed one
    return out


class GatherFromSequence(torch.autograd.Function):
    """SP's f: all-gather the sequence shards forward; backward reduce-scatter (each rank's partial
    gradient of the whole sequence is summed, and each rank keeps its own shard of the sum)."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterToSequence(torch.autograd.Function):
    """SP's g: reduce-scatter the partial sums forward (sum and split by sequence in one step);
    backward all-gather (every rank's partial sum needs the gradient of the whole sequence)."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, dim=1), None


class GatherFromVocab(torch.autograd.Function):
    """Without --loss_parallel: all-gather the (B, S, V/T) logit slices into (B, S, V); backward
    keeps this rank's slice of the gradient (every rank computes the same full loss)."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        return _all_gather(x, group, dim=-1)  # B*S*V/T floats from each rank

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), dim=-1)[ctx.rank], None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from (N, V/T) logit slices. loss = log(sum_v exp(z_v - m)) - (z_t - m),
    with m the global max: three all-reduces of N numbers (max, sum of exp, target logit, which
    lives on one rank only). Backward needs no communication: d loss / d z = softmax - onehot(t)."""
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # N floats: the global max, for stability
        exp = (logits - m.unsqueeze(-1)).exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)  # N floats: sum of exp over the whole vocabulary
        local = targets - vocab_start
        mine = (local >= 0) & (local < logits.size(-1))  # targets whose logit this rank owns
        local = local.clamp(0, logits.size(-1) - 1)
        target_logit = torch.where(mine, logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) - m, 0.0)
        dist.all_reduce(target_logit, group=group)  # N floats: each token's target logit, from its owner
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -mine.float().unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


# ---- the strategy: the model, built from shards ------------------------------------------

def shard_dim(name):
    """The dimension along which parameter `name` of GPT is split over the TP group, or None."""
    if name.endswith(("wte.weight", "lm_head.weight", "c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias")):
        return 0  # vocabulary rows; column-parallel output features (and their biases)
    if name.endswith("c_proj.weight"):
        return 1  # row-parallel: input features
    return None   # replicated: LayerNorms, wpe, row-parallel biases (added once, after the sum)


def shard(name, full, rank, T):
    """Rank `rank`'s slice of the full tensor `name`. c_attn fuses [q; k; v] along its outputs: the
    rank takes the same heads of each, so its slice is [q_r; k_r; v_r] (3C/T outputs)."""
    dim = shard_dim(name)
    if dim is None:
        return full
    if "c_attn" in name:
        return full.unflatten(0, (3, -1)).chunk(T, dim=1)[rank].flatten(0, 1)
    return full.chunk(T, dim=dim)[rank]


def unshard(name, shards):
    """The inverse of shard(): the full tensor from the T slices, in rank order."""
    dim = shard_dim(name)
    if dim is None:
        return shards[0]
    if "c_attn" in name:
        return torch.cat([s.unflatten(0, (3, -1)) for s in shards], dim=1).flatten(0, 1)
    return torch.cat(shards, dim=dim)


class TP:
    """The tensor-parallel group: size T, this rank's place in it, and whether SP is on."""
    def __init__(self, group, sequence_parallel):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.sp = sequence_parallel


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: this rank's out_features/T outputs. The input is the whole activation:
    f (or, with SP, the all-gather of the sequence shards) in front of the matmul."""
    def __init__(self, tp, in_features, out_features, bias):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp.size)) if bias else None

    def forward(self, x):
        x = GatherFromSequence.apply(x, self.tp.group) if self.tp.sp else CopyToTP.apply(x, self.tp.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: each rank multiplies its in_features/T slice, g sums (or, with SP,
    reduce-scatters by sequence), and the replicated bias is added once, after the sum."""
    def __init__(self, tp, in_features, out_features, bias):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x):
        y = F.linear(x, self.weight)
        y = ReduceScatterToSequence.apply(y, self.tp.group) if self.tp.sp else ReduceFromTP.apply(y, self.tp.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rank r owns vocabulary rows [r*V/T, (r+1)*V/T): it looks up the ids it owns, zeroes the
    others, and the sum over ranks (g, or a reduce-scatter by sequence with SP) is the lookup."""
    def __init__(self, tp, vocab_size, n_embd):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(vocab_size // tp.size, n_embd))
        self.vocab_start = tp.rank * (vocab_size // tp.size)

    def forward(self, idx):
        local = idx - self.vocab_start
        mine = (local >= 0) & (local < self.weight.size(0))
        x = F.embedding(local.clamp(0, self.weight.size(0) - 1), self.weight) * mine.unsqueeze(-1)
        return ReduceScatterToSequence.apply(x, self.tp.group) if self.tp.sp else ReduceFromTP.apply(x, self.tp.group)


class TPAttention(nn.Module):
    def __init__(self, tp, config):
        super().__init__()
        self.c_attn = ColumnParallelLinear(tp, config.n_embd, 3 * config.n_embd, config.bias)
        self.c_proj = RowParallelLinear(tp, config.n_embd, config.n_embd, config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout = config.n_head // tp.size, config.dropout  # this rank's heads

    def forward(self, x):  # also the forward of torch's c_attn (ColwiseParallel) in the pytorch path
        qkv = self.c_attn(x)  # (B, S, 3C/T) = [q_r, k_r, v_r]: this rank's heads, whole
        B, S, _ = qkv.shape
        q, k, v = (t.view(B, S, self.n_head, -1).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, S, -1)))


class TPMLP(nn.Module):
    def __init__(self, tp, config):
        super().__init__()
        self.c_fc = ColumnParallelLinear(tp, config.n_embd, 4 * config.n_embd, config.bias)
        self.c_proj = RowParallelLinear(tp, 4 * config.n_embd, config.n_embd, config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class TPBlock(nn.Module):
    def __init__(self, tp, config):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(config.n_embd, config.bias), TPAttention(tp, config)
        self.ln_2, self.mlp = LayerNorm(config.n_embd, config.bias), TPMLP(tp, config)

    def forward(self, x):  # x: (B, S, C), or with SP this rank's (B, S/T, C) sequence shard
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TPGPT(nn.Module):
    """GPT's parameter names, each holding this rank's shard of init_tensor's value (or of `state`, a full
    GPT state_dict); lm_head is the vocabulary-parallel wte. forward returns the mean loss (or logits)."""
    def __init__(self, tp, config, seed, device, loss_parallel=True, state=None):
        super().__init__()
        self.tp, self.config, self.loss_parallel = tp, config, loss_parallel
        self.transformer = nn.ModuleDict(dict(
            wte=VocabParallelEmbedding(tp, config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([TPBlock(tp, config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, config.bias)))
        full_shapes = {n: p.shape for n, p in GPT(config, device="meta").named_parameters()}
        with torch.no_grad():
            for name, p in self.named_parameters():
                full = state[name] if state is not None else init_tensor(name, full_shapes[name], config, seed)
                p.copy_(shard(name, full, tp.rank, tp.size))
        self.to(device)
        # replicated parameters used on sequence shards get partial gradients with SP
        self.sequence_parallel_params = [p for n, p in self.named_parameters() if shard_dim(n) is None] if tp.sp else []

    def forward(self, idx, targets=None):
        B, S = idx.shape
        x = self.transformer.wte(idx)
        pos = torch.arange(S, device=idx.device)
        if self.tp.sp:  # this rank's positions [r*S/T, (r+1)*S/T)
            pos = pos.chunk(self.tp.size)[self.tp.rank]
        x = self.transformer.drop(x + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        x = GatherFromSequence.apply(x, self.tp.group) if self.tp.sp else CopyToTP.apply(x, self.tp.group)
        logits = F.linear(x, self.transformer.wte.weight)  # lm_head tied to wte: (B, S, V/T)
        if targets is None:
            return logits
        if self.loss_parallel:
            return VocabParallelCrossEntropy.apply(logits.view(B * S, -1), targets.view(-1),
                                                   self.transformer.wte.vocab_start, self.tp.group).mean()
        logits = GatherFromVocab.apply(logits, self.tp.group)
        return F.cross_entropy(logits.view(B * S, -1).float(), targets.view(-1))


# ---- the PyTorch-native equivalent: DTensor's parallelize_module on the unchanged GPT -------

def rank_ordered(name, full, T):
    """ColwiseParallel splits outputs in T contiguous chunks, so c_attn's rows are put in rank order
    [q_0; k_0; v_0; q_1; ...] (the custom shards stacked): whole heads per chunk. unshard() undoes it."""
    return torch.cat([shard(name, full, r, T) for r in range(T)]) if "c_attn" in name else full


def parallelize_torch(model, tp_mesh, sequence_parallel, loss_parallel):
    """c_attn rank-ordered (above); attention runs TPAttention.forward on the local heads."""
    T = tp_mesh.size()
    seq = Shard(1) if sequence_parallel else Replicate()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "c_attn" in name:
                p.copy_(rank_ordered(name, p, T))
        for block in model.transformer.h:
            block.attn.n_head //= T
            block.attn.forward = types.MethodType(TPAttention.forward, block.attn)
    plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "transformer.ln_f": SequenceParallel() if sequence_parallel else None,
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                       use_local_output=not loss_parallel)}
    if sequence_parallel:  # wpe's output (S, C) reduce-scattered along positions: this rank's S/T rows
        plan["transformer.wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    for i in range(len(model.transformer.h)):
        b = f"transformer.h.{i}."
        plan.update({b + "attn.c_attn": ColwiseParallel(input_layouts=seq), b + "attn.c_proj": RowwiseParallel(output_layouts=seq),
                     b + "mlp.c_fc": ColwiseParallel(input_layouts=seq), b + "mlp.c_proj": RowwiseParallel(output_layouts=seq)})
        if sequence_parallel:
            plan.update({b + "ln_1": SequenceParallel(), b + "ln_2": SequenceParallel()})
    parallelize_module(model, tp_mesh, {k: v for k, v in plan.items() if v is not None})
    model.tie_weights()  # parallelize_module gives wte and lm_head separate DTensor Parameters
    return model


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def local_piece(name, p, full, tp_rank, T):
    """A new tensor laid out like parameter `p`: this rank's piece of the full tensor `name`. DTensor:
    each rank cuts its shard from its own full copy (src_data_rank=None: no communication)."""
    if isinstance(p, DTensor):
        full = rank_ordered(name, full, T).to(local(p).device, copy=True)
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    return torch.empty_like(p).copy_(shard(name, full, tp_rank, T))


def all_reduce_grads(params, group, op=dist.ReduceOp.SUM):
    """One flat all-reduce of these parameters' (local) gradients over `group`, numel*4 bytes. SP: sums the
    replicated ones, each TP rank's from its sequence shard only; pytorch 2D: averages over DP."""
    grads = [local(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=op, group=group)
    for g, f in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(f.view_as(g))


def global_grad_norm(params, sharded, tp_group):
    """The pinned norm: sharded gradients' squares summed over the TP group (one 4-byte all-reduce),
    replicated ones (equal on every TP rank) counted once. Gradients are equal over the DP group
    after its all-reduce, so no DP communication is needed."""
    sharded_ids = {id(p) for p in sharded}
    sq = [(local(p.grad).float() ** 2).sum() for p in params]
    sharded_sq = sum((s for p, s in zip(params, sq) if id(p) in sharded_ids), torch.zeros((), device=sq[0].device))
    dist.all_reduce(sharded_sq, group=tp_group)
    return (sharded_sq + sum(s for p, s in zip(params, sq) if id(p) not in sharded_ids)).sqrt()


def add_tp_flags(group):
    group.add_argument("--tensor_parallel_size", type=int, default=None, help="T (default: world size / D)")
    group.add_argument("--data_parallel_size", type=int, default=None, help="D (default: world size / T, else 1)")
    add_bool(group, "--sequence_parallel", False, "split LayerNorm/dropout/residual activations by sequence")
    add_bool(group, "--loss_parallel", True, "vocab-parallel cross-entropy; false: gather the logits")
    group.add_argument("--bucket_cap_mb", type=float, default=25.0, help="DP gradient bucket size (MiB)")


def check_tp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns (T, D)."""
    T, D = args.tensor_parallel_size, args.data_parallel_size
    for flag, v in (("--tensor_parallel_size", T), ("--data_parallel_size", D)):
        if v is not None and v <= 0:
            die(f"{flag}: must be > 0, got {v}")
    T = T or world_size // (D or 1)
    D = D or world_size // max(T, 1)
    for flag, value in (("--n_head", args.n_head), ("--n_embd", args.n_embd), ("--n_embd", 4 * args.n_embd),
                        ("--vocab_size", args.vocab_size)):
        if T and value % T:
            die(f"{flag}: {value} must be divisible by --tensor_parallel_size ({T})")
    if T and args.sequence_parallel and args.block_size % T:
        die(f"--block_size: sequence length {args.block_size} must be divisible by --tensor_parallel_size ({T}) "
            f"with --sequence_parallel")
    if T * D != world_size or T == 0:
        die(f"--tensor_parallel_size: T ({T}) x --data_parallel_size D ({D}) must equal the world size ({world_size})")
    if args.bucket_cap_mb <= 0:
        die(f"--bucket_cap_mb: must be > 0, got {args.bucket_cap_mb}")
    check_batch_split(args, D)
    return T, D


# ---- setup -------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("tp", add_tp_flags, argv)
    T, D = check_tp_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint from any script and world size: re-sharded below
    resumed_rng = torch.get_rng_state()  # resume() set it; building the model may draw from it
    config = gpt_config(args)
    B, S, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank, rows, micro = rank // T, B // D, B // D // A  # rows per DP rank, and per micro-step
    my_rows = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this DP rank's rows of each global batch
    # The D x T rank grid: row d is a TP group (consecutive ranks: one node's fast links), column t a DP group.
    grid = torch.arange(world_size).view(D, T)
    if args.implementation == "custom":  # a new_group per row and per column, created by every rank
        tp_group, _ = dist.new_subgroups_by_enumeration(grid.tolist())
        dp_group, _ = dist.new_subgroups_by_enumeration(grid.t().tolist())
        tp = TP(tp_group, args.sequence_parallel)
        model = TPGPT(tp, config, args.seed, device, args.loss_parallel, state=ckpt and ckpt["model"])
        sharded = [p for n, p in model.named_parameters() if shard_dim(n) is not None]
        buckets = GradientBuckets(model, args.bucket_cap_mb, group=dp_group) if D > 1 else None
    else:
        mesh = init_device_mesh(device.type, (D, T), mesh_dim_names=("dp", "tp"))
        tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
        model = GPT(config, seed=args.seed, device=device)
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
        model = parallelize_torch(model, mesh["tp"], args.sequence_parallel, args.loss_parallel)
        sharded = [p for p in model.parameters() if isinstance(p, DTensor) and any(x.is_shard() for x in p.placements)]
        buckets = None
    named = list(model.named_parameters())
    params = [p for _, p in named]
    optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, (args.beta1, args.beta2))
    # Dropout: without SP the TP ranks draw the same masks (replicated activations); with SP, each its own.
    torch.manual_seed(args.seed + 1000 * dp_rank + (rank % T if args.sequence_parallel else 0))  # CPU and CUDA
    start = ckpt["step"] if ckpt else 0
    if ckpt is not None:
        for name, p in named:
            set_adamw_state(optimizer, p, ckpt["optimizer"][name], lambda t: local_piece(name, p, t, rank % T, T))
        # resume()'s RNG state goes on; without SP, TP rank 0's (another layout's checkpoint has one per rank)
        rng = resumed_rng.to(device)
        if not args.sequence_parallel:
            dist.broadcast(rng, group=tp_group, group_src=0)  # 5 KB
        torch.set_rng_state(rng.cpu())
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start)
    loss_context = loss_parallel if args.implementation == "pytorch" and args.loss_parallel else nullcontext
    if rank == 0:
        print(f"tp ({args.implementation}): {world_size} rank(s) on {device} as DP {D} x TP {T}, grid (row = TP group):\n"
              f"{grid.tolist()}\nsequence_parallel {args.sequence_parallel}, loss_parallel {args.loss_parallel}, "
              f"{sum(local(p).numel() for p in params) / 1e6:.2f}M params on rank 0, global batch {B} x {S} tokens, "
              f"{A} micro-step(s) of {micro} rows per DP rank", flush=True)

    def forward_loss(x, y):
        with autocast(args, device):
            out = model(x, y)
        return out[1] if isinstance(out, tuple) else out

    @torch.no_grad()
    def evaluate():
        """Mean loss over eval_iters fixed batches per split; each DP rank evaluates its rows."""
        model.eval()
        out = {}
        for split in ("train", "val"):
            total = torch.zeros((), device=device)
            for k in range(args.eval_iters):
                x, y = get_batch(split, k, B, S, args.seed + 1, args.dataset)
                with loss_context():
                    total += local(forward_loss(x[my_rows].to(device), y[my_rows].to(device))).float()
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=dp_group)
            out[split] = total.item() / args.eval_iters
        model.train()
        return out

    activations = SavedActivations()  # bytes saved for backward by one micro-step: SP shrinks them
    # ---- training loop -------------------------------------------------------------------
    for step in range(start, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            metrics.eval(step, evaluate())
        t0 = time.perf_counter()
        lr = get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch("train", step, B, S, args.seed, args.dataset)
        x, y = x[my_rows].to(device), y[my_rows].to(device)
        loss_sum = torch.zeros((), device=device)
        for j in range(A):
            if buckets is not None:
                buckets.require_sync = j == A - 1  # DP all-reduce only on the last micro-step
            saved = activations if step == start and j == 0 else nullcontext()  # measured once
            with loss_context(), saved:  # torch's loss_parallel() must cover forward and backward
                loss = forward_loss(x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro])
                (loss / A).backward()
            if buckets is not None:
                buckets.finish_backward()
            loss_sum += local(loss).detach().float()
        loss_sum /= A
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=dp_group)  # equal on the TP ranks already
        if args.implementation == "custom":
            if model.sequence_parallel_params:
                all_reduce_grads(model.sequence_parallel_params, tp_group)
        else:
            # Gradients may come back in another placement than their parameter: SequenceParallel's
            # LayerNorms (and the row biases') as Partial(sum), the sharded wpe's as Replicate.
            for p in params:
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(placements=p.placements)
            if D > 1:  # DP: the mean of this rank's local gradient shards over the DP group
                all_reduce_grads(params, dp_group, op=dist.ReduceOp.AVG)
        norm = global_grad_norm(params, sharded, tp_group)
        if args.grad_clip > 0:
            clip = (args.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            for p in params:
                local(p.grad).mul_(clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=buckets is None)  # buckets: zero in place, grads stay views
        if device.type == "cuda":
            torch.cuda.synchronize()
        metrics.step(step, loss_sum.item(), lr, norm.item(), B * S, time.perf_counter() - t0, device, args.log_interval)
        if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0:
            checkpoint(named, optimizer, step + 1, config, args, tp_group)

    if args.eval_interval:
        metrics.eval(args.max_iters, evaluate())
    checkpoint(named, optimizer, args.max_iters, config, args, tp_group)
    # params + grads + AdamW state held by this rank (its shards, and the replicated tensors)
    state_bytes = (2 * tensor_bytes(local(p) for p in params)  # params and their grads (freed by zero_grad here)
                   + tensor_bytes(local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)))
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, (state_bytes, peak_mem_bytes(device), activations.bytes))
    metrics.summary([r[0] for r in per_rank], [r[1] for r in per_rank],
                    saved_activation_bytes_per_rank=[r[2] for r in per_rank])
    metrics.close()


def checkpoint(named, optimizer, step, config, args, tp_group):
    """Collective: the TP ranks all-gather the shards; rank 0 hands the full format to save_checkpoint."""
    T = dist.get_world_size(tp_group)

    def full(name, t):
        if isinstance(t, DTensor):  # full_tensor() all-gathers; c_attn's rank-ordered rows are put back
            t = t.full_tensor()
            t = unshard(name, list(t.chunk(T))) if "c_attn" in name else t
        elif shard_dim(name) is not None:
            t = unshard(name, list(_all_gather(t, tp_group, dim=0).chunk(T)))
        return t.cpu()
    state = {name: full(name, p.detach()) for name, p in named}
    opt = {name: {k: full(name, v) if torch.is_tensor(v) and v.dim() else v for k, v in optimizer.state[p].items()}
           for name, p in named if p in optimizer.state}
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied; GPT's state_dict order, lm_head last
    save_checkpoint(state, opt, step, config, args)


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
