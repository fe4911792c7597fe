"""plan.py: what each strategy costs, per rank, before it runs.

    python plan.py --nproc_per_node 8 [--nnodes 2] [--gpu h100] [--json] fsdp_train.py --preset gpt2

The script's flags go through its own parser and checks. Per class of equal ranks: the model state,
the activations, a step's peak on the device, the bytes handed to each collective by process group,
a pipeline's bubble and the FLOPs: each strategy's formulas in one function, in the README's order,
checked against the suite's runs (tests/runs.py). plan_report.py prints them, splits the bytes by
node and times a step on a GPU; plan_search.py (--search) ranks every layout by that time.
"""
import functools
import itertools
import math
import sys
from dataclasses import dataclass, field

from common.config import gpt_config
from common.metrics import flops_per_token
from common.model import GPT, LOSS_CHUNK_ROWS, GPTConfig
from common.schedule_report import peak_live

FP32 = 4  # bytes: parameters, gradients and AdamW's moments are fp32 in every script


@dataclass
class Rank:
    """One rank's figures; `ranks`: the ranks that have them."""
    ranks: list
    params: int = 0  # bytes
    grads: int = 0
    optimizer: int = 0  # AdamW's moments, a 0-dim `step` a tensor (DiLoCo: + the outer SGD's)
    comm: dict = field(default_factory=dict)  # "collective@group" -> bytes handed per step
    bubble: float = None  # a pipeline's idle share of the step
    activations: int = 0  # bytes saved for backward: one micro-batch's forward
    peak_activations: int = 0  # at the most micro-batches in flight (a pipeline's warm-up)
    flops: tuple = None  # (model, hardware) per step, this rank's share: plan() sets it
    between: dict = field(default_factory=dict)  # of comm, the bytes that cross nodes
    transients: dict = field(default_factory=dict)  # name -> bytes held at the step's peak too
    freed: int = 0  # of peak_activations, what the device no longer holds then (FSDP's units)
    floor: int = 0  # another moment's peak: a first stage's, at its embedding's dense gradient

    @property
    def model_state(self):
        return self.params + self.grads + self.optimizer

    @property
    def memory(self):  # a step's peak, in the loss's backward (tests/runs.py measures it)
        held = self.model_state + self.peak_activations - self.freed + sum(self.transients.values())
        return max(held, self.floor)

    def send(self, collective, group, nbytes, size=2):  # to a group of `size` (one: none)
        if size > 1:
            key = f"{collective}@{group}"
            self.comm[key] = self.comm.get(key, 0) + int(nbytes)


def adamw(numels):
    """16 bytes a parameter that the rank updates (param, grad, exp_avg, exp_avg_sq in fp32), and
    AdamW's `step`, one 0-dim fp32 tensor for each tensor it updates: `numels`, their sizes."""
    numels = list(numels)
    return dict(params=FP32 * sum(numels), grads=FP32 * sum(numels),
                optimizer=2 * FP32 * sum(numels) + FP32 * len(numels))


def compute_bytes(args):  # a matmul's output, a number, under autocast: bf16 or fp32 (bytes)
    return 2 if args.dtype == "bfloat16" else FP32


def parameters(config):  # (name, shape) of the one-process model's parameters (wte once)
    return built(tuple(vars(config).items()))[0]


@functools.lru_cache
def built(fields):  # the model on meta, once a model: its parameters' shapes, flops_per_token
    config = GPTConfig(**dict(fields))
    model = GPT(config, device="meta")
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters()), flops_per_token(config)


def layer_activations(s, b, h, a, mode, dropout, t=1, sp=False, e=FP32, copies=True):
    """Bytes one block keeps for backward: s positions x b rows, h wide, a heads, TP over t ranks
    (sp: SP), matmuls' outputs e bytes. Korthikanti et al. 2022's terms, with CPU's 4-byte masks,
    LayerNorms' mean and 1/std, autocast's bf16 weight copies (`copies`); test_recompute.py."""
    sbh, sb = s * b * h, s * b
    if mode == "full":  # the block's input alone (SP: its sequence shard)
        return 4 * sbh // (t if sp else 1)
    masks = 2 * e * sbh if dropout else 0  # the two residual dropouts' masks
    if sp:  # whole: the column-parallel linears' gathered inputs; the rest split by sequence, heads
        whole, split = 2 * e * sbh, (12 * e * sbh + 8 * sbh + masks) // t
    else:  # whole: the LayerNorms' inputs (fp32) and outputs, the masks; split: qkv, y, fc, gelu
        whole, split = (8 + 2 * e) * sbh + masks, 12 * e * sbh // t
    norms = 16 * sb // (t if sp else 1)  # each LayerNorm's mean and 1/std, 2 x 4 bytes a position
    weights = 24 * h * h // t if e < FP32 and copies else 0  # bf16 copies of the 12h^2 weights
    if mode == "selective":  # the attention core is recomputed: nothing of it kept
        core = 0
    elif dropout:  # SDPA's math path: the s x s scores, probabilities and the dropout's mask
        core = (12 * a * s * s * b + (e < FP32) * 6 * sbh) // t  # bf16: q, k, v copied too
    else:  # the fused kernel: its log-sum-exp, a float a position and head
        core = 4 * a * sb // t
    return whole + split + norms + weights + core


def model_activations(config, args, b, s, blocks, first=True, last=True, t=1, sp=False, vt=1,
                      head=True, copies=True):
    """Bytes one micro-batch's forward keeps (activations.first()): `blocks` blocks of b rows x s
    positions, the embedding's on the first stage, the head's and loss's on the last (V/vt)."""
    e, h, n, V = compute_bytes(args), config.n_embd, b * s, config.vocab_size
    saved = blocks * layer_activations(s, b, h, config.n_head, args.activation_checkpointing,
                                       config.dropout, t, sp, e, copies)
    if first:  # int64 ids (b, s) and positions (s); the embedding dropout's fp32 mask
        saved += 8 * n + 8 * s + (config.dropout > 0) * 4 * n * h
    if last:  # ln_f's fp32 input, mean and 1/std (no head: a vocabulary pass's, held by none)
        saved += 4 * n * h + 8 * n
    if last and head:  # ln_f's output, the logits (e bytes), the loss's lse, weight; bf16 head
        saved += e * n * h + e * n * V // vt + 16 * n + (e < FP32 and copies) * 2 * V * h // vt
    return saved


def micro_rows(args, replicas):  # a micro-batch's rows, `replicas` splitting the batch (main's)
    return args.batch_size // replicas // args.grad_accum_steps


def saving(rank, config, args, b, s=None, t=1, sp=False, vt=None, copies=True, vocab=False):
    """A rank's activations (the model's, one micro-batch in flight) and its loss's backward."""
    s, vt = s or args.block_size, t if vt is None else vt
    rank.activations = rank.peak_activations = model_activations(
        config, args, b, s, config.n_layer, t=t, sp=sp, vt=vt, copies=copies)
    e = compute_bytes(args)
    rank.transients["the loss's backward"] = loss_backward(config, b * s, e, vt, vocab or vt > 1)
    return rank


def loss_backward(config, rows, e, vt=1, vocab_parallel=False):
    """The loss's backward beyond the saved activations on CUDA (test_recompute.py, runs.py): the
    logits' gradient (e bytes a logit), a chunk's fp32 work: ChunkedCrossEntropy's log-softmax, its
    gradient, the logits' (12 a logit, bf16: 14); VocabParallelCrossEntropy's (V/vt) z - lse (4)."""
    chunk = 4 if vocab_parallel else 12 + (e < FP32) * e
    return (e * rows + chunk * min(LOSS_CHUNK_ROWS, rows)) * config.vocab_size // vt


def step_flops(config, args, world_size):
    """The step's FLOPs a rank, split evenly: the model's, as MFU counts them, and the hardware's,
    with backward's recompute: full, the forward (a third); selective, the core's (4LCT/12LCT)."""
    tokens, per_token = args.batch_size * args.block_size, built(tuple(vars(config).items()))[1]
    attention = 4 * config.n_layer * config.n_embd * args.block_size  # its core's forward a token
    again = {"full": per_token / 3, "selective": attention}
    hardware = per_token + again.get(args.activation_checkpointing, 0)
    return per_token * tokens / world_size, hardware * tokens / world_size


# ---- the strategies, in the README's order -----------------------------------------------------

def ddp(args, world_size, config, H=None):
    """ddp_train.py: every rank holds the whole model and its AdamW state; per step each rank hands
    its 4P gradient bytes, in buckets, to all-reduces over all ranks (torch DDP: the same).
    ddp_diloco_train.py: θ_outer and its momentum too (8P), and 4P of Δ every H steps."""
    numels = [math.prod(shape) for _, shape in parameters(config)]
    rank = Rank(list(range(world_size)), **adamw(numels))
    rank.optimizer += 2 * FP32 * sum(numels) * (H is not None)  # DiLoCo's outer SGD
    rank.send("all_reduce", "world", FP32 * sum(numels) // (H or 1), world_size)
    return [saving(rank, config, args, micro_rows(args, world_size))]


def grouped(ranks):
    """Ranks with equal figures as one Rank, in rank order."""
    classes = {}
    for rank in ranks:
        key = str({name: value for name, value in vars(rank).items() if name != "ranks"})
        first = classes.setdefault(key, rank)
        first.ranks += rank.ranks if first is not rank else []
    return list(classes.values())


def dim0_shard(shape, world_size, rank):
    """FSDP2's Shard(0) (torch.chunk): ceil(d0/N) rows a rank, the last ranks' fewer or none;
    returns (this rank's elements, the padded elements every rank all-gathers)."""
    rows, row = -(-shape[0] // world_size), math.prod(shape[1:])
    return max(0, min(rows, shape[0] - rank * rows)) * row, rows * row


def fsdp_units(config):
    """fsdp_train.py's units: each block's shapes, then the root's (wte, wpe, ln_f)."""
    units = {}
    for name, shape in parameters(config):
        units.setdefault(name.split(".")[2] if ".h." in name else "root", []).append(shape)
    return [units.pop(key) for key in list(units) if key != "root"] + [units["root"]]


def sharded(args, world_size, config, reshard, R=1, group="world"):
    """fsdp_train.py, fsdp_hsdp_train.py (over N = world/R, the shards all-reduced over R once),
    the FSDP2 peers of fsdp and zero3 --stage 3: per unit a rank holds ceil(numel/N) values (FSDP2:
    each tensor's dim-0 rows), gathered before forward (a block again for backward), scattered."""
    N, A, custom = world_size // R, args.grad_accum_steps, args.implementation == "custom"
    units, gather = fsdp_units(config), compute_bytes(args)  # unshard: in the compute dtype
    ranks = []
    for r in [0] if custom else range(N):  # custom: every rank's shards are the same size
        if custom:  # FlatParamUnit: shard_size = ceil(numel / N), and one AdamW step, per unit
            local = padded = [-(-sum(map(math.prod, shapes)) // N) for shapes in units]
            rank = Rank(list(range(world_size)), **adamw(local))
        else:  # FSDP2: one DTensor, and one AdamW step, per tensor
            pieces = [[dim0_shard(shape, N, r) for shape in shapes] for shapes in units]
            rank = Rank(list(range(r, world_size, N)), **adamw(o for u in pieces for o, _ in u))
            padded = [sum(pad for _, pad in unit) for unit in pieces]
        if N > 1:
            rank.send("all_gather", group, A * gather * (sum(padded) + reshard * sum(padded[:-1])))
            rank.send("reduce_scatter", group, A * FP32 * N * sum(padded))
            rank.send("all_reduce", group, FP32)  # clip_grad_norm_: the shards' squares
        rank.send("all_reduce", "replicate", FP32 * sum(padded), R)  # the step's shard, summed
        saving(rank, config, args, micro_rows(args, world_size), copies=not custom)
        if custom:  # a matmul saves its weight, gathered in the compute dtype: a view of its unit,
            kept = padded[-1:] if args.activation_checkpointing == "full" else padded  # whose
            rank.activations += N * gather * sum(kept)  # storage counts whole (full: the root's)
            rank.peak_activations = rank.activations
            # At the peak: the root and the prefetched last block (resharded: the rest resize_(0))
            held = padded[-1] + (args.prefetch and len(padded) > 1) * padded[-2]
            rank.freed = N * gather * (sum(kept) - (held if reshard else sum(padded)))
        ranks.append(rank)
    return grouped(ranks)


def zero_redundancy(shapes, world_size):
    """torch's ZeroRedundancyOptimizer._partition_parameters: per param group (decayed, then not),
    the largest tensor first onto the least-loaded rank (the lowest on ties): {name: owner}."""
    owner, load = {}, [0] * world_size
    for decayed in (True, False):
        group = [name for name, shape in shapes.items() if (len(shape) >= 2) == decayed]
        for name in sorted(group, key=lambda name: -math.prod(shapes[name])):  # stable
            owner[name] = load.index(min(load))
            load[owner[name]] += math.prod(shapes[name])
    return owner


def zero3(args, world_size, config, threshold=0, reuse=math.inf):
    """zero3_train.py (threshold, reuse: zero3_tuning_train.py's): a rank keeps what partition()
    gives it, the persistent tensors (owner None), every parameter (stage < 3), gradient (1)."""
    from zero3_tuning_train import partition  # zero3_train.py's, with --persistence_threshold
    N, A, stage = world_size, args.grad_accum_steps, args.stage
    if args.implementation == "pytorch" and stage == 3:  # FSDP2, blocks resharded
        return sharded(args, world_size, config, reshard=True)
    shapes = dict(parameters(config))
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    fill = min(N, len(sizes))  # both greedy: with a rank a tensor, each takes a fresh rank
    owner = zero_redundancy(shapes, fill) if args.implementation == "pytorch" else \
        partition(shapes.items(), fill, threshold)[0]  # the peer (stage 1): DDP + torch's ZeRO
    kept = {None: []}  # None: the persistent tensors, kept by every rank
    for name, n in sizes.items():
        kept.setdefault(owner[name], []).append(n)
    P, part = sum(sizes.values()), sum(sizes.values()) - sum(kept[None])
    owners = {}  # the ranks that keep the same tensors: one Rank
    for r in range(N):
        owners.setdefault(tuple(kept.get(r, [])), []).append(r)
    ranks = []
    for own, members in owners.items():
        rank = Rank(members, **adamw(kept[None] + list(own)))
        if stage < 3:  # ZeRO1.build_model: the whole model on every rank
            rank.params = FP32 * P
        if stage == 1:  # GradientBuckets (the peer: DDP's): every gradient
            rank.grads = FP32 * P
        if N > 1:
            comm(rank, args, stage, A, sizes, owner, P, part, reuse)
        # ParamFetcher holds the tied wte, fetched (the owner's: cast to bf16), from the head's
        wte, e = owner["transformer.wte.weight"], compute_bytes(args)  # forward to its backward
        if stage == 3 and N > 1 and wte is not None and (wte not in members or e < FP32):
            rank.transients["the head's fetched weight"] = e * sizes["transformer.wte.weight"]
        # stage 3 fetches the weights in the compute dtype: autocast makes no copies of them
        ranks.append(saving(rank, config, args, micro_rows(args, N), copies=stage < 3))
    return grouped(ranks)


def comm(rank, args, stage, A, sizes, owner, P, part, reuse):
    """What zero3_train.py's step hands to the collectives (its docstring's table)."""
    rank.send("all_reduce", "world", FP32)  # clip_grad_norm_: the shards' squares
    if stage == 1:  # GradientBuckets.all_reduce, on the last micro-step
        rank.send("all_reduce", "world", FP32 * P)
    else:  # ReduceToOwner: every partitioned fp32 gradient each micro-step, persistent ones once
        rank.send("reduce", "world", A * FP32 * part)
        rank.send("all_reduce", "world", FP32 * (P - part))
    if stage < 3:  # OwnedAdamW.step: each owner's updated tensors, one flat buffer
        rank.send("broadcast", "world", FP32 * part)
        return
    # ParamFetcher, per micro-step: every partitioned tensor before forward and backward, but wpe
    # (a lookup's backward reads no weight) and the tied wte: one fetch for the head's forward and
    # backward, which the embedding's serves too when the elements between are within the reuse
    wte, wpe = (sizes[n] * (owner[n] is not None) for n in ("transformer.wte.weight",
                                                            "transformer.wpe.weight"))
    reused = part - wte <= reuse
    element = compute_bytes(args)  # bf16: stage 3 computes in (fetches) bf16
    rank.send("broadcast", "world", A * element * (2 * part - wpe - reused * wte))


def tensor_parallel(args, world_size, config, overlap=False):
    """tp_train.py: a TP rank holds 1/tp of every tensor shard_dim() splits, the rest whole (the
    peer's SP splits wpe too). Per micro-step every block has two f and two g, the embedding a g
    and lm_head an f (CopyToTP, ReduceFromTP), each (b, T, C)."""
    import tp_train  # its shard_dim: which tensors TP splits
    tp, D, L = args.tensor_parallel_size, args.data_parallel_size, config.n_layer
    A = args.grad_accum_steps
    peer_wpe = args.implementation == "pytorch" and args.sequence_parallel
    numels = [math.prod(shape) // (tp if tp_train.shard_dim(name) is not None
                                   or (peer_wpe and name.endswith("wpe.weight")) else 1)
              for name, shape in parameters(config)]
    rank = Rank(list(range(world_size)), **adamw(numels))
    act, sp, b = compute_bytes(args), args.sequence_parallel, micro_rows(args, D)
    bt, btc = b * args.block_size, b * args.block_size * config.n_embd  # btc: a (b, T, C) tensor
    # full: backward reruns each block's forward up to its last op that saves a tensor: the f's,
    # attn's g, mlp's g only where a dropout saves its mask or (overlap) g's Function its input
    full = args.activation_checkpointing == "full"
    f_fwd = 2 * L * (1 + full) + 1  # the blocks', their recomputes', lm_head's
    g_fwd = 2 * L + full * L * (1 + (config.dropout > 0 or overlap))  # the blocks' only
    f_bwd = act if overlap else FP32  # overlap's Functions keep the autocast weight: dx its dtype
    if tp > 1 and overlap and sp:  # ring_all_gather, ring_reduce_scatter: tp - 1 sends of a
        # (b, T/tp, C) shard for each f and g, forward and backward, all in the matmul's dtype
        rank.send("send", "tp", A * (tp - 1) * btc // tp * (f_fwd + g_fwd + 4 * L + 1) * act)
        rank.send("reduce_scatter", "tp", A * FP32 * btc)  # the embedding's g, plain
        rank.send("all_gather", "tp", A * FP32 * btc // tp)  # and its backward
    elif tp > 1 and sp:  # f an all-gather forward, a reduce-scatter backward; g the reverse
        rank.send("all_gather", "tp", A * btc // tp * (f_fwd * FP32 + 2 * L * act + FP32))
        rank.send("reduce_scatter", "tp", A * btc * (g_fwd * act + FP32 + (2 * L + 1) * FP32))
    elif tp > 1:  # g an all-reduce forward, f one backward
        rank.send("all_reduce", "tp", A * btc * (g_fwd * act + FP32 + (2 * L + 1) * f_bwd))
    if tp > 1 and args.loss_parallel:  # VocabParallelCrossEntropy: the max, then (sum exp, z_t)
        rank.send("all_reduce", "tp", A * 3 * FP32 * bt)
    elif tp > 1:  # GatherFromVocab: this rank's (b, T, V/tp) logits
        rank.send("all_gather", "tp", A * act * bt * config.vocab_size // tp)
    if tp > 1 and sp:  # forward_backward(sync): the replicated tensors' partial gradients
        replicated = [math.prod(s) for n, s in parameters(config) if tp_train.shard_dim(n) is None]
        rank.send("all_reduce", "tp", FP32 * sum(replicated))
    rank.send("all_reduce", "dp", FP32 * sum(numels), D)  # sum_over_dp: every local gradient
    rank.send("all_reduce", "tp", FP32, tp)  # clip_grad_norm_: the shards' squares
    vt = tp if args.loss_parallel else 1
    return [saving(rank, config, args, b, t=tp, sp=sp, vt=vt, vocab=args.loss_parallel)]


def context_parallel(args, world_size, config):
    """cp_train.py: the whole model on every rank. Per layer and micro-step the attention sends K, V
    (kv = 2bTC/cp numbers) as its docstring's table says, dK, dV in fp32; a recompute, again."""
    numels = [math.prod(shape) for _, shape in parameters(config)]
    rank = Rank(list(range(world_size)), **adamw(numels))
    cp, A, L = args.context_parallel_size, args.grad_accum_steps, config.n_layer
    b = micro_rows(args, world_size // cp)
    kv = 2 * b * args.block_size * config.n_embd // cp
    act, again = compute_bytes(args), args.activation_checkpointing != "none"
    if cp > 1 and args.cp_mode == "ring":  # RingAttention: cp-1 [K; V] each way, cp dK,dV
        rank.send("send", "cp", A * L * kv * ((cp - 1) * act * (2 + again) + cp * FP32))
    elif cp > 1 and args.cp_mode == "allgather":  # gathered both ways; dK,dV reduce-scattered
        rank.send("all_gather", "cp", A * L * kv * act * (2 + again))
        rank.send("reduce_scatter", "cp", A * L * cp * kv * FP32)
    elif cp > 1:  # Ulysses: q,k,v (3kv/2) out, y (kv/2) back, each way; selective: y not again
        selective = args.activation_checkpointing == "selective"
        rank.send("all_to_all", "cp", A * L * kv // 2 * act * (8 + again * (4 - selective)))
    rank.send("all_reduce", "world", FP32 * sum(numels), world_size)  # GradientBuckets: D x cp
    return [saving(rank, config, args, b, args.block_size // cp)]


def stage_numels(config, args, stage, n_stages):
    """Tensor sizes of pp_train.py's Stage `stage`: blocks, wte, wpe first, ln_f last (no head)."""
    first = list(itertools.accumulate(args.stage_layers, initial=0))
    held = tuple(f"transformer.h.{i}." for i in range(first[stage], first[stage + 1]))
    held += ("transformer.wte.", "transformer.wpe.") if stage == 0 else ()
    held += ("transformer.ln_f.",) if stage == n_stages - 1 else ()
    return [math.prod(shape) for name, shape in parameters(config) if name.startswith(held)]


def pipeline(args, world_size, config, script, head_rows, v=(), vp=()):
    """A pipeline script's ranks, from its stage_index, schedule_actions, timetable and p2p_program
    (v: pp_zb's v_shape, vp: pp_vocab's); head_rows(stage, chunk): its lm_head copy's rows, or 0."""
    p, V, C, M = world_size, args.virtual_stages, config.n_embd, args.n_microbatches
    every = [script.schedule_actions(args.schedule, r, p, M, V, *vp) for r in range(p)]
    table = script.timetable(every, p * V, *v)  # Pipeline.__init__'s: every rank's, one clock
    rows, ranks = micro_rows(args, M), []  # rows: a micro-batch's
    for r in range(p):
        numels, sizes = [], []  # sizes: what a micro-batch's forward through each chunk saves
        for chunk in range(V):
            stage = script.stage_index(r, chunk, p, *v)
            numels += stage_numels(config, args, stage, p * V)
            numels += [head_rows(stage, chunk) * C] if head_rows(stage, chunk) else []
            sizes.append(model_activations(config, args, rows, args.block_size,
                                           args.stage_layers[stage], stage == 0,
                                           stage == p * V - 1, head=not vp))
        rank = Rank([r], **adamw(numels), activations=sum(sizes))
        last = script.stage_rank(p * V - 1, p, *v) == r  # the last stage's rank: the loss's
        if last and not vp:  # its loss (pp_vocab's: its vocabulary pass)
            loss = loss_backward(config, rows * args.block_size, compute_bytes(args))
            rank.transients["the loss's backward"] = loss
        rank.peak_activations = peak_live(every[r], sizes)  # the schedule's most held at once
        if script.stage_rank(0, p, *v) == r:  # the embedding's backward: a dense fp32 (V, C)
            rank.floor = rank.model_state + rank.peak_activations + FP32 * config.vocab_size * C
        rank.bubble = table[r].count(None) / len(table[r])  # its idle steps of the timetable
        program = script.p2p_program(table, r, p * V, *v)
        sends = sum(is_send for _, ops in program for _, is_send, _ in ops)
        if sends:  # Pipeline.run: each message a micro-batch's (rows, T, C) fp32, every micro-step
            nbytes = FP32 * rows * args.block_size * C
            rank.send("send", "pp", args.grad_accum_steps * sends * nbytes)
        rank.send("all_reduce", "world", FP32, p)  # clip_grad_norm_: the sum of squares
        ranks.append(rank)
    return ranks


def tied(rank, config, rows):
    """sum_tied_gradient (the pipelines'): rank 0's wte rows and a rank's copy, summed a step."""
    rank.send("all_reduce", "tied", FP32 * rows * config.n_embd)


def pp(args, world_size, config, script=None, v=()):
    """pp_train.py: rank r runs stages r, r+p, ...; the last stage holds a copy of the tied wte as
    lm_head (unless it is the first); a micro-batch's activation and gradient between stages."""
    import pp_train
    script = script or pp_train
    last = world_size * args.virtual_stages - 1
    ranks = pipeline(args, world_size, config, script,
                     lambda stage, chunk: config.vocab_size * (stage == last and stage > 0), v)
    loss_rank = script.stage_rank(last, world_size, *v)
    if loss_rank != 0:  # rank 0's wte and the last stage's copy
        tied(ranks[0], config, config.vocab_size)
        tied(ranks[loss_rank], config, config.vocab_size)
    return ranks


def pp_zb(args, world_size, config):
    """pp_zb_train.py: pp_train.py's, or zbv's V (rank r: stages r, 2p-1-r; W sends nothing)."""
    import pp_zb_train
    return pp(args, world_size, config, pp_zb_train, (args.schedule == "zbv",))


def pp_vocab(args, world_size, config):
    """pp_vocab_train.py: with --vocab_parallel every rank's first chunk holds vocab/p rows of the
    lm_head copy (rank 0's too), and each micro-batch adds a vocabulary pass L on every rank."""
    import pp_vocab_train
    if not args.vocab_parallel:
        return pp(args, world_size, config, pp_vocab_train)
    p, vocab, C, M = world_size, config.vocab_size, config.n_embd, args.n_microbatches
    ranks = pipeline(args, p, config, pp_vocab_train,
                     lambda stage, chunk: vocab // p * (chunk == 0), vp=(True,))
    for r in range(1, p):  # sum_tied_gradient: rank 0's wte rows of rank r and r's copy of them
        tied(ranks[0], config, vocab // p)
        tied(ranks[r], config, vocab // p)
    loss_rank = pp_vocab_train.stage_rank(p * args.virtual_stages - 1, p)
    N, passes = micro_rows(args, M) * args.block_size, M * args.grad_accum_steps  # tokens, passes
    e = compute_bytes(args)
    for rank in ranks:  # the pass's logits (V/p), their backward, (bf16) autocast's head copy
        logits = (e * N + (e < FP32) * 2 * C) * vocab // p
        rank.transients["the vocabulary pass"] = logits + loss_backward(config, N, e, p, True)
    for r, rank in enumerate(ranks if p > 1 else []):
        if r == loss_rank:  # Pipeline.run's L: the last stage's output h (N, C) fp32 to every rank
            rank.send("broadcast", "vocab", passes * FP32 * N * C)
        # VocabParallelCrossEntropy: the max (N) and the sums of exp and target logits (2N), fp32
        rank.send("all_reduce", "vocab", passes * FP32 * 3 * N)
        rank.send("reduce", "vocab", passes * FP32 * N * C)  # vocab_pass: each rank's part of dh
    return ranks


def ep(args, world_size, config):
    """ep_train.py: the Pd non-expert numbers on every rank, E/EP experts of each layer stacked. Per
    MoE layer and micro-step, the counts' all-to-all and the rows', at balanced routing (their sum
    over the EP group); the dense gradients over all ranks, the experts' over their replicas."""
    replicas, ep_size = args.data_parallel_size, world_size // args.data_parallel_size
    named = [(name, math.prod(shape)) for name, shape in parameters(config)]
    dense = [numel for name, numel in named if ".experts." not in name]
    rank = Rank(list(range(world_size)))
    if args.implementation == "pytorch":  # DDP's buckets: 4 bytes a parameter of the whole model
        vars(rank).update(adamw(numel for _, numel in named))
        rank.send("all_reduce", "world", FP32 * sum(numel for _, numel in named), world_size)
        return [saving(rank, config, args, micro_rows(args, world_size))]
    stacked = {}  # "transformer.h.0.mlp" + "c_fc.weight" -> its E experts' numbers, then E/EP's
    for name, numel in named:
        layer, expert, tensor = name.partition(".experts.")
        if expert:  # tensor: "3.c_fc.weight", expert 3's
            key = layer + tensor.split(".", 1)[1]
            stacked[key] = stacked.get(key, 0) + numel
    stacked = {key: numel // ep_size for key, numel in stacked.items()}
    vars(rank).update(adamw(dense + list(stacked.values())))
    A, C, E, k = args.grad_accum_steps, config.n_embd, config.n_experts, config.top_k
    N = args.batch_size // world_size // A * args.block_size  # tokens a micro-step (main's micro)
    rows = N * k * C * compute_bytes(args)  # the N*k slots' rows (send in ExpertParallel)
    # out and back, in forward and backward; full: the recompute's again, its counts kept
    calls = 4 + 2 * (args.activation_checkpointing == "full")
    rank.send("all_to_all", "ep", config.n_layer * A * (8 * E + calls * rows), ep_size)
    rank.send("all_reduce", "world", FP32 * sum(dense), world_size)  # GradientBuckets
    rank.send("all_reduce", "replica", FP32 * sum(stacked.values()), replicas)  # finish_backward
    rank.send("all_reduce", "ep", FP32, ep_size)  # clip_grad_norm_: the experts' squares
    return [saving(rank, config, args, micro_rows(args, world_size))]


@functools.lru_cache
def hybrid_stages(fields, pp, tp, split_wpe):
    """[(name, numel on a rank)] of each stage (StageGPT): its blocks, wte, wpe on the first, ln_f
    and the head's copy (pp > 1) on the last, 1/tp of the TP-split ones (the SP peer's wpe too)."""
    from hybrid_train import WTE_NAME, shard_dim
    config, stages = GPTConfig(**dict(fields)), [[] for _ in range(pp)]
    for name, shape in parameters(config):
        if name.startswith("transformer.h."):
            stage = int(name.split(".")[2]) // (config.n_layer // pp)
        else:
            stage = 0 if name.startswith(("transformer.wte", "transformer.wpe")) else pp - 1
        split = shard_dim(name) is not None or (split_wpe and "wpe" in name)
        stages[stage].append((name, math.prod(shape) // (tp if split else 1)))
    if pp > 1:
        stages[-1].append(("lm_head.weight", math.prod(dict(parameters(config))[WTE_NAME]) // tp))
    return stages


@functools.lru_cache(maxsize=64)
def stage_ranks(dp, pp, cp, tp):  # each stage's ranks (hybrid_train.py's rank_grid), rank order
    from hybrid_train import rank_grid
    return [rank_grid(dp, pp, cp, tp)[:, stage].flatten().tolist() for stage in range(pp)]


@functools.lru_cache
def one_f_one_b(pp, M):
    """Hybrid's is pp_train.py's 1F1B: each stage's idle share, the most micro-batches it holds."""
    from pp_train import schedule_actions, timetable
    every = [schedule_actions("1f1b", stage, pp, M) for stage in range(pp)]
    return [(row.count(None) / len(row), peak_live(actions))
            for row, actions in zip(timetable(every, pp), every)]


def hybrid(args, world_size, config):
    """hybrid_train.py: each stage's ranks alike; per axis, the collectives its docstring lists (g's
    forward, the ring's K, V in the compute dtype, the rest fp32); the peer's: its gradient sums."""
    from hybrid_train import shard_dim
    dp, pp = args.data_parallel_size, args.pipeline_parallel_size
    cp, tp, sp = args.context_parallel_size, args.tensor_parallel_size, args.sequence_parallel
    A, M, C, V = args.grad_accum_steps, args.n_microbatches, config.n_embd, config.vocab_size
    b, Tc, L = micro_rows(args, dp * M), args.block_size // cp, config.n_layer // pp
    act, s, mb = b * Tc * C, compute_bytes(args), A * M  # act: a (b, T/cp, C); mb: a step's
    full, again = args.activation_checkpointing == "full", args.activation_checkpointing != "none"
    stages = hybrid_stages(tuple(vars(config).items()), pp, tp,
                           args.implementation == "pytorch" and sp)
    grid, ranks = stage_ranks(dp, pp, cp, tp), []
    for stage, (idle, in_flight) in enumerate(one_f_one_b(pp, M)):
        first, last, held = stage == 0, stage == pp - 1, stages[stage]
        rank = Rank(list(grid[stage]), **adamw(numel for _, numel in held))
        rank.bubble = idle if pp > 1 else None  # the idle steps of its row of the timetable
        rank.activations = model_activations(config, args, b, Tc, L, first, last, tp, sp, tp)
        rank.peak_activations = in_flight * rank.activations
        if last and args.implementation == "custom":  # VocabParallelCrossEntropy's backward
            rank.transients["the loss's backward"] = loss_backward(config, b * Tc, s, tp, True)
        if first and pp > 1:  # the embedding's backward: a dense fp32 (V/tp, C)
            rank.floor = rank.model_state + rank.peak_activations + FP32 * V // tp * C
        local = FP32 * sum(numel for _, numel in held)
        rank.send("all_reduce", "ppxtp", FP32, pp * tp)  # clip_grad_norm_'s sum of squares
        if pp > 1 and (first or last):  # finish_gradients: the tied wte/lm_head, vocab/tp*C
            rank.send("all_reduce", "tied", FP32 * V // tp * C)  # the pp ends' tied_group
        if args.implementation == "pytorch":  # one flat all-reduce over dp (cp is 1 there)
            rank.send("all_reduce", "dp", local, dp)
            ranks.append(rank)
            continue
        rank.send("all_reduce", "dpxcp", local, dp * cp)  # forward_backward, the last micro-step
        # tp, per block and micro-batch: 2 g's forward (s), 2 f's backward (fp32), the embedding's g
        # and the head's f (fp32); full: the recompute reruns the attention's g only (early stop)
        n_g, n_f, fp32 = L * (2 + full), 2 * L, first + last
        if sp:  # f: all-gather forward, reduce-scatter backward; g: the other way; full: f again
            rank.send("all_gather", "tp", mb * act // tp * (
                FP32 * (n_f * (1 + full) + fp32) + s * 2 * L), tp)
            rank.send("reduce_scatter", "tp", mb * act * (FP32 * (n_f + fp32) + s * n_g), tp)
            replicated = sum(n for name, n in held if shard_dim(name) is None)
            rank.send("all_reduce", "tp", FP32 * replicated, tp)  # finish_gradients: SP's sums
        else:
            rank.send("all_reduce", "tp", mb * act * (FP32 * (n_f + fp32) + s * n_g), tp)
        # VocabParallelCrossEntropy: b*T/cp maxima, then 2b*T/cp sums (fp32)
        rank.send("all_reduce", "tp", last * mb * 3 * b * Tc * FP32, tp)
        # cp, a block and micro-batch: cp-1 K, V hops forward, backward, recompute; cp of dK, dV
        kv = 2 * act // tp
        rank.send("send", "cp", mb * L * kv * ((cp - 1) * s * (2 + again) + cp * FP32), cp)
        # pp: the stage's output forward, its input's gradient back, fp32 (Hybrid.p2p); SP: /tp
        message = b * (Tc // tp if sp else Tc) * C * FP32
        rank.send("send", "pp", mb * (2 - first - last) * message, pp)
        ranks.append(rank)
    return ranks


PLANS = {"ddp_train.py": ddp, "ddp_diloco_train.py": lambda a, n, c: ddp(a, n, c, a.inner_steps),
         "fsdp_train.py": lambda args, n, c: sharded(args, n, c, args.reshard_after_forward),
         "fsdp_hsdp_train.py": lambda a, n, c: sharded(a, n, c, a.reshard_after_forward,
                                                      a.replicate_size, "shard"),
         "zero3_train.py": zero3, "zero3_tuning_train.py": lambda a, n, c: zero3(
             a, n, c, a.persistence_threshold, a.max_reuse_distance),
         "tp_train.py": tensor_parallel,  # and tp_overlap_train.py's, its f and g in pieces:
         "tp_overlap_train.py": lambda args, n, c: tensor_parallel(args, n, c, args.tp_overlap),
         "cp_train.py": context_parallel, "pp_train.py": pp, "pp_vocab_train.py": pp_vocab,
         "pp_zb_train.py": pp_zb, "ep_train.py": ep, "hybrid_train.py": hybrid}


def plan(script, world_size, argv, nproc_per_node=None, args=None):
    """Each rank's figures (Ranks), for `script` on world_size ranks with argv (args: its flags)."""
    import plan_report  # where the ranks sit: which of their bytes cross nodes
    args = args or plan_report.script_args(script, argv, world_size)
    config = gpt_config(args)
    ranks = PLANS[script](args, world_size, config)
    flops = step_flops(config, args, world_size)  # split evenly: the same on every rank
    axes = plan_report.grid_axes(script, args, world_size)
    for rank in ranks:
        rank.flops = flops
        rank.between = plan_report.between_nodes(rank, axes, nproc_per_node or world_size)
    return ranks


if __name__ == "__main__":  # the command line: plan_report.py (the report, the nodes, a GPU's time)
    import plan_report
    sys.exit(plan_report.main())
