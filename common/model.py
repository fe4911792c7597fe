"""The nanoGPT GPT-2 model, shared by every strategy script.

Pre-LayerNorm blocks, causal scaled_dot_product_attention, GELU MLP (the exact GELU; GPT-2's tanh
approximation for OpenAI's weights, common/pretrained.py), learned position embeddings, `wte` tied
to `lm_head`, nanoGPT's initialisation. With `n_experts` > 0 each block's MLP is a mixture of
experts (MoE below); 0 is the dense GPT.

Initialisation depends only on (seed, parameter name): `init_tensor(name, shape, config, seed)`
draws each tensor from its own CPU generator, so the weights are bit-identical whether the
model is built whole on CPU, on CUDA, or materialised one piece at a time from the meta
device. Every strategy therefore starts from the same weights without broadcasting them.
"""
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    n_experts: int = 0  # > 0: each block's MLP is a mixture of this many experts; 0: dense
    top_k: int = 0  # experts per token (MoE only)
    expert_hidden: int = 0  # each expert's hidden width (MoE only; the flags' default: 4C / top_k)
    gelu: str = "exact"  # "tanh": GPT-2's approximation (gelu_new), which OpenAI's weights learned


PRESETS = {
    "gpt2": GPTConfig(),  # GPT-2 124M
    "small": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128),  # trains on a laptop CPU
}


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v fused
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        head_size = C // self.n_head
        q = q.view(B, T, self.n_head, head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, head_size).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, head_size).transpose(1, 2)  # (B, nh, T, hs)
        y = self.attend(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q, k, v):
        """The attention core, softmax(q k^T / sqrt(hs)) v with its dropout, causal: the part that
        --activation_checkpointing selective recomputes (common/recompute.py)."""
        dropout_p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


# GPTConfig.gelu -> nn.GELU's `approximate`
GELU_APPROXIMATE = {"exact": "none", "tanh": "tanh"}


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=GELU_APPROXIMATE[config.gelu])
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


# ---- the mixture of experts: a router, E expert MLPs, k of them per token -------------------

class Expert(nn.Module):
    """One expert: the dense MLP's two linears, at hidden width config.expert_hidden (by default
    4C/k, so that k of them cost the FLOPs of the dense MLP)."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.expert_hidden, bias=config.bias)
        self.gelu = nn.GELU(approximate=GELU_APPROXIMATE[config.gelu])
        self.c_proj = nn.Linear(config.expert_hidden, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


def route(probs, k):
    """Each token's k likeliest experts and their gates: at k >= 2 their probabilities renormalised
    to sum to 1; at k = 1 the probability itself, as Switch Transformer's top-1 (renormalised, the
    one gate would be 1, a constant: the router would learn nothing from the language-model loss).
    Ties go to the lower expert index: a stable sort keeps equal probabilities in index order
    (topk's tie order is unspecified). probs (..., E) fp32 -> gates (..., k) fp32, experts (..., k)
    int64."""
    top, experts = probs.sort(dim=-1, descending=True, stable=True)
    gates = top[..., :k]
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates, experts[..., :k].contiguous()


def count_slots(slots, n_experts):
    """How many of each row's slots went to each expert, without reading anything back to the host:
    bincount would (on CUDA it reads its input's min and max to size its output). A scatter_add_
    of ones into a known shape instead; its CUDA kernel is deterministic (torch's reproducibility
    notes list it under --deterministic), and integer sums are exact in any order anyway.
    slots (..., S) int64 -> counts (..., n_experts) int64."""
    counts = slots.new_zeros(slots.shape[:-1] + (n_experts,))
    return counts.scatter_add_(-1, slots, torch.ones_like(slots))


def load_balance_loss(probs, experts):
    """The auxiliary load-balancing loss, per sequence and then its mean over the sequences (so a
    micro-batch, a rank and one process compute the same value): E * sum_i f_i * P_i, with f_i the
    share of the sequence's k*T expert slots that went to expert i and P_i the mean router
    probability of expert i over its T tokens. 1 when balanced, and also whenever P is uniform,
    whatever the load (so near 1 at initialisation says little); E/k at worst. The gradient flows
    through P (f counts choices). probs (B, T, E), experts (B, T, k) -> a 0-dim fp32 tensor."""
    B, T, E = probs.shape
    slots = experts.view(B, -1)  # (B, T*k): each sequence's expert slots
    counts = count_slots(slots, E)  # (B, E)
    f = counts.to(probs.dtype) / slots.size(1)  # the share of slots per expert
    P = probs.mean(dim=1)  # (B, E)
    return (E * (f * P).sum(dim=-1)).mean()


def sort_by_expert(experts, n_experts):
    """The N*k expert slots (slot n*k + j: token n's j-th expert) in expert order, each expert's in
    token order (a stable sort), and the slots per expert. experts (N, k) -> order (N*k,),
    counts (n_experts,)."""
    flat = experts.flatten()  # (N*k,)
    return flat.argsort(stable=True), count_slots(flat, n_experts)


def invert(permutation):
    """The permutation that undoes `permutation` (1-D): out[invert(p)] puts out[p]'s rows back."""
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def run_experts(experts, rows, counts):
    """Each expert on its consecutive block of `rows` (counts: a list of ints, one per expert). An
    expert with no rows still runs, on an empty block: its gradient is then zeros, never None, so
    DDP's hooks, AdamW and the gradient sums see every parameter at every step."""
    return torch.cat([expert(part) for expert, part in zip(experts, rows.split(counts))])


def combine(out, order, gates):
    """The experts' outputs (rows in `order`, as sort_by_expert sorted the slots) back to their
    slots, and each token's k outputs weighted by its gates and summed. out (N*k, C), gates
    (N, k) -> (N, C), fp32 (the gates are)."""
    N, k = gates.shape
    slots = out[invert(order)].view(N, k, -1)  # (N*k, C) -> (N, k, C), slot n*k + j at [n, j]
    return (slots * gates.unsqueeze(-1)).sum(dim=1)


class MoE(nn.Module):
    """In place of the MLP: a router (a linear layer and a softmax over all E experts, both in fp32,
    bf16 runs included) picks k experts a token, each token's row goes to its k experts, and their
    outputs come back weighted by the gates (route). Dropless: every token reaches its k experts,
    however many choose the same one; no capacity factor. The experts are a ModuleDict keyed by
    index, so a shard of them (ep_train.py) keeps the names, and the init, of the full model. The
    load-balancing loss of the last forward is in `aux_loss`, its slots per expert in `load`.

    `dispatch_combine` moves the rows to the experts and back. Here every expert is local;
    ep_train.py replaces it, on each MoE, with all-to-alls to the ranks that hold the experts."""

    def __init__(self, config):
        super().__init__()
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(i): Expert(config) for i in range(config.n_experts)})
        self.dropout = nn.Dropout(config.dropout)
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.aux_loss = self.load = None

    def forward(self, x):
        B, T, C = x.size()
        # The logits from an fp32 matmul, as Megatron and torchtitan compute them: in bf16 their
        # rounding would decide between close experts. In fp32 runs .float() returns x itself: no
        # copy.
        with torch.autocast(x.device.type, enabled=False):
            probs = F.softmax(self.router(x.float()), dim=-1)  # (B, T, E)
        gates, experts = route(probs, self.top_k)  # each (B, T, k)
        self.aux_loss = load_balance_loss(probs, experts)
        self.load = count_slots(experts.view(-1), self.n_experts)  # (E,): this forward's slots
        rows = x.view(B * T, C)  # (B, T, C) -> (B*T, C)
        if torch.is_autocast_enabled(x.device.type):  # the rows in the compute dtype (bf16): the
            rows = rows.to(torch.get_autocast_dtype(x.device.type))  # experts' first cast, earlier
        y = self.dispatch_combine(rows, experts.view(B * T, -1), gates.view(B * T, -1))
        return self.dropout(y.view(B, T, C))  # (B*T, C) -> (B, T, C)

    def dispatch_combine(self, rows, experts, gates):
        """rows (N, C), experts and gates (N, k) -> (N, C): the gate-weighted sum of each row's k
        experts' outputs."""
        order, counts = sort_by_expert(experts, self.n_experts)
        sorted_rows = rows[order // self.top_k]  # (N*k, C): slot n*k + j holds row n
        out = run_experts(self.experts.values(), sorted_rows, counts.tolist())
        return combine(out, order, gates)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config) if config.n_experts else MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


def _embedding(num, dim):
    """nn.Embedding without its default init (a normal_ on the meta device imports torch._dynamo,
    about 1.5 s per process); materialize_ gives it its value."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class GPT(nn.Module):
    """`GPT(config, seed=s)` builds and initialises the model on `device`;
    `device="meta"` builds it without storage, to be materialised piece by piece."""

    def __init__(self, config, seed=0, device="cpu"):
        super().__init__()
        self.config = config
        with torch.device("meta"):  # no storage, no wasted default init
            self.transformer = nn.ModuleDict(dict(
                wte=_embedding(config.vocab_size, config.n_embd),
                wpe=_embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            ))
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        if str(device) != "meta":
            self.to_empty(device=device)
            self.tie_weights()  # to_empty replaces Parameter objects, which unties them
            materialize_(self, "", config, seed)

    def tie_weights(self):
        self.lm_head.weight = self.transformer.wte.weight

    def aux_loss(self):
        """A mixture of experts: the mean over the blocks of the load-balancing losses of the last
        forward (0-dim fp32); a dense GPT: None."""
        if not self.config.n_experts:
            return None
        return torch.stack([block.mlp.aux_loss for block in self.transformer.h]).mean()

    def expert_load(self):
        """A mixture of experts: the slots each expert of each block got in the last forward,
        (n_layer, E) int64 on the device (summed over the ranks, the global batch's load)."""
        return torch.stack([block.mlp.load for block in self.transformer.h])

    def forward(self, idx, targets=None):
        B, T = idx.size()
        block_size = self.config.block_size
        assert T <= block_size, f"sequence length {T} > block_size {block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.head(x, targets)

    def head(self, x, targets=None):
        """The final LayerNorm, the output layer and the loss: one region for --compile, which
        fuses the loss into the kernels around it (cross_entropy)."""
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))  # (B*T, vocab)
        return logits, loss


# ---- the loss in as few bytes as it needs ----------------------------------------------------

LOSS_CHUNK_ROWS = 1024  # rows whose fp32 softmax exists at once: 1024 x 50304 x 4 bytes = 206 MB


RECOMPUTE_LOG_SOFTMAX = None  # the loss's backward: True, False, or None: True on CUDA (below)


class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of (N, vocab) logits in their own dtype (bf16 under autocast), in
    chunks of `rows`, so that neither fp32 logits nor fp32 log-probs exist for the whole batch
    (F.cross_entropy of a `.float()` copy keeps 4 bytes a logit for backward and writes 4 more
    there; under autocast, without the copy, it keeps the fp32 log-probs). Forward: each chunk's
    log-softmax in fp32 (on CUDA torch's kernel reads bf16 and writes fp32 in one pass: no fp32
    copy of the logits) and the targets' entries; saved: the logits and lse = loss + z_target.
    Backward, a chunk at a time, d loss / d z = s (softmax - onehot), s = upstream / N (0 on an
    ignored row), by one of two routes:
    - CUDA (RECOMPUTE_LOG_SOFTMAX): the chunk's log-softmax again and its gradient by autograd,
      for d loss / d logp = -s at the target: torch's fused kernels, which read bf16 and write
      bf16 with fp32 math (elementwise fp32 passes over the chunk took 3x their time on an H100);
    - CPU: exp(z - lse) from the saved lse, in a few elementwise passes (2x faster there).
    Targets of -1 are ignored, as nanoGPT's ignore_index=-1: the mean is over the other rows."""
    @staticmethod
    def forward(ctx, logits, targets, rows):
        valid = targets != -1
        count = valid.sum()  # a tensor: no host sync
        targets = targets.clamp(min=0)  # an ignored row: any column, its loss and gradient zeroed
        losses = torch.cat([-F.log_softmax(z, dim=-1, dtype=torch.float32).gather(-1, t[:, None])
                            for z, t in zip(logits.split(rows), targets.split(rows))]).squeeze(-1)
        picked = logits.gather(-1, targets[:, None]).squeeze(-1).float()  # z_target
        ctx.rows = rows
        ctx.save_for_backward(logits, targets, losses + picked, valid / count)  # lse = loss + z_t
        return torch.where(valid, losses, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse, weight = ctx.saved_tensors  # weight: 1/count, 0 where ignored
        grad_logits = torch.empty_like(logits)
        scale = grad * weight  # (N,) d loss / d loss_n
        recompute = RECOMPUTE_LOG_SOFTMAX
        if recompute is None:
            recompute = logits.is_cuda
        for start in range(0, logits.size(0), ctx.rows):
            rows = slice(start, start + ctx.rows)
            z, t, s, out = logits[rows], targets[rows, None], scale[rows, None], grad_logits[rows]
            if recompute:
                with torch.enable_grad():  # one fp32 chunk of log-probs at a time
                    z = z.detach().requires_grad_()
                    logp = F.log_softmax(z, dim=-1, dtype=torch.float32)
                d_logp = torch.zeros_like(logp).scatter_(-1, t, -s)  # d loss / d logp
                out.copy_(torch.autograd.grad(logp, z, d_logp)[0])  # in the logits' dtype
                continue
            if out.dtype == torch.float32:  # the softmax straight into the gradient
                softmax = torch.sub(z, lse[rows, None], out=out).exp_()
            else:  # fp32 by promotion (lse is): one fp32 chunk, cast on the copy below
                softmax = (z - lse[rows, None]).exp_()
            softmax.scatter_add_(-1, t, torch.full_like(t, -1.0, dtype=softmax.dtype))
            softmax.mul_(s)
            if softmax is not out:
                out.copy_(softmax)
        return grad_logits, None, None


def cross_entropy(logits, targets):
    """The mean cross-entropy of (N, vocab) logits against (N,) targets: ChunkedCrossEntropy. A
    DTensor's (torch's TP peer, sharded by vocabulary) is torch's loss_parallel(), on an fp32 copy:
    its log-softmax returns the logits' dtype, bf16 under autocast, where ours sums in fp32. Inside
    a compiled region (--compile, GPT.head), the plain form, which inductor fuses with the kernels
    around it (a Python loop of chunks would only be unrolled): on an H100 it took ddp compiled
    from 0.69 to 0.97 of nanoGPT's tokens/s, and its peak memory up 0.8 GiB
    (docs/benchmarks/h100_2026-11-26.md)."""
    if type(logits) is not torch.Tensor:  # a DTensor
        return F.cross_entropy(logits.float(), targets, ignore_index=-1)
    if torch.compiler.is_compiling():
        return F.cross_entropy(logits, targets, ignore_index=-1)
    return ChunkedCrossEntropy.apply(logits, targets, LOSS_CHUNK_ROWS)


def num_params(model):
    return sum(p.numel() for p in model.parameters())  # the tied wte/lm_head counts once


def compile_forward(modules, enabled, eager=(), method="forward"):
    """--compile: each module's forward() through torch.compile, in place (its __call__ with the
    module hooks, where strategies gather, fetch and free, stays eager). Parameter names do not
    change: torch.compile(module) would wrap it and add `_orig_mod.` to every name, which no
    checkpoint, optimizer state or TP plan knows. Blocks share one graph (one per shape:
    dynamic=False, as a micro-batch and an evaluation batch keep their shapes). `eager`: methods
    inside each module, by path (e.g. "attn.attend"), that run uncompiled, their collectives not
    traced: the graph breaks at each call, and the compute between them is compiled. `method`:
    another method to compile in place of forward (GPT.head)."""
    if not enabled:
        return
    # Random ops (dropout) through aten, on the generators eager uses, not inductor's own stream:
    # the strategies choose those generators (TP's shared stream and each rank's own, restored by
    # a checkpoint), and a compiled run then draws the masks an eager one draws.
    import torch._inductor.config  # only when compiling: its import costs start-up time
    torch._inductor.config.fallback_random = True
    for module in modules:
        for path in eager:
            owner, _, name = path.rpartition(".")
            owner = module.get_submodule(owner)
            setattr(owner, name, torch.compiler.disable(getattr(owner, name)))
        setattr(module, method, torch.compile(getattr(module, method), dynamic=False))


BLOCK_LINEARS = ("attn.c_attn.forward", "attn.c_proj.forward", "mlp.c_fc.forward",
                 "mlp.c_proj.forward")  # a Block's linears, by path: compile_forward's `eager`


# ---- initialisation that depends only on (seed, parameter name) --------------------------

def _generator(seed, name):
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def init_tensor(name, shape, config, seed):
    """The initial value (fp32, CPU) of the parameter called `name` in the full model, e.g.
    "transformer.h.3.attn.c_proj.weight". nanoGPT's scheme: LayerNorm weights 1, biases 0,
    other weights N(0, 0.02), residual projections (c_proj) N(0, 0.02/sqrt(2*n_layer))."""
    short = name.rsplit(".", 2)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if short[-2].startswith("ln_"):
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=_generator(seed, name))


@torch.no_grad()
def materialize_(module, prefix, config, seed, device=None):
    """Give every parameter of `module` (e.g. a Block, prefix="transformer.h.3.") storage on
    `device` (default: where it is; meta moves to CPU) and its initial value. GPT has no buffers."""
    params = dict(module.named_parameters())
    if any(p.is_meta for p in params.values()) or device is not None:
        target = device if device is not None else "cpu"
        module.to_empty(device=target)
        if isinstance(module, GPT):
            module.tie_weights()
        params = dict(module.named_parameters())
    for name, p in params.items():
        p.copy_(init_tensor(prefix + name, p.shape, config, seed))
    return module


# AdamW's fused kernel, one for all the tensors of a step, as nanoGPT uses on CUDA; the CPU has one
# too (torch >= 2.4): 8.6x faster than the default per-tensor loop for the small preset on one core
# (6 against 51 ms a step, docs/benchmarks/cpu-2core_2026-11-26.md). Not the loop's bits: the
# suite's runs and its plain reference loop all take it (tests/test_parity.py), and it stays within
# 1e-5 of the loop (the same file).
FUSED_ADAMW = True


def is_stacked_expert(name):
    """Whether `name` is a tensor of several experts stacked (no expert index after .experts.)."""
    _, found, rest = name.partition(".experts.")
    return bool(found) and not rest.split(".")[0].isdigit()


def configure_optimizer(named_params, weight_decay, learning_rate, betas):
    """AdamW with eps 1e-8, fused; weight decay only on tensors with 2 or more dimensions (matmul
    weights and embeddings), none on biases and LayerNorm weights. `named_params`: (name, tensor)
    pairs. A stacked expert tensor (ep_train.py's experts.c_fc.weight, (expert, out, in), where one
    process has experts.3.c_fc.weight) counts the dimensions of one expert's."""
    named_params = [(n, p) for n, p in named_params if p.requires_grad]
    decay = [p for n, p in named_params if p.dim() - is_stacked_expert(n) >= 2]
    no_decay = [p for n, p in named_params if p.dim() - is_stacked_expert(n) < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=1e-8, fused=FUSED_ADAMW)
