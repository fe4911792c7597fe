"""CP: context parallelism (all-gather K/V, ring attention with zigzag balancing, Ulysses), written by hand.

The cp ranks of a context-parallel group split the sequence: each holds T/cp positions of every row, in
every layer. LayerNorm, MLP, the embeddings (at each token's true position) and the loss are token-wise
and need nothing from the other ranks; only attention does, as a query attends to every earlier key.
Parameters are replicated, their gradients averaged over all N = D x cp ranks as in ddp_train.py.
Per layer per rank, B rows of the micro-step, C = n_embd, fp32 (4 bytes a number; bf16 K/V: 2):
  allgather  all-gather K,V: sends (cp-1) x 2BTC/cp numbers; backward all-gathers them again (it saves only
             its own) and reduce-scatters dK,dV: 2 x (cp-1) x 2BTC/cp. Peak: the whole 2BTC of K,V at once.
  ring       K,V blocks of 2BTC/cp go round the ring, cp-1 sends, each while the previous block is computed;
             backward: K,V again and the dK,dV accumulators, 2 x (cp-1) x 2BTC/cp. Peak: 2 blocks.
  ulysses    all-to-all q,k,v from sequence shards to head shards (full sequence, n_head/cp heads) and the
             output back: (cp-1)/cp x (3BTC/cp + BTC/cp) numbers; the same in backward. Volume falls as 1/cp.
  activation memory per rank: every saved tensor is 1/cp of one process's (attention saves q, k, v, out and
  the log-sum-exp of its T/cp queries, or with ulysses of its n_head/cp heads); scores are never saved.
Causal balance: with a contiguous split rank r's queries see r+1 of the cp key blocks, so the last rank
does 2cp-1 times the first rank's work. Zigzag (--load_balance, default): 2cp chunks, rank r holds chunks
r and 2cp-1-r, an early and a late one: each keeps exactly T(T+1)/(2cp) (query, key) pairs per row and head
(contiguous, m = T/cp: r m^2 + m(m+1)/2, last/first = ((2cp-1)m + 1)/(m + 1)). Ring and allgather compute
only the kept part of each block (positions ascending: the queries that see a key block form a suffix, the
keys they see a prefix). Ulysses attends over the whole sequence on every rank: balanced by heads.
2D: D x cp ranks in a grid (row = CP group of consecutive ranks); each DP rank takes B/D rows.

Run:
  python cp_train.py                                              # single process: the reference
  torchrun --standalone --nproc_per_node=2 cp_train.py --block_size 512          # ring, zigzag
  torchrun --standalone --nproc_per_node=2 cp_train.py --cp_mode ulysses
  torchrun --standalone --nproc_per_node=4 cp_train.py --context_parallel_size 2  # DP 2 x CP 2
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
           cp_train.py --context_parallel_size 8                  # CP inside a node, DP across
  torchrun --standalone --nproc_per_node=2 cp_train.py --implementation pytorch   # CUDA only
"""
import os
import time
import weakref
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.checkpoint import checkpoint, optimizer_state_by_name, resume, set_adamw_state
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import get_batch
from common.distributed import (all_gather_single, autocast, clip_grad_norm_, reduce_scatter_single,
                                setup, setup_data, teardown, uses_cuda)
from common.metrics import Metrics, Profiler, activations, model_state_bytes, timers
from common.model import GPT, CausalSelfAttention, configure_optimizer, materialize_, num_params


# ---- the strategy: who holds which positions ---------------------------------------------

def positions(T, cp, rank, zigzag):
    """The positions CP rank `rank` holds, ascending: [rT/cp, (r+1)T/cp), or zigzag chunks r and 2cp-1-r of 2cp."""
    if not zigzag:
        return torch.arange(T).chunk(cp)[rank]
    chunks = torch.arange(T).chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def causal_window(q_pos, k_pos):
    """The part of a (query block, key block) pair that the causal mask keeps: queries from `first` on (a
    suffix: the ones after the block's first key), keys up to `keys` (a prefix: the ones before the last
    query), and the mask inside that window (True: key after query, dropped), or None when it keeps all."""
    first, keys = int((q_pos < k_pos[0]).sum()), int((k_pos <= q_pos[-1]).sum())
    mask = k_pos[None, :keys] > q_pos[first:, None]
    return first, keys, mask if mask.any() else None


class CPGroup:
    """The CP group, its ring neighbours (global ranks), every CP rank's positions, and this rank's windows."""
    def __init__(self, group, T, zigzag, device):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]
        self.positions = [positions(T, self.size, r, zigzag) for r in range(self.size)]
        self.mine = self.positions[self.rank].to(device)
        self.windows = [causal_window(self.positions[self.rank], k_pos) for k_pos in self.positions]
        self.windows = [(f, k, m if m is None else m.to(device)) for f, k, m in self.windows]


# ---- the strategy: attention over key blocks, merged by log-sum-exp ------------------------
# A block's softmax has its own normaliser; with lse = log sum_k exp(score), two partial results merge
# exactly: lse = logaddexp(lse_a, lse_b), out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse).

def block_forward(q, kv, window, out, lse, scale):
    """Attends this rank's queries to one key block and merges the result into out, lse (in place)."""
    first, keys, mask = window
    if keys == 0 or first == q.size(-2):
        return  # no kept pair: a later key block (contiguous split), nothing to compute
    with timers("attention"), torch.autocast(q.device.type, enabled=False):  # fp32 math, whatever the inputs
        s = q[..., first:, :] @ kv[0, ..., :keys, :].float().transpose(-2, -1) * scale  # scores
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        block_lse = s.logsumexp(-1, keepdim=True)
        block_out = (s - block_lse).exp() @ kv[1, ..., :keys, :].float()
        new = torch.logaddexp(lse[..., first:, :], block_lse)
        out[..., first:, :] = out[..., first:, :] * (lse[..., first:, :] - new).exp() + block_out * (block_lse - new).exp()
        lse[..., first:, :] = new


def block_backward(q, kv, window, dout, lse, delta, dq, scale):
    """Adds this key block's part of dq (in place); returns its [dK, dV]. p = exp(s - lse) with the final
    lse is the block's share of the full softmax, so dS = p (dP - rowsum(dout * out)) needs no merging."""
    first, keys, mask = window
    dkv = torch.zeros(kv.shape, device=q.device)
    if keys == 0 or first == q.size(-2):
        return dkv
    with timers("attention"), torch.autocast(q.device.type, enabled=False):
        qb, k, v, do = q[..., first:, :], kv[0, ..., :keys, :].float(), kv[1, ..., :keys, :].float(), dout[..., first:, :]
        s = qb @ k.transpose(-2, -1) * scale
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        p = (s - lse[..., first:, :]).exp()
        ds = p * (do @ v.transpose(-2, -1) - delta[..., first:, :]) * scale
        dq[..., first:, :] += ds @ k
        dkv[0, ..., :keys, :], dkv[1, ..., :keys, :] = ds.transpose(-2, -1) @ qb, p.transpose(-2, -1) @ do
    return dkv


def pass_to_next(t, cp):
    """Sends t to the next rank of the ring and receives the previous rank's into a new tensor, t.numel()
    numbers each way. Both in one batch_isend_irecv: under NCCL a send may wait for its receive, and every
    rank posting its pair together cannot deadlock."""
    received = torch.empty_like(t)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, cp.next, cp.group),
                                    dist.P2POp(dist.irecv, received, cp.prev, cp.group)])
    return received, works


def wait(works):
    with timers("exposed_comm"):  # the transfer time the compute did not hide
        for work in works:
            work.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence, K/V blocks passed round the ring."""
    @staticmethod
    def forward(ctx, q, k, v, cp):
        q32, kv = q.float(), torch.stack([k, v])  # [K; V] of this rank: 2 x B x n_head x T/cp x head_dim
        out, lse = torch.zeros_like(q32), torch.full(q.shape[:-1] + (1,), float("-inf"), device=q.device)
        for i in range(cp.size):  # step i: the block of CP rank (rank - i), the next one on the wire meanwhile
            if i < cp.size - 1:
                received, works = pass_to_next(kv, cp)
            block_forward(q32, kv, cp.windows[(cp.rank - i) % cp.size], out, lse, q.size(-1) ** -0.5)
            if i < cp.size - 1:
                wait(works)
                kv = received
        ctx.cp = cp
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, q32, dout, kv = ctx.cp, q.float(), dout.float(), torch.stack([k, v])
        delta, dq = (dout * out).sum(-1, keepdim=True), torch.zeros_like(q32)
        # The block of rank j travels as in forward; its dK,dV accumulator starts on rank j+1 and follows it,
        # each rank adding its queries' share, until rank j-1 hands it to j, who adds its own last.
        for i in range(cp.size):
            if i < cp.size - 1:
                received, works = pass_to_next(kv, cp)
            if i >= 2:
                carried_in, carried_works = pass_to_next(carried, cp)
            dkv = block_backward(q32, kv, cp.windows[(cp.rank - i) % cp.size], dout, lse, delta, dq, q.size(-1) ** -0.5)
            if i >= 2:
                wait(carried_works)
            mine, carried = (dkv, None) if i == 0 else (mine, dkv if i == 1 else carried_in + dkv)
            if i < cp.size - 1:
                wait(works)
                kv = received
        if cp.size > 1:  # the accumulator of my block, summed over the other cp-1 ranks
            carried_in, works = pass_to_next(carried, cp)
            wait(works)
            mine += carried_in
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None


class AllGatherAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the all-gathered K/V (Llama 3's context parallelism)."""
    @staticmethod
    def forward(ctx, q, k, v, cp):
        q32, kv = q.float(), all_gather_kv(k, v, cp)
        out, lse = torch.zeros_like(q32), torch.full(q.shape[:-1] + (1,), float("-inf"), device=q.device)
        for j in range(cp.size):
            block_forward(q32, kv[j], cp.windows[j], out, lse, q.size(-1) ** -0.5)
        ctx.cp = cp
        ctx.save_for_backward(q, k, v, out, lse)  # its own K,V only: backward gathers them again
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, q32, dout, kv = ctx.cp, q.float(), dout.float(), all_gather_kv(k, v, ctx.cp)
        delta, dq = (dout * out).sum(-1, keepdim=True), torch.zeros_like(q32)
        dkv = torch.stack([block_backward(q32, kv[j], cp.windows[j], dout, lse, delta, dq, q.size(-1) ** -0.5)
                           for j in range(cp.size)])
        mine = dkv.new_empty(dkv.shape[1:])
        # cp x 2BTC/cp numbers in: block j's dK,dV from every rank summed on rank j, (cp-1) blocks sent
        reduce_scatter_single(mine, dkv.flatten(0, 1), group=cp.group)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None


def all_gather_kv(k, v, cp):
    """[K; V] of every CP rank, cp x 2 x B x n_head x T/cp x head_dim: this rank's 2BTC/cp numbers to each other."""
    kv = torch.stack([k, v])
    gathered = kv.new_empty((cp.size * 2,) + kv.shape[1:])  # gloo wants the ranks' tensors stacked along dim 0
    all_gather_single(gathered, kv, group=cp.group)
    return gathered.unflatten(0, (cp.size, 2))


class AllToAll(torch.autograd.Function):
    """Ulysses' exchange: x split in cp pieces along scatter_dim, piece j to CP rank j, the pieces received
    concatenated along gather_dim; (cp-1)/cp of x leaves the rank. Backward is the exchange reversed."""
    @staticmethod
    def forward(ctx, x, cp, scatter_dim, gather_dim):
        ctx.args = cp, gather_dim, scatter_dim
        send = torch.stack(x.chunk(cp.size, dim=scatter_dim)).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=cp.group)
        return torch.cat(received.unbind(0), dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, *ctx.args), None, None, None


def ulysses_attention(q, k, v, cp, dropout_p):
    """Causal attention over the whole sequence on n_head/cp heads (contiguous split: rank order = position order)."""
    q, k, v = AllToAll.apply(torch.stack([q, k, v]), cp, 2, 3).unbind(0)  # heads scattered, sequence gathered
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # this rank's own heads
    return AllToAll.apply(y, cp, 2, 1)  # back to T/cp positions, every head


class CPAttention(CausalSelfAttention):
    """GPT's attention (the same parameters) on this rank's T/cp positions."""
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        if self.mode == "ulysses":
            y = ulysses_attention(q, k, v, self.cp, self.dropout if self.training else 0.0)
        else:  # B x n_head x T/cp x head_dim each
            y = (RingAttention if self.mode == "ring" else AllGatherAttention).apply(q, k, v, self.cp)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class CPGPT(GPT):
    """common/model.py's GPT whose forward takes each token's position (its T/cp positions are not 0..T/cp-1),
    with CPAttention in every block (cp None: GPT's own attention, for PyTorch's context_parallel)."""
    def __init__(self, config, seed, device, cp=None, mode=None):
        super().__init__(config, device="meta")
        for block in self.transformer.h if cp is not None else ():
            with torch.device("meta"):
                block.attn = CPAttention(config)
            block.attn.cp, block.attn.mode = cp, mode
        self.to_empty(device=device)
        self.tie_weights()
        materialize_(self, "", config, seed)  # the same values as GPT(config, seed): by parameter name

    def forward(self, idx, targets, pos):
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


# ---- the strategy: gradient buckets with overlapped all-reduce (as in ddp_train.py) ---------

class Bucket:
    """One flat gradient buffer; the .grad of each of its parameters is a view into it."""

    def __init__(self, params):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            view = self.buffer[offset: offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            offset += p.numel()
        self.pending, self.work = len(params), None


class GradientBuckets:
    """Averages gradients over all ranks during backward: each bucket's all-reduce starts when its last
    gradient is accumulated (ddp_train.py explains every line). require_sync = False: accumulate only."""

    def __init__(self, model, bucket_cap_mb, group=None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cap, self.group, self.require_sync = int(bucket_cap_mb * 2**20), group, True
        self.ready_order = []
        self._make_buckets(self.params[::-1])
        buckets = weakref.ref(self)  # no param -> hook -> buckets -> param cycle
        for p in self.params:
            p.register_post_accumulate_grad_hook(lambda p: buckets()._grad_ready(p))

    def _make_buckets(self, order):
        groups, current, size = [], [], 0
        for p in order:
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > self.cap:
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        self.buckets = [Bucket(g) for g in groups + [current]]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next = 0

    def _grad_ready(self, p):
        if self.ready_order is not None:
            self.ready_order.append(p)
        self.bucket_of[p].pending -= 1
        while self.require_sync and self.next < len(self.buckets) and self.buckets[self.next].pending == 0:
            self._all_reduce(self.buckets[self.next])

    def _all_reduce(self, bucket):
        # numel x 4 bytes, the mean over all N ranks: over DP (other rows) and CP (other positions) alike
        bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        self.next += 1

    def finish_backward(self):
        while self.require_sync and self.next < len(self.buckets):
            self._all_reduce(self.buckets[self.next])
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            bucket.pending = len(bucket.params)
        self.next = 0
        if self.ready_order is not None:
            self._rebuild()

    def _rebuild(self):
        """Buckets in the measured ready order, rank 0's (broadcast), so that every rank builds the same."""
        index = {p: i for i, p in enumerate(self.params)}
        seen = [index[p] for p in dict.fromkeys(self.ready_order)]
        order = torch.tensor(seen + [i for i in range(len(self.params)) if i not in set(seen)],
                             device=self.params[0].device)
        dist.broadcast(order, group=self.group, group_src=0)
        self.ready_order = None
        self._make_buckets([self.params[i] for i in order.tolist()])


class ContextParallel:
    """The strategy behind the few methods the training loop calls: CPGPT on every rank, each CP rank on its
    positions of the DP rank's rows, gradients averaged over all ranks by GradientBuckets."""
    # The ranks over which the loop averages losses: all of them. Every rank holds B/D rows x T/cp positions,
    # the same count, so the mean of their token means is the mean over all B*T tokens (train and eval).
    dp_group = None

    def __init__(self, config, args, device, state=None):
        self.args, self.device, cp_size = args, device, args.context_parallel_size
        # The D x cp grid: row d a CP group (consecutive ranks: one node's fast links) = DP rank d of main().
        self.grid = torch.arange(dist.get_world_size()).view(-1, cp_size)
        cp_group, _ = dist.new_subgroups_by_enumeration(self.grid.tolist())  # every rank creates every group
        self.cp = CPGroup(cp_group, args.block_size, args.load_balance, device)
        self.model = CPGPT(config, args.seed, device, self.cp, args.cp_mode)
        if state is not None:  # a full checkpoint from any script: every rank loads all of it
            self.model.load_state_dict(state)
        self.buckets = GradientBuckets(self.model, args.bucket_cap_mb)

    def configure_optimizer(self, args, state=None):
        optimizer = configure_optimizer(self.model.named_parameters(), args.weight_decay, args.learning_rate,
                                        (args.beta1, args.beta2))
        for name, p in self.model.named_parameters() if state else ():
            set_adamw_state(optimizer, p, state[name], lambda t: t.to(self.device, copy=True))
        return optimizer

    def forward_backward(self, x, y, sync):
        """One micro-step on this rank's positions of x, y; returns the mean loss over its tokens."""
        self.buckets.require_sync = sync
        with activations.first():
            with autocast(self.args, self.device):
                _, loss = self.model(x[:, self.cp.mine], y[:, self.cp.mine], self.cp.mine)
            (loss / self.args.grad_accum_steps).backward()
        self.buckets.finish_backward()
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x[:, self.cp.mine], y[:, self.cp.mine], self.cp.mine)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # The gradients are equal on every rank now: the global norm needs no communication.
        return clip_grad_norm_(None, [p.grad for p in self.model.parameters()], max_norm)

    def full_state(self, optimizer):
        """Every rank holds the full model, so nothing is gathered: rank 0's state is the checkpoint."""
        return self.model.state_dict(), optimizer_state_by_name(self.model.named_parameters(), optimizer)

    def describe(self):
        split = "zigzag" if self.args.load_balance else "contiguous"
        return (f"DP {len(self.grid)} x CP {self.grid.size(1)} grid {self.grid.tolist()} (row = CP group), "
                f"{self.args.cp_mode} attention, {split} split, {num_params(self.model) / 1e6:.2f}M params, "
                f"{len(self.buckets.buckets)} gradient buckets")


def add_cp_flags(group):
    group.add_argument("--cp_mode", choices=["allgather", "ring", "ulysses"], default="ring",
                       help="how attention reaches the other ranks' keys")
    group.add_argument("--context_parallel_size", type=int, default=None, help="cp (default: all ranks)")
    add_bool(group, "--load_balance", None, "zigzag split for ring/allgather (default true; ulysses: contiguous)")
    group.add_argument("--bucket_cap_mb", type=float, default=25.0, help="gradient bucket size (MiB)")


def check_cp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Fills in context_parallel_size
    and load_balance; returns D = world size / cp."""
    cp, T = args.context_parallel_size or world_size, args.block_size
    if args.implementation == "pytorch" and not uses_cuda(args):
        die("--implementation: pytorch's context_parallel needs CUDA SDPA kernels (flash/efficient/cudnn); "
            "on CPU use --implementation custom")
    if args.implementation == "pytorch" and args.cp_mode == "ulysses":
        die("--cp_mode: PyTorch's context_parallel has ring and allgather, not ulysses")
    if args.bucket_cap_mb <= 0:
        die(f"--bucket_cap_mb: must be > 0, got {args.bucket_cap_mb}")
    if cp <= 0 or world_size % cp:
        die(f"--context_parallel_size: {cp} must be > 0 and divide the world size ({world_size})")
    if args.cp_mode == "ulysses" and args.load_balance is not None:
        die("--load_balance: only for ring and allgather (ulysses attends over the whole sequence: balanced)")
    args.context_parallel_size, args.load_balance = cp, args.cp_mode != "ulysses" and args.load_balance is not False
    chunks = 2 * cp if args.load_balance else cp
    if T % chunks:
        die(f"--block_size: {T} must be divisible by {chunks} ({'2 x ' if args.load_balance else ''}"
            f"--context_parallel_size{', zigzag' if args.load_balance else ''})")
    if args.cp_mode == "ulysses" and args.n_head % cp:
        die(f"--n_head: {args.n_head} must be divisible by --context_parallel_size ({cp}) with ulysses")
    if args.dropout > 0 and args.cp_mode != "ulysses" and args.implementation == "custom":
        # dropout on attention probabilities would need each block's mask replayed in backward
        die(f"--dropout: {args.cp_mode} attention has no attention dropout; use --dropout 0 or --cp_mode ulysses")
    check_batch_split(args, world_size // cp)
    return world_size // cp


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("cp", add_cp_flags, argv)
    D = check_cp_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank, rows, micro = rank * D // world_size, B // D, B // D // A  # rows per DP rank; per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    model = (ContextParallel if args.implementation == "custom" else TorchCP)(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start)
    if rank == 0:
        print(f"cp ({args.implementation}): {world_size} rank(s) on {device}, {model.describe()}; global batch "
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


# ---- PyTorch's own context parallelism, behind the same methods ----------------------------

class TorchCP(ContextParallel):
    """torch.distributed.tensor.experimental.context_parallel: inside it, SDPA runs as ring attention over the
    CP mesh (rotate "alltoall": K/V passed round; "allgather"), and x, y and the position ids are sharded in
    place along the sequence (its load balancer: the same zigzag chunks). torch DDP averages the gradients.
    CUDA only (check_cp_args): its sharding rules cover the flash/efficient/cudnn SDPA kernels, not CPU's.
    Not run here (no GPU in this project's CI); written for NCCL, to be checked on one."""

    def __init__(self, config, args, device, state=None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
        self.args, self.device = args, device
        self.grid = torch.arange(dist.get_world_size()).view(-1, args.context_parallel_size)
        self.cp_mesh = init_device_mesh(device.type, tuple(self.grid.shape), mesh_dim_names=("dp", "cp"))["cp"]
        set_rotate_method("alltoall" if args.cp_mode == "ring" else "allgather")
        _cp_options.enable_load_balance = args.load_balance
        self.model = CPGPT(config, args.seed, device)  # GPT's SDPA attention, which context_parallel replaces
        if state is not None:
            self.model.load_state_dict(state)
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=[device.index],
                                                             bucket_cap_mb=args.bucket_cap_mb,
                                                             gradient_as_bucket_view=True)

    def sharded(self, x, y):
        """(x, y, pos) and the contexts that run SDPA as CP attention and shard them in place along dims 1, 1, 0."""
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel
        buffers = [x.clone(), y.clone(), torch.arange(self.args.block_size, device=self.device)]  # resized: no views
        kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        return buffers, (sdpa_kernel(kernels), context_parallel(self.cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0],
                                                                no_restore_buffers=set(buffers)))

    def forward_backward(self, x, y, sync):
        (x, y, pos), (kernels, sharded) = self.sharded(x, y)
        with kernels, sharded, nullcontext() if sync else self.ddp.no_sync(), activations.first():
            with autocast(self.args, self.device):
                _, loss = self.ddp(x, y, pos)
            (loss / self.args.grad_accum_steps).backward()  # backward's SDPA ops run as CP attention too
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        (x, y, pos), (kernels, sharded) = self.sharded(x, y)
        self.model.eval()
        with kernels, sharded, autocast(self.args, self.device):
            _, loss = self.model(x, y, pos)
        self.model.train()
        return loss.float()

    def describe(self):
        return (f"DP {len(self.grid)} x CP {self.grid.size(1)}, torch context_parallel ({self.args.cp_mode}, "
                f"load balance {self.args.load_balance}), {num_params(self.model) / 1e6:.2f}M params, torch DDP")


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
