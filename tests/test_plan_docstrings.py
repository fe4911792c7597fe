"""The few figures each tier-1 script's docstring states, and docs/<strategy>.md where it states the same, against
plan.py's, their one home: a claim is a phrase that the text must still contain word for word (an edit of its figure
fails), and a plan at a small layout whose figure is the phrase's formula, evaluated with P (the one-process model's
parameters, wte once), N, A and the rest. fp32 unless the phrase is about bf16: --dtype is always given (its default
is bf16 on a GPU that computes in it). The 16 bytes a parameter leave out AdamW's step, 4 bytes a tensor it updates
(docs/hybrid.md says so): Layout.state takes those off, each claim naming the tensors."""
import ast
import functools
import pathlib

import pytest

import plan
from common.config import gpt_config
from common.model import GPT, GPTConfig
import plan_report
from plan_report import RING
from zero3_tuning_train import partition  # zero3_train.py's owners, as plan.zero3 takes them

ROOT = pathlib.Path(__file__).resolve().parent.parent


def stated_text(source):
    """The text a claim is read from: a script's module docstring (parsed, never imported), or a docs page."""
    text = (ROOT / source).read_text()
    return ast.get_docstring(ast.parse(text)) if source.endswith(".py") else text


def words(text):  # a phrase may wrap, or line up in columns: its words in order
    return " ".join(text.split())


def on_stage(name, stages, n_layer):
    """The pipeline stage (an even cut) that holds a parameter: block i on i // (n_layer/stages), wte and wpe on the
    first, ln_f on the last, as pp_train.py's and hybrid_train.py's docstrings say."""
    if name.startswith("transformer.h."):
        return int(name.split(".")[2]) // (n_layer // stages)
    return 0 if name.startswith(("transformer.wte", "transformer.wpe")) else stages - 1


REPLICATED = ("ln_", "c_proj.bias", "wpe")  # TP: "the replicated LayerNorms, row-parallel biases and wpe"


@functools.lru_cache
def model_sizes(fields):  # {name: numel} of the one-process model, built on meta
    return {name: p.numel() for name, p in GPT(GPTConfig(**dict(fields)), device="meta").named_parameters()}


class Layout:
    """plan.plan's ranks for `script` at N ranks with `flags` (fp32 unless they say), and the figures the phrases
    name: P, A, T, C, L (n_layer), vocab, E, k, the axes tp, cp, pp (1 where the script has none; pp_train.py's
    pp_size is N), M micro-batches, V chunks a rank, dp the ranks that split the batch, b a micro-batch's rows on
    each."""

    def __init__(self, script, N, flags):
        flags = list(flags) if "--dtype" in flags else ["--dtype", "float32", *flags]
        self.script, self.N, self.flags = script, N, flags
        self.ranks = plan.plan(script, N, flags)
        self.args = args = plan_report.script_args(script, flags, N)
        config = gpt_config(args)
        self.sizes = model_sizes(tuple(vars(config).items()))
        self.P, self.A, self.T = sum(self.sizes.values()), args.grad_accum_steps, args.block_size
        self.C, self.L, self.vocab = config.n_embd, config.n_layer, config.vocab_size
        self.E, self.k = config.n_experts, config.top_k
        self.wte, self.wpe = self.sizes["transformer.wte.weight"], self.sizes["transformer.wpe.weight"]
        self.tp, self.cp = (getattr(args, f"{axis}_parallel_size", None) or 1 for axis in ("tensor", "context"))
        self.pp = N if script == "pp_train.py" else getattr(args, "pipeline_parallel_size", None) or 1
        self.M, self.V = (getattr(args, name, None) or 1 for name in ("n_microbatches", "virtual_stages"))
        self.dp = N // (self.tp * self.cp * self.pp)  # ep_train.py: every rank its own rows
        self.EP = N // getattr(args, "data_parallel_size", 1) if script == "ep_train.py" else None
        self.b = args.batch_size // self.dp // self.A // self.M

    def __getitem__(self, r):  # the Rank that holds rank r
        return next(rank for rank in self.ranks if r in rank.ranks)

    def comm(self, key, r=0):
        return self[r].comm.get(key, 0)

    def state(self, r, tensors):
        """Rank r's model state less AdamW's step: 4 bytes for each of the `tensors` it updates."""
        return self[r].model_state - 4 * tensors

    def parts(self, r, tensors):  # rank r's (params, grads, AdamW state less its step)
        return self[r].params, self[r].grads, self[r].optimizer - 4 * tensors

    def numel(self, *parts):  # the parameters whose names contain one of `parts`
        return sum(n for name, n in self.sizes.items() if any(part in name for part in parts))

    def also(self, *flags, script=None):  # another layout: these flags added, or another script
        return layout(script or self.script, self.N, tuple(self.flags) + flags)

    def wire(self, key, r=0):
        """The bytes a ring moves for what rank r hands collective `key`: plan_report.RING's factor at the size of
        its group (world, tp, cp: this layout's)."""
        collective, group = key.split("@")
        return RING[collective]({"world": self.N, "tp": self.tp, "cp": self.cp}[group]) * self.comm(key, r)

    def held(self, stage):
        """(elements, tensors) a rank of `stage` updates: its parameters (1/tp of each but REPLICATED), and on the
        last stage of several the head's copy of wte (1/tp, split by vocabulary as wte)."""
        names = [name for name in self.sizes if on_stage(name, self.pp, self.L) == stage]
        numel = sum(self.sizes[n] // (1 if any(part in n for part in REPLICATED) else self.tp) for n in names)
        copy = stage == self.pp - 1 and self.pp > 1
        return numel + copy * self.vocab * self.C // self.tp, len(names) + copy

    def owned(self):
        """zero3_train.py's greedy partition: each rank's (elements, tensors) owned; the elements are P_own."""
        owner, load = partition([(name, (n,)) for name, n in self.sizes.items()], self.N)
        return [(load[r], list(owner.values()).count(r)) for r in range(self.N)]

    def experts(self):
        """EP: (Pd, Pe, the non-expert tensors and the experts' stacked ones: one a layer and projection)."""
        expert = {name: n for name, n in self.sizes.items() if ".experts." in name}
        stacked = {(name.split(".experts.")[0], name.split(".experts.")[1].split(".", 1)[1]) for name in expert}
        return self.P - sum(expert.values()), sum(expert.values()), len(self.sizes) - len(expert) + len(stacked)


@functools.lru_cache
def layout(script, N, flags):
    return Layout(script, N, flags)


PP = ["--n_layer", "8", "--n_microbatches", "4"]  # pp: 4 blocks a stage at 2 ranks
HYBRID = ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2", "--context_parallel_size", "2",
          "--grad_accum_steps", "2"]  # dp 1 x pp 2 x cp 2 x tp 2: stage 0 on ranks 0-3, stage 1 on 4-7
STAGE = [0, 4]  # the hybrid layout's first rank of each stage
A2 = ["--grad_accum_steps", "2"]  # where a phrase says per step, or per micro-step
TP2 = ["--tensor_parallel_size", "2"]  # DP 2 x TP 2
CP4 = ["--context_parallel_size", "4"]  # CP 4, ring (its default)
EP2 = ["--data_parallel_size", "2"]  # EP 2 x DP 2
R2 = ["--replicate_size", "2"]  # HSDP: 2 replicas x S = 2 shards

# (where the phrase is, the phrase, ranks, flags, the claim: m -> (the plan's figure, the phrase's formula), and where
# the phrase says "about", the slack it allows). Figures may be tuples, lists or dicts, compared item by item.
CLAIMS = [
    ("ddp_train.py", "memory per rank: 16P bytes (fp32 params 4P + grads 4P + AdamW state 8P)", 4, [],
     lambda m: (m.parts(0, len(m.sizes)), (4 * m.P, 4 * m.P, 8 * m.P))),
    ("ddp_train.py", "one all-reduce of the 4P gradient bytes per step", 4, A2,
     lambda m: (m[0].comm, {"all_reduce@world": 4 * m.P})),
    ("ddp_train.py", "a ring all-reduce sends about 2(N-1)/N x 4P bytes per rank", 4, [],  # about: a float, exact
     lambda m: (m.wire("all_reduce@world"), 2 * (m.N - 1) / m.N * 4 * m.P, 1e-6)),

    # fsdp: a unit (a block, the root) pads to a multiple of N, up to N-1 elements more a unit (none here), an
    # AdamW step a unit
    ("fsdp_train.py", "memory per rank: 16P/N bytes (params, grads, AdamW state: all sharded)", 4, [],
     lambda m: (m.state(0, m.L + 1), 16 * m.P / m.N, 16 * (m.N - 1) * (m.L + 1))),
    # the root (wte, wpe, ln_f) stays gathered through backward; what the plan hands an all-gather is the shard
    ("fsdp_train.py", "all-gather 4P (forward), all-gather 4P_blocks (backward), reduce-scatter 4P of gradients", 4, [],
     lambda m: ((m.N * m.comm("all_gather@world"), m.comm("reduce_scatter@world")),
                (4 * m.P + 4 * m.numel(".h."), 4 * m.P), 4 * (m.N - 1) * (2 * m.L + 1))),
    ("fsdp_train.py", "each (N-1)/N of them per rank: <1.5x DDP's all-reduce", 4, [],  # 1 + P_blocks/2P < 1.5
     lambda m: ((m.wire("all_gather@world") + m.wire("reduce_scatter@world"), m.wire("all_gather@world")
                 + m.wire("reduce_scatter@world") < 1.5 * m.also(script="ddp_train.py").wire("all_reduce@world")),
                ((m.N - 1) / m.N * (4 * m.P + 4 * m.numel(".h.") + 4 * m.P), True), 1e-6)),
    ("fsdp_train.py", "Accumulation reduce-scatters every micro-step (A x that, but 4P/N gradient bytes held, not 4P)",
     4, A2, lambda m: ((m[0].comm, m[0].grads), ({key: n * (m.A if key != "all_reduce@world" else 1)  # the clip's
                                                   for key, n in m.also("--grad_accum_steps", "1")[0].comm.items()},
                                                  4 * m.P / m.N))),
    ("docs/fsdp.md", "4P/N bytes of gradient held, for A x the reduce-scatter traffic", 4, A2,
     lambda m: ((m[0].grads, m.comm("reduce_scatter@world")), (4 * m.P / m.N, m.A * 4 * m.P))),
    *[(source, phrase, 4, [], lambda m: (m.also("--dtype", "bfloat16")[0].comm,
                                         {**m[0].comm, "all_gather@world": m.comm("all_gather@world") // 2}))
      for source, phrase in [("fsdp_train.py", "--dtype bfloat16 gathers bf16 (half the bytes), reduce-scatters fp32."),
                             ("docs/fsdp.md", "gathers bf16 parameters (half the all-gather bytes) and reduce-scatters "
                                              "fp32 gradients")]],
    # ddp_diloco (tier 2): DDP's state, θ_outer and its momentum; the pseudo-gradient's all-reduce every H steps
    ("ddp_diloco_train.py", "memory per rank: 24P bytes: fp32 params 4P + grads 4P + AdamW state 8P, as DDP's, + "
     "θ_outer 4P + its momentum 4P", 4, [], lambda m: (m.state(0, len(m.sizes)), 24 * m.P)),
    ("ddp_diloco_train.py", "one all-reduce of the 4P pseudo-gradient bytes every H steps, H times fewer bytes than "
     "DDP's gradients", 4, ["--inner_steps", "5"],
     lambda m: ((m.comm("all_reduce@world"), layout("ddp_train.py", m.N, ()).comm("all_reduce@world") / 5),
                (4 * m.P / 5, 4 * m.P / 5), 1)),
    # fsdp_hsdp (tier 2): fsdp's figures over S = N/R ranks, and the shard's all-reduce across the R replicas
    ("fsdp_hsdp_train.py", "memory per rank: 16P/S bytes (params, grads, AdamW state sharded S ways)", 4, R2,
     lambda m: (m.state(0, m.L + 1), 16 * m.P / 2, 16 * (m.L + 1))),
    ("fsdp_hsdp_train.py", "all-gather 4P (forward), all-gather 4P_blocks (backward), reduce-scatter 4P of gradients, "
     "each (S-1)/S of them per rank, every micro-step", 4, R2 + A2,
     lambda m: ((2 * m.comm("all_gather@shard"), m.comm("reduce_scatter@shard")),
                (m.A * (4 * m.P + 4 * m.numel(".h.")), m.A * 4 * m.P), 4 * m.A * (2 * m.L + 1))),
    ("fsdp_hsdp_train.py", "one all-reduce of the 4P/S gradient shard per step", 4, R2 + A2,
     lambda m: (m.comm("all_reduce@replicate"), 4 * m.P / 2, 4 * (m.L + 1))),

    # zero3 (--stage 3 unless said): P_own, and the tensors owned, from the script's greedy partition
    ("zero3_train.py", "no rank owns more than P/N + the largest tensor", 4, [],
     lambda m: (max(own for own, _ in m.owned()) <= m.P / m.N + max(m.sizes.values()), True)),
    ("docs/zero3.md", "so no rank owns more than P/N + the largest tensor.", 4, [],  # and every tensor one owner
     lambda m: (sum(own for own, _ in m.owned()), m.P)),
    *[(source, phrase, 4, ["--stage", stage], lambda m, kept=kept: (
        [m.parts(r, k) for r, (_, k) in enumerate(m.owned())], [kept(m, own) for own, _ in m.owned()]))
      for source, phrase, stage, kept in [
          ("zero3_train.py", "stage 1: 4P params + 4P grads + 8P_own.", "1",
           lambda m, own: (4 * m.P, 4 * m.P, 8 * own)),
          ("docs/zero3.md", "| 1 | 4P | 4P | 8P_own |", "1", lambda m, own: (4 * m.P, 4 * m.P, 8 * own)),
          ("zero3_train.py", "stage 2: 4P params + 4P_own grads + 8P_own", "2",
           lambda m, own: (4 * m.P, 4 * own, 8 * own)),
          ("docs/zero3.md", "| 2 | 4P | 4P_own | 8P_own |", "2", lambda m, own: (4 * m.P, 4 * own, 8 * own)),
          ("zero3_train.py", "stage 3: 16P_own (its params, grads, AdamW state)", "3",
           lambda m, own: (4 * own, 4 * own, 8 * own)),
          ("docs/zero3.md", "| 3 | 4P_own | 4P_own | 8P_own |", "3", lambda m, own: (4 * own, 4 * own, 8 * own))]],
    # + 4: clip_grad_norm_'s sum of squares, which no docstring counts
    ("zero3_train.py", "stage 1: the gradients' flat buffers all-reduced after the step's last backward, as DDP's "
     "(4P); AdamW steps the owned tensors only, then each owner broadcasts them (4P, one message", 4,
     ["--stage", "1", *A2],
     lambda m: (m[0].comm, {"all_reduce@world": 4 * m.P + 4, "broadcast@world": 4 * m.P})),
    ("zero3_train.py", "on every micro-step (A x 4P); a non-owner drops it once the reduce is waited for. "
     "Then stage 1's broadcasts (4P).", 4, ["--stage", "2", *A2],
     lambda m: (m[0].comm, {"reduce@world": m.A * 4 * m.P, "broadcast@world": 4 * m.P, "all_reduce@world": 4})),
    ("docs/zero3.md", "reduces every gradient to its owner on every micro-step (A x 4P)", 4, ["--stage", "2", *A2],
     lambda m: (m.comm("reduce@world"), m.A * 4 * m.P)),
    ("zero3_train.py", "per micro-step 2 broadcasts + 1 reduce of 4P, less one broadcast of wpe (a lookup's backward "
     "reads no weight) and of the tied wte.", 4, A2,
     lambda m: (m[0].comm, {"broadcast@world": m.A * (2 * 4 * m.P - 4 * m.wpe - 4 * m.wte),
                            "reduce@world": m.A * 4 * m.P, "all_reduce@world": 4})),
    ("docs/zero3.md", "2 broadcasts + 1 reduce of 4P, less the backward broadcast of wpe", 4, [],
     lambda m: ((m.comm("broadcast@world"), m.comm("reduce@world")), (8 * m.P - 4 * m.wpe - 4 * m.wte, 4 * m.P))),
    *[(source, phrase, 4, [], lambda m: (m.also("--dtype", "bfloat16").comm("broadcast@world"),
                                         m.comm("broadcast@world") // 2))
      for source, phrase in [("zero3_train.py", "Stage 3 computes with bf16 parameters, broadcast in bf16 (2P bytes)"),
                             ("docs/zero3.md", "(2P bytes instead of 4P)")]],

    # tp: 16P/tp_size of the shards plus the replicated tensors whole is exact; the docs' "about" leaves those out:
    # 0.2% of P on the small preset
    ("tp_train.py", "memory per rank: about 16P/tp_size bytes (fp32 param + grad + AdamW state of this rank's shards, "
     "plus the small replicated LayerNorms, row-parallel biases and wpe)", 4, TP2,
     lambda m: (m.state(0, len(m.sizes)), 16 * ((m.P - m.numel(*REPLICATED)) / m.tp + m.numel(*REPLICATED)))),
    ("docs/tp.md", "Memory per rank: about 16P/tp bytes", 4, TP2,
     lambda m: (m.state(0, len(m.sizes)), 16 * m.P / m.tp, 16 * m.numel(*REPLICATED))),
    # all-reduced: 2 g's and 2 f's a block, the embedding's g and lm_head's f, each 4BTC (B = b: M is 1); the loss's
    # B*T and 2B*T (--loss_parallel, the default); + 4, the clip's
    *[(source, phrase, 4, TP2,
       lambda m: (m.comm("all_reduce@tp"), 4 * m.b * m.T * m.C * (2 * m.L + 2 * m.L + 1 + 1) + 4 * 3 * m.b * m.T + 4))
      for source, phrase in [
          ("tp_train.py", "2 of each per block, each about 2(tp_size-1)/tp_size x 4BTC bytes sent per rank"),
          ("docs/tp.md", "2L g's in forward and 2L f's in backward, plus the embedding's g, the f in front of lm_head "
                         "and the loss's two small all-reduces")]],
    ("tp_train.py", "--loss_parallel's loss all-reduces B*T, then 2B*T numbers", 4, TP2,
     lambda m: (m.comm("all_reduce@tp") - m.also("--loss_parallel", "false").comm("all_reduce@tp"), 4 * 3 * m.b * m.T)),
    # SP: the ring bytes of the f's and g's all-gathers and reduce-scatters are the all-reduces'; the all-reduce left
    # sums the replicated tensors' gradients, and the loss's and the clip's
    ("tp_train.py", "each all-reduce becomes a reduce-scatter after row-parallel and an all-gather before "
     "column-parallel, the same bytes; the replicas' partial gradients are summed over TP after backward.", 4,
     [*TP2, "--sequence_parallel"],
     lambda m: ((m.wire("all_gather@tp") + m.wire("reduce_scatter@tp"), m.comm("all_reduce@tp")),
                (m.also("--sequence_parallel", "false").wire("all_reduce@tp") - RING["all_reduce"](m.tp) * (
                    4 * 3 * m.b * m.T + 4), 4 * m.numel(*REPLICATED) + 4 * 3 * m.b * m.T + 4))),
    ("docs/tp.md", "the all-reduce becomes a reduce-scatter plus an all-gather: the same bytes", 4,
     [*TP2, "--sequence_parallel"],
     lambda m: (m.wire("all_gather@tp") + m.wire("reduce_scatter@tp"), m.also("--sequence_parallel", "false")
                .wire("all_reduce@tp") - RING["all_reduce"](m.tp) * (4 * 3 * m.b * m.T + 4))),

    # cp, per layer: K,V 2BTC/cp numbers (B = b: one DP rank, M is 1); the ring's sends are the plan's, the
    # collectives' what a ring moves for what the plan hands them (RING)
    ("cp_train.py", "allgather all-gather K,V: (cp-1) x 2BTC/cp numbers; backward all-gathers them again (it saves "
     "only its own) and reduce-scatters dK,dV: 2 x (cp-1) x 2BTC/cp.", 4, [*CP4, "--cp_mode", "allgather"],
     lambda m: (m.wire("all_gather@cp") + m.wire("reduce_scatter@cp"),
                m.L * 4 * ((m.cp - 1) + 2 * (m.cp - 1)) * 2 * m.b * m.T * m.C / m.cp, 1e-6)),
    *[(source, phrase, 4, CP4,
       lambda m: (m.comm("send@cp"), m.L * 4 * ((m.cp - 1) + (2 * m.cp - 1)) * 2 * m.b * m.T * m.C // m.cp))
      for source, phrase in [
          ("cp_train.py", "ring K,V blocks of 2BTC/cp go round the ring, cp-1 sends"),
          ("cp_train.py", "cp sends as it starts at home and returns: (2cp-1) x 2BTC/cp."),
          ("docs/cp.md", "backward sends (2cp-1) blocks of 2BTC/cp numbers a layer, the accumulators in fp32")]],
    ("cp_train.py", "fp32 (4 bytes a number; bf16 K/V: 2)", 4, [*CP4, "--dtype", "bfloat16"],  # dK,dV: fp32
     lambda m: (m.comm("send@cp"), m.L * (2 * (m.cp - 1) + 2 * (m.cp - 1) + 4 * m.cp) * 2 * m.b * m.T * m.C // m.cp)),
    ("cp_train.py", "ulysses all-to-all q,k,v from sequence shards to head shards (full sequence, n_head/cp heads) "
     "and the output back: (cp-1)/cp x 4BTC/cp numbers; the same in backward.", 4, [*CP4, "--cp_mode", "ulysses"],
     lambda m: (m.wire("all_to_all@cp"), m.L * 4 * 2 * (m.cp - 1) / m.cp * 4 * m.b * m.T * m.C / m.cp, 1e-6)),

    # pp: "about 16P/pp_size": the blocks split evenly, wte and wpe on the first rank, ln_f on the last (wte is 89% of
    # P on the small preset): each rank's exactly, and over the ranks 16P and the copy
    ("pp_train.py", "memory per rank: about 16P/pp_size (fp32 params + grads + AdamW), plus a copy of the tied wte "
     "(lm_head) on the last rank", 2, PP,
     lambda m: ([m.state(r, m.held(r)[1]) for r in range(m.pp)], [16 * m.held(r)[0] for r in range(m.pp)])),
    ("pp_train.py", "memory per rank: about 16P/pp_size (fp32 params + grads + AdamW), plus a copy of the tied wte "
     "(lm_head) on the last rank", 2, PP,
     lambda m: (sum(m.state(r, m.held(r)[1]) for r in range(m.pp)), m.pp * 16 * m.P / m.pp + 16 * m.vocab * m.C)),
    # b = micro/M, n_stages = pp_size * V; summed over the ranks, a message a send
    *[("pp_train.py", "each micro-batch's activation (micro/M x T x C fp32) goes to the next stage and its gradient "
       "comes back: 2*M*(n_stages-1) messages a micro-step", N, [*PP, *A2, *flags],
       lambda m: (sum(m.comm("send@pp", r) for r in range(m.N)),
                  m.A * 2 * m.M * (m.pp * m.V - 1) * 4 * m.b * m.T * m.C))
      for N, flags in [(2, []), (4, []), (2, ["--schedule", "interleaved"])]],
    ("pp_train.py", "a step's all-reduce of the tied wte/lm_head gradient (4*vocab*C bytes), 2 ranks.", 4, PP,
     lambda m: ([m.comm("all_reduce@tied", r) for r in range(m.N)], [4 * m.vocab * m.C, 0, 0, 4 * m.vocab * m.C])),
    # the bubble, from the plan's timetable of equal stages (floats: the same ratio, divided another way)
    *[(source, phrase, N, ["--n_layer", "8", "--n_microbatches", str(M), "--schedule", schedule],
       lambda m, bubble=bubble: ([rank.bubble for rank in m.ranks], [bubble(m.pp, m.M, m.V)] * m.pp, 1e-12))
      for source, N, M in [("pp_train.py", 2, 4), ("pp_train.py", 4, 8), ("docs/pp.md", 4, 8)]
      for phrase, schedule, bubble in {
          "pp_train.py": [
              ('the "bubble") (pp_size-1)/(M+pp_size-1) of a step', "gpipe", lambda p, M, V: (p - 1) / (M + p - 1)),
              ('the "bubble") (pp_size-1)/(M+pp_size-1) of a step', "1f1b", lambda p, M, V: (p - 1) / (M + p - 1)),
              ("a bubble of (pp_size-1)/(V*M+pp_size-1)", "interleaved", lambda p, M, V: (p - 1) / (V * M + p - 1))],
          "docs/pp.md": [
              *[("a rank idles (p-1)/(m+p-1) of a step in GPipe and 1F1B", schedule,
                 lambda p, m, V: (p - 1) / (m + p - 1)) for schedule in ("gpipe", "1f1b")],
              ("and (p-1)/(Vm+p-1) interleaved", "interleaved", lambda p, m, V: (p - 1) / (V * m + p - 1))]}[source]],

    # ep: EP 2 x DP 2; a rank's N*k slots: b rows of T tokens, k experts each, at balanced routing (as the plan counts)
    *[(source, phrase, 4, EP2,
       lambda m: ((m.state(0, m.experts()[2]), m.also("--implementation", "pytorch").state(0, len(m.sizes))),
                  (16 * (m.experts()[0] + m.experts()[1] / m.EP), 16 * m.P)))
      for source, phrase in [
          ("ep_train.py", "memory per rank: 16 bytes a parameter (fp32 params, grads, AdamW) of the Pd "
                          "non-expert ones, and of Pe/EP of the Pe expert ones (torch DDP holds all Pe on every rank)"),
          ("docs/ep.md", "Memory per rank: 16 bytes a parameter (fp32 parameter, gradient, AdamW's two moments) for "
                         "the Pd non-expert parameters and for Pe/EP of the Pe expert parameters, against 16(Pd + Pe) "
                         "under DDP.")]],
    ("ep_train.py", "per MoE layer and micro-step, the counts (8E bytes) and the rows (N*k rows of C values out, as "
     "many back in all; again in backward)", 4, [*EP2, *A2],
     lambda m: (m.comm("all_to_all@ep"), m.L * m.A * (8 * m.E + 4 * m.b * m.T * m.k * m.C * 4))),
    ("docs/ep.md", "2 (N·k + R) · C · s bytes of rows", 4, [*EP2, *A2, "--dtype", "bfloat16"],  # R = N·k, s = 2
     lambda m: (m.comm("all_to_all@ep"), m.L * m.A * (8 * m.E + 2 * (2 * m.b * m.T * m.k) * m.C * 2))),
    ("ep_train.py", "then per step the 4Pd non-expert gradient bytes all-reduced over all ranks", 4, [*EP2, *A2],
     lambda m: (m.comm("all_reduce@world"), 4 * m.experts()[0])),
    ("ep_train.py", "the 4Pe/EP expert gradient bytes over each shard's replicas. Torch DDP all-reduces 4(Pd + Pe).",
     4, EP2, lambda m: ((m.comm("all_reduce@replica"), m.also("--implementation", "pytorch")[0].comm),
                        (4 * m.experts()[1] / m.EP, {"all_reduce@world": 4 * m.P}))),
    ("docs/ep.md", "one all-reduce of 4Pd bytes over all N ranks and, with replicas, one of 4Pe/EP bytes over each "
     "column. Torch DDP all-reduces the whole 4(Pd + Pe) every step", 4, EP2,
     lambda m: ((m.comm("all_reduce@world"), m.comm("all_reduce@replica"),
                 m.also("--implementation", "pytorch").comm("all_reduce@world")),
                (4 * m.experts()[0], 4 * m.experts()[1] / m.EP, 4 * m.P))),

    # hybrid: A*M micro-batches a step of b rows, T/cp positions, L/pp blocks a stage. "about P/(tp*pp)" is what the
    # list after it makes exact, stage by stage: pp's "about", with TP's shards
    ("hybrid_train.py", "model state 16 bytes a parameter (param, grad, AdamW's two moments) of about P/(tp*pp): its "
     "stage's TP shards, the replicated LayerNorms, wpe and row-parallel biases, and on the last stage (pp > 1) the "
     "head's copy of wte's vocab/tp rows.", 8, HYBRID,
     lambda m: ([m.state(r, m.held(s)[1]) for s, r in enumerate(STAGE)], [16 * m.held(s)[0] for s in range(m.pp)])),
    ("docs/hybrid.md", "Beyond the docstring's 16 bytes a parameter of model state, AdamW's step adds 4 bytes a "
     "tensor.", 8, HYBRID,
     lambda m: ([m[r].model_state for r in STAGE], [16 * m.held(s)[0] + 4 * m.held(s)[1] for s in range(m.pp)])),
    ("hybrid_train.py", "tp per block and micro-batch 2 all-reduces of b*T/cp*C numbers forward, 2 backward (SP: an "
     "all-gather or reduce-scatter each, the same bytes); the embedding adds 1 forward; the head 1 backward and the "
     "loss all-reduces of b*T/cp and 2b*T/cp.", 8, HYBRID,
     lambda m: ([m.comm("all_reduce@tp", r) for r in STAGE],
                [m.A * m.M * 4 * (m.b * m.T // m.cp * m.C * (4 * m.L // m.pp + (s == 0) + (s == m.pp - 1))
                                  + (s == m.pp - 1) * 3 * m.b * m.T // m.cp) for s in range(m.pp)])),
    ("hybrid_train.py", "(SP: an all-gather or reduce-scatter each, the same bytes)", 8,
     [*HYBRID, "--sequence_parallel"],
     lambda m: ([m.wire("all_gather@tp", r) + m.wire("reduce_scatter@tp", r) for r in STAGE],  # the loss's aside
                [m.also("--sequence_parallel", "false").wire("all_reduce@tp", r) - RING["all_reduce"](m.tp) * m.A * m.M
                 * 4 * 3 * m.b * m.T // m.cp * (s == m.pp - 1) for s, r in enumerate(STAGE)], 1e-6)),
    ("hybrid_train.py", "cp per block and micro-batch cp-1 ring sends of K, V (2b*T/cp*C/tp numbers) forward, 2cp-1 "
     "backward (K, V again, and the dK, dV accumulators: cp hops).", 8, HYBRID,
     lambda m: ([m.comm("send@cp", r) for r in STAGE], [m.A * m.M * m.L // m.pp * 4 * ((m.cp - 1) + (2 * m.cp - 1))
                                                        * 2 * m.b * m.T // m.cp * m.C // m.tp] * m.pp)),
    *[("hybrid_train.py", "pp per micro-batch an activation forward and its gradient back: b*T/cp*C (SP: /tp).", 8,
       [*HYBRID, *flags], lambda m, sp=sp: (sum(m.comm("send@pp", r) for r in STAGE),  # a send a stage boundary
                                            m.A * m.M * 2 * (m.pp - 1) * 4 * m.b * m.T // m.cp * m.C // m.tp ** sp))
      for flags, sp in [([], 0), (["--sequence_parallel"], 1)]],
    ("hybrid_train.py", "dp x cp one all-reduce of the stage's gradients a step (4 bytes a local parameter).", 8,
     HYBRID,
     lambda m: ([m.comm("all_reduce@dpxcp", r) for r in STAGE], [4 * m.held(s)[0] for s in range(m.pp)])),
    ("hybrid_train.py", "pp ends one all-reduce of the tied gradient a step: vocab/tp*C numbers (pp > 1).", 8,
     ["--pipeline_parallel_size", "4", "--tensor_parallel_size", "2"],  # 4 stages, the middle ones none
     lambda m: ([m.comm("all_reduce@tied", r) for r in (0, 2, 4, 6)],
                [4 * m.vocab // m.tp * m.C, 0, 0, 4 * m.vocab // m.tp * m.C])),
]


def close(planned, stated, slack):
    """planned equals stated item by item (dicts: with the same keys), each within slack."""
    if isinstance(planned, dict):
        return planned.keys() == stated.keys() and all(close(planned[k], stated[k], slack) for k in planned)
    if isinstance(planned, (list, tuple)):
        return len(planned) == len(stated) and all(close(p, s, slack) for p, s in zip(planned, stated))
    return abs(planned - stated) <= slack


def test_every_tier1_script_has_claims():
    """The table reads each tier-1 script's docstring (and those of the tier-2 scripts that state their own
    figures), and pages that exist."""
    scripts = {source for source, *_ in CLAIMS if source.endswith(".py")}
    tier1 = {f"{name}_train.py" for name in ("ddp", "fsdp", "zero3", "tp", "cp", "pp", "ep", "hybrid")}
    assert tier1 <= scripts and all(script.endswith("_train.py") for script in scripts)
    assert all((ROOT / source).is_file() for source, *_ in CLAIMS)


@pytest.mark.parametrize("source, phrase, N, flags, claim", CLAIMS,
                         ids=[f"{source}:{phrase[:40]}" for source, phrase, *_ in CLAIMS])
def test_the_stated_figure_is_the_plans(source, phrase, N, flags, claim):
    """The text still states the phrase, word for word, and plan.py's figure at the layout is the phrase's formula:
    exactly, or within the slack its "about" allows."""
    still = words(phrase) in words(stated_text(source))
    assert still, f"{source} no longer states: {phrase}"
    script = source if source.endswith(".py") else pathlib.Path(source).stem + "_train.py"
    planned, stated, *slack = claim(layout(script, N, tuple(flags)))
    assert close(planned, stated, slack[0] if slack else 0), f"{source}: {phrase}\nplan: {planned}\nstated: {stated}"
