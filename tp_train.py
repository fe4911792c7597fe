"""TP: Megatron tensor parallelism (+ sequence and loss parallelism, and 2D DP x TP), written by hand.

The tp_size ranks of a tensor-parallel group split every matmul instead of the batch. In each block
the first linear is column-parallel (rank r owns its slice of the outputs: c_attn's q, k, v by whole
heads, so attention runs locally on n_head/tp_size heads; c_fc's 4C/tp_size hidden units) and the
second row-parallel (rank r owns the matching input rows and makes a partial sum). One all-reduce of
the (B, T, C) activation joins each pair: 2 per block in forward ("g" after attn.c_proj and
mlp.c_proj), 2 in backward ("f" before c_attn and c_fc), each about 2(tp_size-1)/tp_size x 4BTC bytes
sent per rank. The embedding is split by vocabulary (masked lookup + g); lm_head is tied to it, so
the logits come out split by vocabulary and --loss_parallel computes the cross-entropy from three
all-reduces of B*T numbers (max, sum of exp, target logit), never gathering the (B, T, V) logits.
  memory per rank: about 16P/tp_size bytes (fp32 param + grad + AdamW state of this rank's shards,
                   plus the small replicated LayerNorms, row-parallel biases and wpe)
--sequence_parallel: between the linears (LayerNorms, dropout, residual) the activations are split
along the sequence too, 1/tp_size of their memory: each all-reduce becomes a reduce-scatter (after
row-parallel) and an all-gather (before column-parallel), the same bytes. The replicated parameters
then get partial gradients, summed over the TP group after backward.
2D: tp_size x D (--data_parallel_size) = N ranks in a D x tp_size grid (row = TP group of consecutive
ranks, column = DP group); each DP group splits the batch and averages its gradients after backward.

Run:
  python tp_train.py                                        # single process: the reference
  torchrun --standalone --nproc_per_node=2 tp_train.py      # TP=2 (2 GPUs, or 2 CPU processes)
  torchrun --standalone --nproc_per_node=2 tp_train.py --sequence_parallel
  torchrun --standalone --nproc_per_node=4 tp_train.py --tensor_parallel_size 2 --data_parallel_size 2
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
           tp_train.py --tensor_parallel_size 8 --data_parallel_size 2   # TP inside a node, DP across
  torchrun --standalone --nproc_per_node=2 tp_train.py --implementation pytorch  # DTensor's parallelize_module
"""
import os
import time
import types
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

from common.checkpoint import checkpoint, resume, set_adamw_state
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import get_batch
from common.distributed import (all_gather_single, autocast, clip_grad_norm_, reduce_scatter_single,
                                setup, setup_data, teardown)
from common.metrics import Metrics, Profiler, activations, held_bytes, model_state_bytes
from common.model import GPT, configure_optimizer, init_tensor


# ---- the strategy: Megatron's conjugate operators, on the TP group -----------------------
# Each moves one activation (or its gradient) of B x T x C numbers; in a ring each rank sends about
# 2(tp_size-1)/tp_size of its bytes for an all-reduce, (tp_size-1)/tp_size for an all-gather or reduce-scatter.

def all_gather(x, group, dim):
    """The ranks' x concatenated in rank order along `dim`: (B, T/tp_size, C) sequence shards -> (B, T, C)."""
    tp_size = dist.get_world_size(group)
    out = x.new_empty((tp_size * x.size(0),) + x.shape[1:])  # gloo wants the ranks stacked along dim 0
    all_gather_single(out, x.contiguous(), group=group)  # x.numel() numbers from each rank
    return torch.cat(out.chunk(tp_size), dim=dim)


def reduce_scatter_seq(x, group):
    """(B, T, C) partial sums on the ranks -> (B, T/tp_size, C): this rank's sequence shard of the sum."""
    chunks = torch.cat(x.chunk(dist.get_world_size(group), dim=1))  # (tp_size*B, T/tp_size, C): shard r at rows r*B..
    out = chunks.new_empty((x.size(0),) + chunks.shape[1:])
    reduce_scatter_single(out, chunks, group=group)  # sends the others' shards, gets its own summed
    return out


class CopyToTP(torch.autograd.Function):
    """f, in front of a column-parallel matmul: identity forward; all-reduce backward (each rank's weight slice
    gives a partial input gradient). With SP: all-gather the sequence shards; reduce-scatter backward."""
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return all_gather(x, tp.group, dim=1) if tp.sp else x
    @staticmethod
    def backward(ctx, grad):
        if ctx.tp.sp:
            return reduce_scatter_seq(grad, ctx.tp.group), None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.tp.group)  # B*T*C numbers: the sum of the partial input gradients
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g, after a row-parallel matmul: all-reduce forward (the sum of the ranks' partial outputs); identity
    backward. With SP: reduce-scatter (sum and split by sequence in one step); all-gather backward."""
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        if tp.sp:
            return reduce_scatter_seq(x, tp.group)
        x = x.contiguous()
        dist.all_reduce(x, group=tp.group)  # B*T*C numbers: the sum of the tp_size partial outputs
        return x
    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.tp.group, dim=1) if ctx.tp.sp else grad, None


class GatherFromVocab(torch.autograd.Function):
    """--loss_parallel false: all-gather the (B, T, V/tp_size) logit slices forward; backward keeps my slice."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        return all_gather(x, group, dim=-1)  # B*T*V/tp_size numbers from each rank
    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), dim=-1)[ctx.rank], None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from (N, V/tp_size) logit slices. loss = log(sum_v exp(z_v - m)) - (z_t - m),
    with m the global max: three all-reduces of N numbers (max, sum of exp, target logit, which
    lives on one rank only). Backward needs no communication: d loss / d z = softmax - onehot(t)."""
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # N numbers: the global max, for stability
        exp = (logits - m.unsqueeze(-1)).exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)  # N numbers: sum of exp over the whole vocabulary
        local = targets - vocab_start
        mine = (local >= 0) & (local < logits.size(-1))  # targets whose logit this rank owns
        local = local.clamp(0, logits.size(-1) - 1)
        target_logit = torch.where(mine, logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) - m, 0.0)
        dist.all_reduce(target_logit, group=group)  # N numbers: each token's target logit, from its owner
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine)
        return sum_exp.log() - target_logit
    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -mine.float().unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def all_reduce_grads(grads, group, op=dist.ReduceOp.SUM):
    """One flat all-reduce of these gradients over `group`, numel x 4 bytes, written back in place."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=op, group=group)
    for g, f in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(f.view_as(g))


# ---- the strategy: the model, built from shards ------------------------------------------

def shard_dim(name):
    """The dimension along which parameter `name` of GPT is split over the TP group, or None."""
    if name.endswith(("wte.weight", "lm_head.weight", "c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias")):
        return 0  # vocabulary rows; column-parallel output features (and their biases)
    if name.endswith("c_proj.weight"):
        return 1  # row-parallel: input features
    return None   # replicated: LayerNorms, wpe, row-parallel biases (added once, after the sum)


def shard(name, full, rank, tp_size):
    """Rank `rank`'s slice of the full tensor `name`. c_attn fuses [q; k; v] along its outputs: the
    rank takes the same heads of each, so its slice is [q_r; k_r; v_r] (3C/tp_size outputs)."""
    dim = shard_dim(name)
    if "c_attn" in name:
        return full.unflatten(0, (3, -1)).chunk(tp_size, dim=1)[rank].flatten(0, 1)
    return full if dim is None else full.chunk(tp_size, dim=dim)[rank]


def unshard(name, shards):
    """The inverse of shard(): the full tensor from the tp_size slices, in rank order."""
    dim = shard_dim(name)
    if "c_attn" in name:
        return torch.cat([s.unflatten(0, (3, -1)) for s in shards], dim=1).flatten(0, 1)
    return shards[0] if dim is None else torch.cat(shards, dim=dim)


class TP:
    """The tensor-parallel group: its size, this rank's place in it, and whether SP is on."""
    def __init__(self, group, sequence_parallel):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.sp = sequence_parallel


# ---- the strategy: dropout's two random streams, as in Megatron -----------------------------
# Without SP the embedding and residual dropouts act on activations every TP rank holds whole: the ranks must
# drop the same units, or the copies diverge, so they draw from the shared stream, the default generators, made
# equal on the TP group (share_rng). The attention dropout on a rank's own heads, and with SP every dropout (on
# its sequence shard), draws from the rank's own stream instead (Megatron's model-parallel RNG), forked here.

def device_generator(device):  # CUDA ops draw from the GPU's generator, not the CPU's
    return torch.cuda.default_generators[device.index] if device.type == "cuda" else torch.default_generator


@contextmanager
def tp_rank_rng(tp_rank, device):
    """Seeds the device's generator with seed + tp_rank, seed drawn from the shared CPU stream (equal on the TP
    group; no device sync), and puts the shared state back on exit. The forked stream is a function of the shared
    one, so the checkpoint's default generator states restore both: no state or communication of its own."""
    seed, generator = int(torch.randint(2**62, ())), device_generator(device)
    shared = generator.get_state()
    generator.manual_seed(seed + tp_rank)
    try:
        yield
    finally:
        generator.set_state(shared)


class TPRankDropout(nn.Dropout):
    """--sequence_parallel: GPT's nn.Dropouts (embedding, residuals) act on sequence shards: the rank's own stream."""
    def __init__(self, p, tp_rank):
        super().__init__(p)
        self.tp_rank = tp_rank

    def forward(self, x):
        with tp_rank_rng(self.tp_rank, x.device) if self.training and self.p else nullcontext():
            return super().forward(x)


def fork_sequence_parallel_dropouts(model, tp_rank):
    for name, module in [(n, m) for n, m in model.named_modules() if type(m) is nn.Dropout]:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, TPRankDropout(module.p, tp_rank))


class ColumnParallelLinear(nn.Module):
    """y_r = f(x) W_r^T + b_r: this rank's out_features/tp_size outputs, from the whole input."""
    def __init__(self, tp, in_features, out_features, bias):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp.size)) if bias else None

    def forward(self, x):
        return F.linear(CopyToTP.apply(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = g(x_r W_r^T) + b: this rank's in_features/tp_size slice of the matmul, summed by g; the bias added once."""
    def __init__(self, tp, in_features, out_features, bias):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x):
        y = ReduceFromTP.apply(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rank r owns vocabulary rows [r*V/tp_size, (r+1)*V/tp_size): it looks up the ids it owns, zeroes the
    others, and the sum over ranks (g) is the lookup."""
    def __init__(self, tp, vocab_size, n_embd):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(vocab_size // tp.size, n_embd))
        self.vocab_start = tp.rank * (vocab_size // tp.size)

    def forward(self, idx):
        local = idx - self.vocab_start
        mine = (local >= 0) & (local < self.weight.size(0))
        x = F.embedding(local.clamp(0, self.weight.size(0) - 1), self.weight) * mine.unsqueeze(-1)
        return ReduceFromTP.apply(x, self.tp)


class TPAttention(nn.Module):
    def __init__(self, tp, config):
        super().__init__()
        self.c_attn = ColumnParallelLinear(tp, config.n_embd, 3 * config.n_embd, config.bias)
        self.c_proj = RowParallelLinear(tp, config.n_embd, config.n_embd, config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout, self.tp_rank = config.n_head // tp.size, config.dropout, tp.rank  # this rank's heads

    def forward(self, x):  # also the forward of torch's c_attn (ColwiseParallel) in TorchTP
        qkv = self.c_attn(x)  # (B, T, 3C/tp_size) = [q_r, k_r, v_r]: this rank's heads, whole
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        p = self.dropout if self.training else 0.0
        with tp_rank_rng(self.tp_rank, x.device) if p else nullcontext():  # this rank's heads: its own masks
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


class TPGPT(GPT):
    """common/model.py's GPT with wte, attention and MLP linears swapped for the parallel ones (the same
    parameter names), each holding this rank's shard of init_tensor's value, or of `state` (a full
    GPT state_dict). lm_head is the vocabulary-parallel wte. forward returns (logits slice, loss)."""
    def __init__(self, tp, config, seed, device, loss_parallel=True, state=None):
        super().__init__(config, device="meta")
        self.tp, self.loss_parallel = tp, loss_parallel
        full_shapes = {n: p.shape for n, p in self.named_parameters()}
        with torch.device("meta"):
            self.transformer.wte = VocabParallelEmbedding(tp, config.vocab_size, config.n_embd)
            for block in self.transformer.h:
                block.attn = TPAttention(tp, config)
                block.mlp.c_fc = ColumnParallelLinear(tp, config.n_embd, 4 * config.n_embd, config.bias)
                block.mlp.c_proj = RowParallelLinear(tp, 4 * config.n_embd, config.n_embd, config.bias)
        del self.lm_head
        self.to_empty(device=device)
        with torch.no_grad():  # deferred init: one full tensor at a time, keeping this rank's slice
            for name, p in self.named_parameters():
                full = state[name] if state is not None else init_tensor(name, full_shapes[name], config, seed)
                p.copy_(shard(name, full, tp.rank, tp.size))
        if tp.sp:
            fork_sequence_parallel_dropouts(self, tp.rank)
        # replicated parameters used on sequence shards get partial gradients with SP
        self.sequence_parallel_params = [p for n, p in self.named_parameters() if shard_dim(n) is None] if tp.sp else []

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        if self.tp.sp:  # this rank's positions [r*T/tp_size, (r+1)*T/tp_size)
            pos = pos.chunk(self.tp.size)[self.tp.rank]
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        x = CopyToTP.apply(x, self.tp)
        logits = F.linear(x, self.transformer.wte.weight)  # lm_head tied to wte: (B, T, V/tp_size)
        if targets is None:
            return logits, None
        if self.loss_parallel:
            return logits, VocabParallelCrossEntropy.apply(logits.view(B * T, -1), targets.view(-1),
                                                           self.transformer.wte.vocab_start, self.tp.group).mean()
        logits = GatherFromVocab.apply(logits, self.tp.group)
        return logits, F.cross_entropy(logits.view(B * T, -1).float(), targets.view(-1))


class TensorParallel:
    """The strategy behind the few methods the training loop calls: TPGPT's shards on the TP group (a
    row of the D x tp_size grid), its gradients averaged over the DP group (a column)."""

    def __init__(self, config, args, device, state=None):
        self.args, self.device, self.tp_size = args, device, args.tensor_parallel_size
        # The D x tp_size grid: row d a TP group (consecutive ranks: one node's fast links), column a DP group.
        self.grid = torch.arange(dist.get_world_size()).view(-1, self.tp_size)
        self.tp_group, _ = dist.new_subgroups_by_enumeration(self.grid.tolist())  # every rank creates every group
        self.dp_group, _ = dist.new_subgroups_by_enumeration(self.grid.t().tolist())
        self.share_rng(resumed=state is not None)
        self.model = TPGPT(TP(self.tp_group, args.sequence_parallel), config, args.seed, device, args.loss_parallel,
                           state)

    def share_rng(self, resumed):
        """Makes dropout's shared stream, the default generators (CPU, and the device's), equal on the TP
        group's ranks and different across DP replicas. Fresh: seeded by DP rank (setup() seeded by global
        rank). Resumed: resume() restored each rank's states; TP rank 0's go to the others, as a checkpoint of
        another world size or script holds unequal ones (of this layout: equal already). Once, not per step."""
        for generator in dict.fromkeys([torch.default_generator, device_generator(self.device)]):  # in order
            if resumed:
                state = generator.get_state().to(self.device)  # nccl sends device tensors
                dist.broadcast(state, group=self.tp_group, group_src=0)  # 5 KB (the CPU state), 16 B (CUDA's)
                generator.set_state(state.cpu())
            else:
                generator.manual_seed(self.args.seed + dist.get_rank(self.dp_group))

    def configure_optimizer(self, args, state=None):
        optimizer = configure_optimizer(self.model.named_parameters(), args.weight_decay, args.learning_rate,
                                        (args.beta1, args.beta2))
        for name, p in self.model.named_parameters() if state else ():
            set_adamw_state(optimizer, p, state[name], lambda t: self.local_piece(name, p, t))
        return optimizer

    def local_piece(self, name, p, full):
        """A new tensor laid out like parameter `p`: this rank's piece of the full tensor `name`."""
        return torch.empty_like(p).copy_(shard(name, full, dist.get_rank(self.tp_group), self.tp_size))

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its loss. sync=False: accumulate only."""
        with activations.first():  # the bytes autograd saves for backward, once: SP shrinks them
            with autocast(self.args, self.device):
                _, loss = self.model(x, y)
            (loss / self.args.grad_accum_steps).backward()  # each micro-step is 1/A of this rank's rows
        if sync and len(self.grid) > 1:
            # DP: the mean over the DP group of this rank's local gradients, one flat all-reduce of about
            # 4P/tp_size bytes after backward (Megatron's default; ddp_train.py shows how to overlap it with backward)
            all_reduce_grads([p.grad for p in self.model.parameters()], self.dp_group, op=dist.ReduceOp.AVG)
        if sync and self.model.sequence_parallel_params:  # each TP rank's from its sequence shard only: sum them
            all_reduce_grads([p.grad for p in self.model.sequence_parallel_params], self.tp_group)
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # Sharded gradients' squares are summed over the TP group, the replicated ones (equal on every TP
        # rank) counted once. Over the DP group the gradients are equal already: no DP communication.
        named = list(self.model.named_parameters())
        return clip_grad_norm_([p.grad for n, p in named if shard_dim(n) is not None],
                               [p.grad for n, p in named if shard_dim(n) is None], max_norm, self.tp_group)

    def full_state(self, optimizer):
        """Collective: every tensor gathered from the TP group, in the full format (on every rank)."""
        named = list(self.model.named_parameters())
        model = {name: self.full_tensor(name, p.detach()) for name, p in named}
        model["lm_head.weight"] = model["transformer.wte.weight"]  # tied; GPT's state_dict order, lm_head last
        return model, {name: {k: self.full_tensor(name, v) if torch.is_tensor(v) and v.dim() else v
                              for k, v in optimizer.state[p].items()} for name, p in named if p in optimizer.state}

    def full_tensor(self, name, t):
        if shard_dim(name) is not None:  # every rank sends its shard to every other (tp_size-1 shards in)
            t = unshard(name, list(all_gather(t, self.tp_group, dim=0).chunk(self.tp_size)))
        return t.cpu()

    def describe(self):
        return (f"DP {len(self.grid)} x TP {self.tp_size} grid {self.grid.tolist()} (row = TP group), "
                f"sequence_parallel {self.args.sequence_parallel}, loss_parallel {self.args.loss_parallel}, "
                f"{held_bytes(self.model.parameters()) / 2**20:.2f} MiB of parameters per rank")


def add_tp_flags(group):
    group.add_argument("--tensor_parallel_size", type=int, default=None, help="tp_size (default: world size / D)")
    group.add_argument("--data_parallel_size", type=int, default=None, help="D (default: world size / tp_size, else 1)")
    add_bool(group, "--sequence_parallel", False, "split LayerNorm/dropout/residual activations by sequence")
    add_bool(group, "--loss_parallel", True, "vocab-parallel cross-entropy; false: gather the logits")


def check_tp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Fills in both sizes of the
    D x tp_size grid (args.tensor_parallel_size, args.data_parallel_size) and returns D."""
    tp_size, D = args.tensor_parallel_size, args.data_parallel_size
    for flag, v in (("--tensor_parallel_size", tp_size), ("--data_parallel_size", D)):
        if v is not None and v <= 0:
            die(f"{flag}: must be > 0, got {v}")
    tp_size = tp_size or world_size // (D or 1)
    D = D or world_size // max(tp_size, 1)
    for flag, value in (("--n_head", args.n_head), ("--n_embd", args.n_embd), ("--n_embd", 4 * args.n_embd),
                        ("--vocab_size", args.vocab_size)):
        if tp_size and value % tp_size:
            die(f"{flag}: {value} must be divisible by --tensor_parallel_size ({tp_size})")
    if tp_size and args.sequence_parallel and args.block_size % tp_size:
        die(f"--block_size: sequence length {args.block_size} must be divisible by --tensor_parallel_size "
            f"({tp_size}) with --sequence_parallel")
    if tp_size * D != world_size or tp_size == 0:
        die(f"--tensor_parallel_size: {tp_size} x --data_parallel_size {D} must equal the world size ({world_size})")
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
    dp_rank, rows, micro = rank * D // world_size, B // D, B // D // A  # rows per DP rank; per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    model = (TensorParallel if args.implementation == "custom" else TorchTP)(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start)
    if rank == 0:
        print(f"tp ({args.implementation}): {world_size} rank(s) on {device}, {model.describe()}; global batch "
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


# ---- PyTorch's own TP (DTensor), behind the same methods ---------------------------------

def rank_ordered(name, full, tp_size):
    """ColwiseParallel splits outputs in tp_size contiguous chunks, so c_attn's rows are put in rank order
    [q_0; k_0; v_0; q_1; ...] (the custom shards stacked): whole heads per chunk. unshard() undoes it."""
    return torch.cat([shard(name, full, r, tp_size) for r in range(tp_size)]) if "c_attn" in name else full


def parallelize_torch(model, tp_mesh, sequence_parallel, loss_parallel):
    """The unchanged GPT made tensor-parallel in place: c_attn rank-ordered (above), attention running
    TPAttention.forward on the local heads, every linear and embedding placed by a DTensor plan."""
    tp_size, seq = tp_mesh.size(), Shard(1) if sequence_parallel else Replicate()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "c_attn" in name:
                p.copy_(rank_ordered(name, p, tp_size))
    for block in model.transformer.h:
        block.attn.n_head, block.attn.tp_rank = block.attn.n_head // tp_size, tp_mesh.get_local_rank()
        block.attn.forward = types.MethodType(TPAttention.forward, block.attn)
    col, row = ColwiseParallel(input_layouts=seq), RowwiseParallel(output_layouts=seq)
    plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                       use_local_output=not loss_parallel)}
    for i in range(len(model.transformer.h)):
        b = f"transformer.h.{i}."
        plan.update({b + "attn.c_attn": col, b + "attn.c_proj": row, b + "mlp.c_fc": col, b + "mlp.c_proj": row})
    if sequence_parallel:  # LayerNorms and dropouts on sequence shards; wpe's output reduce-scattered by position
        plan.update({name: SequenceParallel() for name, _ in model.named_modules() if ".ln_" in name})
        plan["transformer.wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        fork_sequence_parallel_dropouts(model, tp_mesh.get_local_rank())
    parallelize_module(model, tp_mesh, plan)
    model.tie_weights()  # parallelize_module gives wte and lm_head separate DTensor Parameters
    # AdamW's multi-tensor paths (foreach, its default on CUDA, and fused) update all parameters in
    # one call, which refuses a mix of DTensor and Tensor. So, as torchtitan does, the modules the
    # plan leaves alone (without SP: the LayerNorms and wpe) get Replicate DTensor parameters too:
    # distribute_module replicates them (each rank keeps its own equal copy: no communication),
    # their input becomes a Replicate DTensor and their output local again. The arithmetic is
    # unchanged, and their gradients come back Replicate: the full gradient on every TP rank, as the
    # plain tensors' did.
    for module in model.modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, input_fn=replicated_input, output_fn=local_output)


def replicated_input(module, inputs, mesh):
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def local_output(module, output, mesh):
    return output.to_local()


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class TorchTP(TensorParallel):
    """torch.distributed.tensor.parallel: GPT's parameters become DTensors on the TP mesh (the same
    column/row/vocabulary split, SequenceParallel LayerNorms), torch's loss_parallel() computes the
    vocab-parallel cross-entropy; the DP group averages the local gradients with one all-reduce."""

    def __init__(self, config, args, device, state=None):
        self.args, self.device, self.tp_size = args, device, args.tensor_parallel_size
        self.grid = torch.arange(dist.get_world_size()).view(-1, self.tp_size)
        mesh = init_device_mesh(device.type, tuple(self.grid.shape), mesh_dim_names=("dp", "tp"))
        self.tp_group, self.dp_group = mesh.get_group("tp"), mesh.get_group("dp")
        self.share_rng(resumed=state is not None)
        self.model = GPT(config, seed=args.seed, device=device)
        if state is not None:
            self.model.load_state_dict(state)
        parallelize_torch(self.model, mesh["tp"], args.sequence_parallel, args.loss_parallel)

    def local_piece(self, name, p, full):
        """DTensor: each rank cuts its piece from its own full copy (src_data_rank=None: no communication)."""
        if not isinstance(p, DTensor):
            return torch.empty_like(p).copy_(full)
        full = rank_ordered(name, full, self.tp_size).to(self.device, copy=True)
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)

    def forward_backward(self, x, y, sync):
        with activations.first(), loss_parallel() if self.args.loss_parallel else nullcontext():
            with autocast(self.args, self.device):  # torch's loss_parallel() covers forward and backward
                _, loss = self.model(x, y)
            (loss / self.args.grad_accum_steps).backward()
        if sync:
            # Gradients may come back in another placement than their parameter: SequenceParallel's
            # LayerNorms (and the row biases') as Partial(sum), the sharded wpe's as Replicate.
            params = list(self.model.parameters())
            for p in params:
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(placements=p.placements)
            if len(self.grid) > 1:  # DP: the mean of this rank's local gradients over the DP group
                all_reduce_grads([local(p.grad) for p in params], self.dp_group, op=dist.ReduceOp.AVG)
        return local(loss).detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with loss_parallel() if self.args.loss_parallel else nullcontext(), autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return local(loss).float()

    def clip_grad_norm_(self, max_norm):
        grads = [(local(p.grad), isinstance(p, DTensor) and any(s.is_shard() for s in p.placements))
                 for p in self.model.parameters()]
        return clip_grad_norm_([g for g, s in grads if s], [g for g, s in grads if not s], max_norm, self.tp_group)

    def full_tensor(self, name, t):
        if isinstance(t, DTensor):  # full_tensor() all-gathers; c_attn's rank-ordered rows are put back
            t = t.full_tensor()
            t = unshard(name, list(t.chunk(self.tp_size))) if "c_attn" in name else t
        return t.cpu()


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
