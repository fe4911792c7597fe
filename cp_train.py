"""CP: context parallelism (all-gather K/V, ring attention with zigzag balancing, Ulysses), by hand.

The cp ranks of a context-parallel group split the sequence: each holds T/cp positions of every
row, in every layer. LayerNorm, MLP, the embeddings (at each token's true position) and the loss
are token-wise; only attention needs the other ranks, as a query attends to every earlier key.
Parameters are replicated, their gradients averaged over all N = D x cp ranks as in ddp_train.py.
Per layer per rank, B rows of the micro-step, C = n_embd, fp32 (4 bytes a number; bf16 K/V: 2):
  allgather  all-gather K,V: (cp-1) x 2BTC/cp numbers; backward all-gathers them again (it saves
             only its own) and reduce-scatters dK,dV: 2 x (cp-1) x 2BTC/cp.
  ring       K,V blocks of 2BTC/cp go round the ring, cp-1 sends, each while the previous block
             is computed; backward: K,V again, and beside them each block's dK,dV accumulator
             (fp32), cp sends as it starts at home and returns: (2cp-1) x 2BTC/cp.
  ulysses    all-to-all q,k,v from sequence shards to head shards (full sequence, n_head/cp
             heads) and the output back: (cp-1)/cp x 4BTC/cp numbers; the same in backward.
Every saved activation is 1/cp of one process's. Causal balance (--load_balance, default): rank r
holds zigzag chunks r and 2cp-1-r of 2cp, so every rank keeps T(T+1)/(2cp) (query, key) pairs.
2D: D x cp ranks in a grid (row = CP group of consecutive ranks); each DP rank takes B/D rows.

Run:
  python cp_train.py                                               # single process: the reference
  torchrun --standalone --nproc_per_node=2 cp_train.py --block_size 512           # ring, zigzag
  torchrun --standalone --nproc_per_node=2 cp_train.py --cp_mode ulysses
  torchrun --standalone --nproc_per_node=4 cp_train.py --context_parallel_size 2  # DP 2 x CP 2
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 cp_train.py --context_parallel_size 8  # CP in a node
  torchrun --standalone --nproc_per_node=2 cp_train.py --implementation pytorch    # CUDA only
Memory, peaks and the zigzag derivation: docs/cp.md.
"""
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import flash
from common.checkpoint import (checkpoint, model_state_on_cpu, optimizer_state_by_name, resume,
                               set_adamw_state)
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import Batches, get_batch
from common.distributed import (all_gather_single, autocast, clip_grad_norm_,
                                reduce_scatter_single, setup, setup_data, teardown, uses_cuda)
from common.metrics import MFU, Metrics, Profiler, activations, model_state_bytes, timers
from common.model import GPT, CausalSelfAttention, configure_optimizer, cross_entropy
from common.model import compile_forward, materialize_, num_params
from common.recompute import checkpoint_blocks
import peers.torch_cp


# ---- the strategy: who holds which positions ---------------------------------------------

def positions(T, cp_size, r, zigzag):
    """The positions CP rank r holds, ascending: [rT/cp, (r+1)T/cp), or zigzag chunks r, 2cp-1-r."""
    if not zigzag:
        return torch.arange(T).chunk(cp_size)[r]
    chunks = torch.arange(T).chunk(2 * cp_size)
    return torch.cat([chunks[r], chunks[2 * cp_size - 1 - r]])


def causal_window(q_pos, k_pos):
    """The part of a (query block, key block) pair that the causal mask keeps: queries from `first`
    on (those after the block's first key), keys up to `keys` (those before the last query), and
    the mask inside that window (True: key after query, dropped), or None when it keeps all."""
    first = int((q_pos < k_pos[0]).sum())
    keys = int((k_pos <= q_pos[-1]).sum())
    mask = k_pos[None, :keys] > q_pos[first:, None]  # (kept queries, kept keys)
    if not mask.any():
        return first, keys, None
    return first, keys, mask


class CPGroup:
    """The CP group, its ring neighbours (global ranks), every CP rank's positions (owned: this
    rank's), and this rank's windows."""
    def __init__(self, group, T, zigzag, device):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next = ranks[(self.rank + 1) % self.size]
        self.prev = ranks[(self.rank - 1) % self.size]
        self.positions = [positions(T, self.size, r, zigzag) for r in range(self.size)]
        self.owned = self.positions[self.rank].to(device)
        self.windows = []  # this rank's queries against the key block of each CP rank
        for k_pos in self.positions:
            first, keys, mask = causal_window(self.positions[self.rank], k_pos)
            # The fused kernel's is_causal: a mask only on my own block, the square's triangle (in
            # both splits another rank's chunks are wholly before or after each of my chunks).
            assert mask is None or torch.equal(k_pos, self.positions[self.rank])
            self.windows.append((first, keys, None if mask is None else mask.to(device)))


# ---- the strategy: attention over key blocks, merged by log-sum-exp ------------------------
# A block's softmax has its own normaliser; with lse = log sum_k exp(score), two partial results
# merge exactly: lse = logaddexp(lse_a, lse_b), out = out_a exp(lse_a-lse) + out_b exp(lse_b-lse).
# Shapes: B rows, nh heads, hs head size, T/cp this rank's positions; a window keeps the last
# queries = T/cp - first of them, and the first `keys` keys of the key block.
# A block is the explicit fp32 math below, or, on CUDA in bf16, SDPA's fused flash kernel, which
# returns the lse too (common/flash.py: its plumbing).


def block_forward(q, kv, window, out, lse, scale):
    """Attends this rank's queries to one key block and merges the result into out, lse (in
    place); returns what the fused kernel's backward wants back. q: (B, nh, T/cp, hs); out: the
    same in fp32; kv: (2, B, nh, T/cp, hs); lse: (B, nh, T/cp, 1)."""
    first, keys, mask = window
    if keys == 0 or first == q.size(-2):
        return None  # no kept pair: a later key block (contiguous split), nothing to compute
    q, k, v = q[..., first:, :], kv[0, ..., :keys, :], kv[1, ..., :keys, :]  # the window's
    rest = None
    with timers("attention"), torch.autocast(q.device.type, enabled=False):
        if flash.fused(q):  # a mask: the causal triangle of a square window (CPGroup asserts it)
            block_out, block_lse, rest = flash.block_attention(q, k, v, mask is not None, scale)
        else:  # fp32 math, whatever the inputs
            scores = q.float() @ k.float().transpose(-2, -1) * scale  # (B, nh, queries, keys)
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            block_lse = scores.logsumexp(-1, keepdim=True)  # (B, nh, queries, 1)
            block_out = (scores - block_lse).exp() @ v.float()  # (B, nh, queries, hs)
        old_lse = lse[..., first:, :]
        new_lse = torch.logaddexp(old_lse, block_lse)
        old_out = out[..., first:, :] * (old_lse - new_lse).exp()
        out[..., first:, :] = old_out + block_out.float() * (block_lse - new_lse).exp()
        lse[..., first:, :] = new_lse
    return rest


def block_backward(q, kv, window, dout, out, lse, dq, scale, rest):
    """Adds this key block's part of dq (in place); returns its [dK; dV]. probs = exp(s - lse) with
    the final lse is the block's share of the full softmax, so dS = probs (dP - rowsum(dout * out))
    needs no merging. out, dq: fp32; rest: what block_forward returned for this block."""
    first, keys, mask = window
    dkv = torch.zeros(kv.shape, device=q.device)  # (2, B, nh, T/cp, hs)
    if keys == 0 or first == q.size(-2):
        return dkv
    q, k, v = q[..., first:, :], kv[0, ..., :keys, :], kv[1, ..., :keys, :]  # the window's
    dout, out, lse = dout[..., first:, :], out[..., first:, :], lse[..., first:, :]
    with timers("attention"), torch.autocast(q.device.type, enabled=False):
        if flash.fused(q):
            dq_kept, dk, dv = flash.block_backward(dout, q, k, v, out, lse, mask is not None,
                                                   scale, rest)
        else:  # fp32 math
            q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
            scores = q @ k.transpose(-2, -1) * scale  # (B, nh, queries, keys)
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            probs = (scores - lse).exp()
            delta = (dout * out).sum(-1, keepdim=True)  # (B, nh, queries, 1)
            ds = probs * (dout @ v.transpose(-2, -1) - delta) * scale
            dq_kept, dk, dv = ds @ k, ds.transpose(-2, -1) @ q, probs.transpose(-2, -1) @ dout
        dq[..., first:, :] += dq_kept  # (B, nh, queries, hs)
        dkv[0, ..., :keys, :] = dk  # (B, nh, keys, hs)
        dkv[1, ..., :keys, :] = dv  # (B, nh, keys, hs)
    return dkv


def pass_to_next(tensor, cp):
    """Sends tensor to the next rank of the ring and receives the previous rank's into a new one,
    tensor.numel() numbers each way. Both in one batch_isend_irecv: under NCCL a send may wait for
    its receive, and every rank posting its pair together cannot deadlock."""
    if cp.size == 1:  # a ring of one rank: the tensor is its own next (gloo cannot send to self)
        return tensor, []
    received = torch.empty_like(tensor)
    send = dist.P2POp(dist.isend, tensor, cp.next, cp.group)
    receive = dist.P2POp(dist.irecv, received, cp.prev, cp.group)
    works = dist.batch_isend_irecv([send, receive])
    return received, works


def wait(works):
    with timers("exposed_comm"):  # the transfer time the compute did not hide
        for work in works:
            work.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over all keys, K/V blocks passed round a ring."""
    @staticmethod
    def forward(ctx, q, k, v, cp):
        kv = torch.stack([k, v])  # (2, B, nh, T/cp, hs): this rank's [K; V]
        out = torch.zeros_like(q, dtype=torch.float32)  # (B, nh, T/cp, hs)
        lse = torch.full(q.shape[:-1] + (1,), float("-inf"), device=q.device)  # (B, nh, T/cp, 1)
        scale = q.size(-1) ** -0.5
        ctx.cp, ctx.rests = cp, []  # rests: what each step's fused kernel wants back
        # step i: the block of CP rank (rank - i), the next one on the wire meanwhile
        for i in range(cp.size):
            if i < cp.size - 1:
                received, works = pass_to_next(kv, cp)
            window = cp.windows[(cp.rank - i) % cp.size]
            ctx.rests.append(block_forward(q, kv, window, out, lse, scale))
            if i < cp.size - 1:
                wait(works)
                kv = received
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        kv = torch.stack([k, v])  # (2, B, nh, T/cp, hs)
        dq = torch.zeros_like(q, dtype=torch.float32)
        scale = q.size(-1) ** -0.5
        # The block of rank j travels as in forward, its dK,dV accumulator beside it, a step behind:
        # it starts on rank j at zero, each rank adds its queries' share, and rank j-1 sends the sum
        # home to j.
        dkv = torch.zeros((), device=q.device)  # my block's accumulator before its first share
        dkv_works = []
        for i in range(cp.size):
            if i < cp.size - 1:
                received, works = pass_to_next(kv, cp)
            window = cp.windows[(cp.rank - i) % cp.size]
            share = block_backward(q, kv, window, dout, out, lse, dq, scale, ctx.rests[i])
            wait(dkv_works)  # dkv: the accumulator of this block, from the previous rank
            sent = share.add_(dkv)  # (2, B, nh, T/cp, hs) fp32; kept until its send completes
            # 2BTC/cp fp32 numbers to the rank that holds this block next. Every rank posts its
            # passes in one order (K,V, then the accumulator): each receive meets its send.
            dkv, dkv_works = pass_to_next(sent, cp)
            if i < cp.size - 1:
                wait(works)
                kv = received
        wait(dkv_works)  # dkv: my block's, back with every rank's share
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class AllGatherAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the all-gathered K/V (Llama 3's CP)."""
    @staticmethod
    def forward(ctx, q, k, v, cp):
        kv = all_gather_kv(k, v, cp)  # (cp, 2, B, nh, T/cp, hs)
        out = torch.zeros_like(q, dtype=torch.float32)  # (B, nh, T/cp, hs)
        lse = torch.full(q.shape[:-1] + (1,), float("-inf"), device=q.device)  # (B, nh, T/cp, 1)
        scale = q.size(-1) ** -0.5
        ctx.cp = cp  # and what each block's fused kernel wants back:
        ctx.rests = [block_forward(q, kv[j], w, out, lse, scale) for j, w in enumerate(cp.windows)]
        ctx.save_for_backward(q, k, v, out, lse)  # its own K,V only: backward gathers them again
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        kv = all_gather_kv(k, v, cp)  # (cp, 2, B, nh, T/cp, hs)
        dq = torch.zeros_like(q, dtype=torch.float32)
        scale = q.size(-1) ** -0.5
        blocks = []
        for j, window in enumerate(cp.windows):
            blocks.append(block_backward(q, kv[j], window, dout, out, lse, dq, scale, ctx.rests[j]))
        dkv = torch.stack(blocks)  # (cp, 2, B, nh, T/cp, hs): my queries' share of every block
        my_dkv = dkv.new_empty(dkv.shape[1:])  # (2, B, nh, T/cp, hs)
        # cp x 2BTC/cp numbers in: block j's dK,dV from every rank summed on rank j, (cp-1) sent
        reduce_scatter_single(my_dkv, dkv.flatten(0, 1), group=cp.group)
        return dq.to(q.dtype), my_dkv[0].to(k.dtype), my_dkv[1].to(v.dtype), None


def all_gather_kv(k, v, cp):
    """[K; V] of every CP rank: this rank's 2BTC/cp numbers to each other."""
    kv = torch.stack([k, v])  # (2, B, nh, T/cp, hs)
    # gloo wants the ranks' tensors stacked along dim 0
    gathered = kv.new_empty((cp.size * 2,) + kv.shape[1:])  # (cp * 2, B, nh, T/cp, hs)
    all_gather_single(gathered, kv, group=cp.group)
    return gathered.unflatten(0, (cp.size, 2))  # (cp, 2, B, nh, T/cp, hs)


class AllToAll(torch.autograd.Function):
    """Ulysses' exchange: x split in cp pieces along scatter_dim, piece j to CP rank j, the pieces
    received concatenated along gather_dim; (cp-1)/cp of x leaves the rank. Backward is the
    exchange reversed."""
    @staticmethod
    def forward(ctx, x, cp, scatter_dim, gather_dim):
        ctx.args = cp, gather_dim, scatter_dim  # backward's exchange: the dims swapped
        send = torch.stack(x.chunk(cp.size, dim=scatter_dim)).contiguous()  # (cp, *piece)
        received = torch.empty_like(send)  # (cp, *piece): piece j from CP rank j
        dist.all_to_all_single(received, send, group=cp.group)
        return torch.cat(received.unbind(0), dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, *ctx.args), None, None, None


def ulysses_attention(q, k, v, cp, dropout_p):
    """Causal attention over all T positions on n_head/cp heads. The sequence is gathered in rank
    order, which is position order with the contiguous split."""
    qkv = torch.stack([q, k, v])  # (3, B, nh, T/cp, hs)
    qkv = AllToAll.apply(qkv, cp, 2, 3)  # (3, B, nh/cp, T, hs): heads scattered, sequence gathered
    q, k, v = qkv.unbind(0)  # (B, nh/cp, T, hs) each: this rank's own heads
    # (B, nh/cp, T, hs): causal over the whole sequence, as in one process
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return AllToAll.apply(y, cp, 2, 1)  # (B, nh, T/cp, hs): back to T/cp positions, every head


class CPAttention(CausalSelfAttention):
    """GPT's attention (the same parameters) on this rank's T/cp positions."""
    def forward(self, x):
        B, L, C = x.shape  # L = T/cp: this rank's positions
        head_size = C // self.n_head
        qkv = self.c_attn(x).view(B, L, 3, self.n_head, head_size)  # (B, T/cp, 3, nh, hs)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, nh, T/cp, hs) each
        y = self.attend(q, k, v)  # (B, nh, T/cp, hs)
        y = y.transpose(1, 2).reshape(B, L, C)  # (B, T/cp, C): the heads side by side
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q, k, v):
        """The attention core over all T positions. Recomputed (--activation_checkpointing), it
        communicates again: the ring passes K, V round once more in backward, before its backward
        ring; allgather gathers them again; Ulysses repeats its q, k, v all-to-all, and under full
        its output's too (selective's recompute stops at the last op that saves a tensor)."""
        if self.mode == "ulysses":
            dropout_p = self.dropout if self.training else 0.0
            return ulysses_attention(q, k, v, self.cp, dropout_p)
        if self.mode == "ring":
            return RingAttention.apply(q, k, v, self.cp)
        return AllGatherAttention.apply(q, k, v, self.cp)


class CPGPT(GPT):
    """common/model.py's GPT whose forward takes each token's position (its T/cp positions are not
    0..T/cp-1), with CPAttention in every block (cp None: GPT's own attention, for PyTorch's
    context_parallel)."""
    def __init__(self, config, seed, device, cp=None, mode=None):
        super().__init__(config, device="meta")
        if cp is not None:
            for block in self.transformer.h:
                with torch.device("meta"):
                    block.attn = CPAttention(config)
                block.attn.cp = cp
                block.attn.mode = mode
        self.to_empty(device=device)
        self.tie_weights()
        materialize_(self, "", config, seed)  # the same values as GPT(config, seed): by name

    def forward(self, idx, targets, pos):
        tok_emb = self.transformer.wte(idx)  # (B, T/cp, C)
        pos_emb = self.transformer.wpe(pos)  # (T/cp, C): each token's true position
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T/cp, vocab)
        loss = cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))  # (B*T/cp, V)
        return logits, loss


# ---- DP: the gradients summed over all N ranks after the step's last backward ---------------

class GradientBuckets:
    """Flat buffers of about bucket_cap_mb that the .grads are views of: autograd accumulates
    straight into them, and the all-reduce needs no copy in or out. ddp_train.py also overlaps
    them with backward; with the long sequences CP is for, a step's attention dwarfs this one
    all-reduce of the gradients (docs/cp.md)."""

    def __init__(self, model, bucket_cap_mb, group=None):
        self.group, self.buffers = group, []
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
        # Each buffer (numel x 4 bytes) to every rank of the group, summed: every rank's
        # gradients are already g/N (its loss was divided by N), so the sum is the mean.
        works = [dist.all_reduce(flat, group=self.group, async_op=True) for flat in self.buffers]
        with timers("all_reduce_wait"):
            for work in works:
                work.wait()


class ContextParallel:
    """The strategy behind the few methods the training loop calls: CPGPT on every rank, each CP
    rank on its positions of the DP rank's rows. Every rank's loss is the mean over the same number
    of tokens (B/D rows x T/cp positions), so the mean over all N = D x cp ranks, of the losses
    and of the gradients (GradientBuckets), is that of the mean over all B*T tokens."""
    dp_group = None  # the ranks over which the loop averages losses: all of them

    def __init__(self, config, args, device, state=None):
        self.args = args
        self.device = device
        # The D x cp grid: row d is a CP group (consecutive ranks: one node's fast links), DP rank d
        self.grid = torch.arange(dist.get_world_size()).view(-1, args.context_parallel_size)
        cp_group, _ = dist.new_subgroups_by_enumeration(self.grid.tolist())  # each rank makes all
        self.cp = CPGroup(cp_group, args.block_size, args.load_balance, device)
        self.model = CPGPT(config, args.seed, device, self.cp, args.cp_mode)
        if state is not None:  # a full checkpoint from any script: every rank loads all of it
            self.model.load_state_dict(state)
        # --compile: each block's forward; its attention core (the ring, the all-gather or the
        # all-to-alls) runs eagerly, the rest of the block is compiled around it
        compile_forward(self.model.transformer.h, args.compile, eager=["attn.attend"])
        checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        self.buckets = GradientBuckets(self.model, args.bucket_cap_mb)

    def sdpa_gpt(self, config):
        """CPGPT with GPT's own SDPA attention, for torch's context_parallel (peers/torch_cp.py)."""
        return CPGPT(config, self.args.seed, self.device)

    def configure_optimizer(self, args, state=None):
        betas = (args.beta1, args.beta2)
        named = self.model.named_parameters()
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        if state is not None:  # a checkpoint's AdamW state, keyed by parameter name
            for name, p in self.model.named_parameters():
                set_adamw_state(optimizer, p, state[name], lambda t: t.to(self.device, copy=True))
        return optimizer

    def forward_backward(self, x, y, sync):
        """One micro-step on this rank's positions of x, y; returns the mean loss over them."""
        pos = self.cp.owned  # (T/cp,): this rank's positions, ascending
        with activations.first(), autocast(self.args, self.device):  # the bytes kept for backward
            _, loss = self.model(x[:, pos], y[:, pos], pos)
        # Divided by A*N, backward writes g/(A*N): the buckets' plain sum over the N ranks is the
        # mean, with no pass to divide (why a sum: docs/design.md).
        N = dist.get_world_size(self.buckets.group)  # the ranks the buckets sum over
        (loss / (self.args.grad_accum_steps * N)).backward()
        if sync:  # the step's last micro-step: the earlier ones only accumulated
            self.buckets.all_reduce()
        return loss.detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        pos = self.cp.owned
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x[:, pos], y[:, pos], pos)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # Equal gradients on every rank: no communication. The flat buffers hold the same
        # elements as the .grads, one tensor a bucket (a CPU foreach op runs one op a tensor).
        return clip_grad_norm_(None, self.buckets.buffers, max_norm)

    def full_state(self, optimizer):
        """Nothing to gather: rank 0 copies its full state to the CPU, a tensor at a time."""
        if dist.get_rank() != 0:
            return None, None
        named = self.model.named_parameters()
        return model_state_on_cpu(self.model), optimizer_state_by_name(named, optimizer)

    def describe(self):
        dp_size, cp_size = self.grid.shape
        split = "zigzag" if self.args.load_balance else "contiguous"
        n_params = num_params(self.model) / 1e6
        n_buckets = len(self.buckets.buffers)
        return (f"DP {dp_size} x CP {cp_size} grid {self.grid.tolist()} (row = CP group), "
                f"{self.args.cp_mode} attention, {split} split, {n_params:.2f}M params, "
                f"{n_buckets} gradient buckets")


class TorchCP(peers.torch_cp.TorchCP, ContextParallel):
    """--implementation pytorch: torch's context_parallel (SDPA as ring attention) and DDP in place
    of the hand-written attention and GradientBuckets (peers/torch_cp.py); the other methods are
    ContextParallel's."""


def add_cp_flags(group):
    group.add_argument("--cp_mode", choices=["allgather", "ring", "ulysses"], default="ring",
                       help="how attention reaches the other ranks' keys")
    group.add_argument("--context_parallel_size", type=int, default=None,
                       help="cp (default: all ranks)")
    add_bool(group, "--load_balance", None,
             "zigzag split for ring/allgather (default true; ulysses: contiguous)")
    group.add_argument("--bucket_cap_mb", type=float, default=25.0,
                       help="gradient bucket size (MiB)")


def check_cp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Fills in
    context_parallel_size and load_balance; returns D = world size / cp."""
    cp_size = args.context_parallel_size or world_size
    T = args.block_size
    pytorch = args.implementation == "pytorch"
    if pytorch and not uses_cuda(args):
        die("--implementation: pytorch's context_parallel needs CUDA SDPA kernels "
            "(flash/efficient/cudnn); on CPU use --implementation custom")
    if pytorch and args.cp_mode == "ulysses":
        die("--cp_mode: PyTorch's context_parallel has ring and allgather, not ulysses")
    if args.bucket_cap_mb <= 0:
        die(f"--bucket_cap_mb: must be > 0, got {args.bucket_cap_mb}")
    if pytorch and args.bucket_cap_mb < 1:  # torch DDP under --compile, as in ddp_train.py
        if args.compile:
            die("--compile: dynamo splits torch DDP's compiled graph at its buckets, whose first "
                "holds 1 MiB: --bucket_cap_mb must be >= 1 (or use --compile false)")
        args.compile = False  # the default: off here
    if cp_size <= 0 or world_size % cp_size:
        die(f"--context_parallel_size: {cp_size} must be > 0 and divide the world size "
            f"({world_size})")
    if args.cp_mode == "ulysses" and args.load_balance is not None:
        die("--load_balance: only for ring and allgather (ulysses attends over the whole "
            "sequence: balanced)")
    args.context_parallel_size = cp_size
    # zigzag unless asked not to; ulysses gathers the sequence in rank order: contiguous
    args.load_balance = args.cp_mode != "ulysses" and args.load_balance is not False
    if args.load_balance and T % (2 * cp_size):
        die(f"--block_size: {T} must be divisible by {2 * cp_size} "
            f"(2 x --context_parallel_size, zigzag)")
    if not args.load_balance and T % cp_size:
        die(f"--block_size: {T} must be divisible by {cp_size} (--context_parallel_size)")
    if args.cp_mode == "ulysses" and args.n_head % cp_size:
        die(f"--n_head: {args.n_head} must be divisible by --context_parallel_size ({cp_size}) "
            f"with ulysses")
    if args.dropout > 0 and args.cp_mode != "ulysses" and not pytorch:
        # dropout on attention probabilities would need each block's mask replayed in backward
        die(f"--dropout: {args.cp_mode} attention has no attention dropout; use --dropout 0 or "
            f"--cp_mode ulysses")
    check_batch_split(args, world_size // cp_size)
    return world_size // cp_size


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("cp", add_cp_flags, argv)
    D = check_cp_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank = rank * D // world_size
    rows = B // D  # rows per data-parallel rank
    micro = rows // A  # rows per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    Strategy = ContextParallel if args.implementation == "custom" else TorchCP
    model = Strategy(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    mfu = MFU(config, args, device, world_size)  # model FLOPs utilisation, per log line
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start, mfu=mfu)
    if rank == 0:
        print(f"cp ({args.implementation}): {world_size} rank(s) on {device} in {args.dtype}, "
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


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
