"""The shared loss-parity test: every (strategy, implementation) equals single-process training.

Each row of STRATEGIES runs under torchrun; its per-step logged losses and pre-clip grad norms, and its
evaluations (train and val loss before the first step and at the end), are compared with
  1. the single-process reference, `python ddp_train.py` with the same flags (`python ep_train.py` for a mixture
     of experts), and
  2. an independent plain-PyTorch loop written below from common.model and common.data only.
The config is small, fp32, dropout 0, 15 steps at a stable learning rate: longer runs are chaotic
(after a loss spike even 1- and 2-thread single-process runs drift apart by 0.1 by step 40).
The grad norm matters as much as the loss: AdamW is invariant to the gradient's scale (apart from eps) and every
step clips (the norms are above 1), so a gradient N times off trains to the same losses; only its norm shows it.
Each row's largest differences are printed and appended to out/parity.jsonl.
The rows of AS_USERS_TORCH, one or more for each script and implementation, run as our users' torch does
(tests/user_torch.py): AdamW on its fused path, the scripts' own, counted, and the project's code without torch 2.13's
collective names (tests/test_torch_versions.py).
"""
import fcntl
import json
import math
import os
import re
import threading

import pytest
import torch

from conftest import (ONE_PROCESS_THREADS, PARITY, PARITY_EVAL_ITERS, PARITY_STEPS, REPO, TINY, TP_DROPOUT,
                      TP_DROPOUT_STEPS, assert_alone_is_batched_prefix, finite, paired, peer_needs, run_record,
                      runs_here, tp_dropout_args, worst)
from common.data import get_batch
from common.model import GPT, GPTConfig

STEPS = PARITY_STEPS
FLAGS = PARITY + ["--max_iters", str(STEPS)]  # TINY, lr 1e-3 -> 1e-4, 5 warmup steps, seed 1337 (conftest)
TOL = 1e-5  # fp32 on CPU, on every loss and evaluation; the largest |dloss| measured here is printed by each row
# The pre-clip grad norm, relative: the same gradient summed in another order (buckets, shards, ranks, the
# pipeline's stages); measured here: at most 2.1e-7 over every row (cp allgather at block 24 against the plain
# loop), so a margin of about 5, as TOL's over the largest |dloss| measured, 1.9e-6 (pp interleaved); every row's
# figures: docs/benchmarks/cpu-2core_2026-11-28.md. A gradient off by a factor (a sum where a mean belongs: 2x at 2
# ranks) is off by that factor in its norm.
NORM_TOL = 1e-6
# tp_overlap_train.py against tp_train.py, relative to the loss: the same sums in another order, so the last bits
# differ (a loss near 10 has a float32 spacing of 9.5e-7; the most measured at 4 ranks is 2 of them)
OVERLAP_TOL = 1e-6
# --compile: inductor's fused kernels may sum in another order than eager's (ddp and fsdp: the blocks and the
# head, the loss included, fsdp with full checkpointing; tp: the blocks between their eager linears and attention,
# with selective checkpointing); measured here: |dloss| at most 9.5e-7 and the grad norm at most 2.0e-7 relative
# over the 15 steps, as eager's rows; the compiled tp row with dropout (the AC test) equals eager's bit for bit.
# So the eager tolerances hold. Each compiled row shares the launch of its script's other rows at 2 ranks (a cold
# compile costs tens of seconds, a launch's start-up 7).
COMPILE_TOL = TOL

# One row per (script, implementation, ranks, extra flags). Later strategies add their rows here.
# Extra flags in MODEL_FLAGS also go to the reference and the plain loop (see below).
STRATEGIES = [
    # cp (--implementation pytorch needs CUDA): every mode at cp=2, ring with zigzag (default), allgather at
    # block 24 (T/cp = 12, zigzag chunks of 6: not powers of two), Ulysses; DP 2 x CP 2 with 2 micro-steps on
    # the contiguous split (--load_balance false)
    ("cp_train.py", "custom", 2, []),
    ("cp_train.py", "custom", 2, ["--cp_mode", "allgather", "--block_size", "24"]),
    ("cp_train.py", "custom", 2, ["--cp_mode", "ulysses"]),
    ("cp_train.py", "custom", 4, ["--context_parallel_size", "2", "--grad_accum_steps", "2", "--load_balance", "false"]),
    # pp: every schedule custom + pytorch at 2 stages (interleaved: 2 x 2 chunks of 1 layer), each custom one also
    # with the head split over the ranks (pp_vocab_train.py --vocab_parallel), 1F1B at 4 stages with it; uneven
    # stages 2,1 in GPipe (custom, pytorch) and 1F1B with accumulation
    ("pp_train.py", "custom", 2, ["--schedule", "gpipe", "--n_layer", "3", "--stage_layers", "2,1"]),
    ("pp_vocab_train.py", "custom", 2, ["--schedule", "gpipe", "--vocab_parallel"]),
    ("pp_train.py", "pytorch", 2, ["--schedule", "gpipe", "--n_layer", "3", "--stage_layers", "2,1"]),
    ("pp_train.py", "custom", 2, ["--schedule", "1f1b", "--grad_accum_steps", "2", "--n_layer", "3",
                                  "--stage_layers", "2,1"]),
    ("pp_vocab_train.py", "custom", 2, ["--schedule", "1f1b", "--vocab_parallel", "--grad_accum_steps", "2"]),
    ("pp_train.py", "pytorch", 2, ["--schedule", "1f1b", "--grad_accum_steps", "2"]),
    ("pp_train.py", "custom", 2, ["--schedule", "interleaved", "--n_layer", "4"]),
    ("pp_vocab_train.py", "custom", 2, ["--schedule", "interleaved", "--n_layer", "4", "--vocab_parallel"]),
    ("pp_train.py", "pytorch", 2, ["--schedule", "interleaved", "--n_layer", "4"]),
    ("pp_vocab_train.py", "custom", 4, ["--schedule", "1f1b", "--n_layer", "4", "--vocab_parallel"]),
    # (the zero-bubble schedules, pp_zb_train.py: test_zero_bubble_parity below, several runs a launch)
    # zero3: default (all partitioned); 4 ranks with biases/LayerNorms persistent (zero3_tuning_train.py's knob),
    # accumulation, no prefetch.
    # (PyTorch's FSDP2, the peer of both fsdp and zero3, runs at 2 ranks in three rows: with accumulation in fsdp's.)
    # ep: a mixture of 4 experts, top 2, sharded over 2 ranks with accumulation; torch DDP holding every expert;
    # EP 2 x DP 2 (expert gradients all-reduced over their replica pair). tests/test_ep.py: forced routing, bf16,
    # the ledgers, resume.
    ("ep_train.py", "custom", 2, ["--n_experts", "4", "--top_k", "2", "--grad_accum_steps", "2"]),
    ("ep_train.py", "pytorch", 2, ["--n_experts", "4", "--top_k", "2"]),
    ("ep_train.py", "custom", 4, ["--n_experts", "4", "--top_k", "2", "--data_parallel_size", "2"]),
    ("zero3_train.py", "custom", 2, []),
    ("zero3_train.py", "pytorch", 2, []),
    ("zero3_tuning_train.py", "custom", 4, ["--persistence_threshold", "1024", "--grad_accum_steps", "2",
                                            "--prefetch", "false"]),
    # zero3 --stage 1/2: ZeRO-1 custom and DDP + ZeroRedundancyOptimizer (with accumulation), ZeRO-2 at 2 and 4 ranks
    ("zero3_train.py", "custom", 2, ["--stage", "1"]),
    ("zero3_train.py", "pytorch", 2, ["--stage", "1", "--grad_accum_steps", "2"]),
    ("zero3_train.py", "custom", 2, ["--stage", "2"]),
    ("zero3_train.py", "custom", 4, ["--stage", "2", "--grad_accum_steps", "2"]),
    # tp: TP=2 (SP off, loss_parallel on); TP=2 SP on + loss_parallel off; 2D DP 2 x TP 2, SP on, 2 micro-steps
    ("tp_train.py", "custom", 2, []),
    ("tp_train.py", "pytorch", 2, []),
    ("tp_train.py", "custom", 2, ["--sequence_parallel", "--loss_parallel", "false"]),
    ("tp_train.py", "pytorch", 2, ["--sequence_parallel", "--loss_parallel", "false"]),
    ("tp_train.py", "custom", 4, ["--tensor_parallel_size", "2", "--sequence_parallel", "--grad_accum_steps", "2"]),
    ("tp_train.py", "pytorch", 4, ["--tensor_parallel_size", "2", "--sequence_parallel", "--grad_accum_steps", "2"]),
    # compiled between f and g, the attention core recomputed (as fsdp's compiled row: with checkpointing)
    ("tp_train.py", "custom", 2, ["--sequence_parallel", "--compile", "--activation_checkpointing", "selective"]),
    # tp at 4 (the ring of 4), and tp_overlap_train.py (--tp_overlap on) at 2 and 4 ranks, SP off and on: each
    # overlap row also equals tp_train.py's row with the same flags within OVERLAP_TOL (test_tp_overlap_equals_plain_tp)
    ("tp_train.py", "custom", 4, ["--tensor_parallel_size", "4"]),
    ("tp_train.py", "custom", 4, ["--tensor_parallel_size", "4", "--sequence_parallel"]),
    *[("tp_overlap_train.py", "custom", nproc, extra) for nproc, extra in (
        (2, []), (2, ["--sequence_parallel", "--loss_parallel", "false"]),
        (4, ["--tensor_parallel_size", "4"]), (4, ["--tensor_parallel_size", "4", "--sequence_parallel"]))],
    # fsdp: 4 ranks with n_embd 25 pad every unit (blocks 7825 values: 3 pad, root 1258450: 2 pad), with
    # accumulation and deferred init
    ("fsdp_train.py", "custom", 2, []),
    ("fsdp_train.py", "pytorch", 2, []),
    ("fsdp_train.py", "custom", 4, ["--n_embd", "25", "--n_head", "5", "--grad_accum_steps", "2",
                                    "--deferred_init", "true"]),
    ("fsdp_train.py", "pytorch", 2, ["--grad_accum_steps", "2", "--reshard_after_forward", "false"]),
    # each block compiled, the unit hooks around it eager; each compiled block run again in backward
    ("fsdp_train.py", "custom", 2, ["--compile", "--activation_checkpointing", "full"]),
    # fsdp_hsdp_train.py: 2 replicas x 2 shards with accumulation (the replicas' all-reduce on the last micro-step),
    # custom and FSDP2 on a 2-D mesh; one replica, which is fsdp_train.py bit for bit (test_hsdp_of_one_replica_...)
    ("fsdp_hsdp_train.py", "custom", 4, ["--replicate_size", "2", "--grad_accum_steps", "2"]),
    ("fsdp_hsdp_train.py", "pytorch", 4, ["--replicate_size", "2", "--grad_accum_steps", "2"]),
    ("fsdp_hsdp_train.py", "custom", 2, []),
    ("fsdp_hsdp_train.py", "custom", 2, ["--replicate_size", "2"]),  # 2 replicas of a shard: the resume tests' run
    ("ddp_train.py", "custom", 2, []),
    ("ddp_train.py", "pytorch", 2, []),
    ("ddp_train.py", "custom", 2, ["--grad_accum_steps", "2"]),
    ("ddp_train.py", "pytorch", 2, ["--grad_accum_steps", "2"]),
    ("ddp_train.py", "custom", 2, ["--compile"]),  # each block and the head compiled (COMPILED below)
]


# (script, implementation, ranks, extra flags) of the rows run under tests/user_torch.py.
AS_USERS_TORCH = {
    ("cp_train.py", "custom", 2, ()), ("cp_train.py", "custom", 2, ("--cp_mode", "allgather", "--block_size", "24")),
    ("pp_train.py", "custom", 2, ("--schedule", "1f1b", "--grad_accum_steps", "2", "--n_layer", "3", "--stage_layers",
                                  "2,1")),
    ("pp_vocab_train.py", "custom", 2, ("--schedule", "1f1b", "--vocab_parallel", "--grad_accum_steps", "2")),
    ("pp_train.py", "pytorch", 2, ("--schedule", "1f1b", "--grad_accum_steps", "2")),
    ("zero3_train.py", "custom", 2, ()), ("zero3_train.py", "pytorch", 2, ()),
    ("zero3_train.py", "custom", 2, ("--stage", "1")),  # OwnedAdamW
    ("zero3_train.py", "pytorch", 2, ("--stage", "1", "--grad_accum_steps", "2")),  # inside ZeroRedundancyOptimizer
    ("zero3_train.py", "custom", 2, ("--stage", "2")),
    ("zero3_tuning_train.py", "custom", 4, ("--persistence_threshold", "1024", "--grad_accum_steps", "2",
                                            "--prefetch", "false")),  # its persistent tensors' all-reduce
    ("tp_train.py", "custom", 2, ()),
    ("tp_overlap_train.py", "custom", 2, ()),  # as tp_train.py's row, which it is compared with
    ("tp_train.py", "pytorch", 2, ()),  # without SP its LayerNorms and wpe were plain tensors: foreach refused them
    ("tp_train.py", "pytorch", 2, ("--sequence_parallel", "--loss_parallel", "false")),
    ("tp_train.py", "pytorch", 4, ("--tensor_parallel_size", "2", "--sequence_parallel", "--grad_accum_steps", "2")),
    ("fsdp_train.py", "custom", 2, ()), ("fsdp_train.py", "pytorch", 2, ()),  # ShardedAdamW; FSDP2
    ("fsdp_hsdp_train.py", "custom", 2, ()),  # as fsdp_train.py's row, which it equals bit for bit
    ("fsdp_hsdp_train.py", "pytorch", 4, ("--replicate_size", "2", "--grad_accum_steps", "2")),  # on a 2-D mesh
    ("ddp_train.py", "custom", 2, ()), ("ddp_train.py", "pytorch", 2, ()),
    ("ep_train.py", "custom", 2, ("--n_experts", "4", "--top_k", "2", "--grad_accum_steps", "2")),
    ("ep_train.py", "pytorch", 2, ("--n_experts", "4", "--top_k", "2")),
}


def row_id(script, implementation, nproc, extra):
    user = "-as_user" if (script, implementation, nproc, tuple(extra)) in AS_USERS_TORCH else ""
    return f"{script[:-9]}-{implementation}-{nproc}r{'-' + '-'.join(extra).replace('--', '') if extra else ''}{user}"


def plain_pytorch_run(steps=STEPS, lr_max=1e-3, lr_min=1e-4, warmup=5, seed=1337,
                      n_layer=2, n_head=4, n_embd=64, batch_size=8, block_size=32, n_experts=0, top_k=0):
    """The textbook loop, independent of every strategy script and of common.config: run_record's dict of its
    losses, pre-clip grad norms and evaluations (before the first step and after the last, as nanoGPT's)."""
    config = GPTConfig(block_size=block_size, vocab_size=50304, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                       dropout=0.0, bias=True, n_experts=n_experts, top_k=top_k,
                       expert_hidden=4 * n_embd // top_k if n_experts else 0)  # a mixture of experts: k of E
    model = GPT(config, seed=seed)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=lr_max, betas=(0.9, 0.95), eps=1e-8, fused=True)  # as the scripts
    record = dict(loss=[], grad_norm=[], eval=[])

    @torch.no_grad()
    def evaluate(step):
        model.eval()
        means = [sum(model(*get_batch(split, i, batch_size, block_size, seed + 1))[1].item()
                     for i in range(PARITY_EVAL_ITERS)) / PARITY_EVAL_ITERS for split in ("train", "val")]
        model.train()
        record["eval"].append((step, *means))

    evaluate(0)
    for step in range(steps):
        if step < warmup:
            lr = lr_max * (step + 1) / (warmup + 1)
        else:
            lr = lr_min + 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))) * (lr_max - lr_min)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch("train", step, batch_size, block_size, seed)
        _, loss = model(x, y)
        (loss + 0.01 * model.aux_loss() if n_experts else loss).backward()  # --aux_loss_coef's default
        norm = torch.stack([(p.grad * p.grad).sum() for p in params]).sum().sqrt()
        for p in params:
            p.grad.mul_((1.0 / (norm + 1e-6)).clamp(max=1.0))
        optimizer.step()
        optimizer.zero_grad()
        record["loss"].append(loss.item())
        record["grad_norm"].append(norm.item())
    evaluate(steps)
    return record


# Flags a row may add that change the model or batch (e.g. more layers for 4 pipeline stages): the
# reference and the plain loop are then run with the same values. Anything else a row adds must not
# change the math (strategy flags, --grad_accum_steps).
MODEL_FLAGS = ("--n_layer", "--n_head", "--n_embd", "--batch_size", "--block_size", "--n_experts", "--top_k")


def model_flags(extra):
    return tuple(x for i, flag in enumerate(extra) if flag in MODEL_FLAGS for x in (flag, extra[i + 1]))


def reference_keys():
    """model_flags of every row of this file compared with one process: its references, one launch for all."""
    extras = [x for _, _, _, x in STRATEGIES] + [x for rows in ZERO_BUBBLE_ROWS.values() for _, x in rows]
    extras += [x for _, _, variants in AC_ROWS for _, dropout, x in variants if dropout == 0.0]
    return sorted({model_flags(x) for x in [()] + extras})


def reference_runs():
    """(script, args) of every one-process reference, one per reference_keys() model shape: ddp_train.py's, or for a
    mixture of experts ep_train.py's, which alone trains one (EP 1: every expert in the process)."""
    return [("ep_train.py" if "--n_experts" in key else "ddp_train.py", FLAGS + list(key)) for key in reference_keys()]


def one_process_references(shared_run):
    """conftest's session fixture `references`: (reference, plain) run_record dicts per distinct model_flags(extra),
    computed once, all at the first call: the one-process references in one launch while this process runs the
    plain loops (one thread each: the two share the machine's cores). The plain loops take the longer, so the
    launch's thread then runs tests/test_diloco.py's one-process simulations (cached there) in their shadow."""
    cache = {}

    def get(extra=()):
        if not cache:
            keys = reference_keys()
            failed = []

            def launch_references():
                try:
                    import test_diloco  # DiLoCo's one replica, equal to them, in the same launch
                    shared_run.batch(None, reference_runs() + [test_diloco.one_replica_run()])
                    test_diloco.simulations()
                except BaseException as error:  # raised below, in the test
                    failed.append(error)
            launch = threading.Thread(target=launch_references)
            launch.start()
            threads = torch.get_num_threads()
            torch.set_num_threads(ONE_PROCESS_THREADS)  # the references' threads; this process's put back after
            try:
                plains = {k: plain_pytorch_run(**{f[2:]: int(v) for f, v in zip(k[::2], k[1::2])}) for k in keys}
            finally:
                torch.set_num_threads(threads)
                launch.join()
            if failed:
                raise failed[0]
            for key, (script, args) in zip(keys, reference_runs()):
                ref = run_record(shared_run(script, None, args)[0])
                for name, run in (("reference", ref), ("plain loop", plains[key])):  # every model shape, MoE included
                    assert len(run["loss"]) == len(run["grad_norm"]) == STEPS, (name, key, run)
                    assert [e[0] for e in run["eval"]] == [0, STEPS], (name, key, run["eval"])
                dloss, dnorm = differences(ref, plains[key])  # and finite: a NaN anywhere fails it
                assert dloss <= TOL and dnorm <= NORM_TOL, ("reference vs plain loop", key, dloss, dnorm)
                cache[key] = ref, plains[key]
        return cache[model_flags(extra)]
    return get


def differences(run, ref, first=0, last=None):
    """The largest |dloss| (steps and evaluations alike) and relative dnorm of a run against ref (run_record
    dicts), the run's steps being ref's steps first..last-1 (a resumed run's from `first`; `last`: ref's end), each of
    its evaluations compared with ref's at the same step, which must exist. Any NaN or inf on either side fails, and
    so does a run and a reference of different lengths."""
    ref_evals = {step: theirs for step, *theirs in ref["eval"]}
    missing = [step for step, *_ in run["eval"] if step not in ref_evals]
    assert not missing, f"the reference has no evaluation at steps {missing}: {ref['eval']}"
    losses = paired(run["loss"], ref["loss"][first:last], "loss")
    for step, *mine in run["eval"]:
        losses += paired(mine, ref_evals[step], f"evaluation at step {step}")
    norms = paired(run["grad_norm"], ref["grad_norm"][first:last], "grad_norm")
    return worst(abs(a - b) for a, b in losses), worst(abs(a - b) / abs(b) for a, b in norms)


def check(name, run, reference, plain, tol=TOL, norm_tol=NORM_TOL, first=0, steps=STEPS):
    """Asserts that a run (run_record's dict) of steps first..steps-1 equals the one-process reference and the
    plain loop: each loss within tol, each pre-clip grad norm within norm_tol relative, and its evaluations (at
    `first` when it is a multiple of STEPS, and at `steps`) equal theirs within tol; records the largest differences."""
    assert len(run["loss"]) == len(run["grad_norm"]) == steps - first, (name, run)
    evals = ([first] if first % STEPS == 0 else []) + [steps]  # --eval_interval STEPS, and at the end
    assert [e[0] for e in run["eval"]] == evals, (name, run["eval"])
    dloss_ref, dnorm_ref = differences(run, reference, first, steps)
    dloss_plain, dnorm_plain = differences(run, plain, first, steps)
    record(name, {"max_abs_dloss_vs_reference": dloss_ref, "max_abs_dloss_vs_plain": dloss_plain,
                  "max_rel_dnorm_vs_reference": dnorm_ref, "max_rel_dnorm_vs_plain": dnorm_plain})
    assert dloss_ref <= tol and dloss_plain <= tol, (name, run, reference)
    assert dnorm_ref <= norm_tol and dnorm_plain <= norm_tol, (name, run["grad_norm"], reference["grad_norm"])


def record(name, deltas):
    os.makedirs(os.path.join(REPO, "out"), exist_ok=True)
    with open(os.path.join(REPO, "out", "parity.jsonl"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # pytest-xdist: one writer at a time, a whole line each
        f.write(json.dumps({"run": name, **deltas}) + "\n")
    print(name, deltas)


# What --compile compiles, by dynamo's counters on every rank (common.model.compile_forward): ddp and fsdp each
# block's forward and GPT.head, whole, for training and again for evaluation (no_grad is a guard): 4 graphs, no
# break. tp runs its parallel linears (their collectives) and the attention core (its dropout's generator switch)
# eagerly on purpose, and with SP and dropout each dropout's switch to the rank's own stream: the graph breaks
# at each of those calls, and only there.
TP_EAGER = {"ColumnParallelLinear.forward", "RowParallelLinear.forward", "TPAttention.attend"}
COMPILED = {
    "ddp_train.py": dict(graphs=4, breaks=set()),
    "fsdp_train.py": dict(graphs=4, breaks=set()),
    "tp_train.py": dict(graphs=None, breaks=TP_EAGER),
    "tp_train.py --dropout": dict(graphs=None, breaks=TP_EAGER | {"TPRankDropout.on_rank_stream"}),
}


def graph_breaks(counters):
    """The functions dynamo broke its graph at, by name (a disabled function's qualified name, else the reason's
    first line)."""
    names = set()
    for reason in counters["graph_break"]:
        disabled = re.search(r"function `?<function (\S+) at", reason)
        names.add(disabled.group(1) if disabled else reason.splitlines()[0])
    return names


def check_compiled(script, nproc, out_dir, dropout=False):
    """A compiled row compiled what it claims, from dynamo's own counters (tests/runs.py writes them per rank,
    the counters cleared at the run's start): graphs compiled, the graph breaks COMPILED states for the script
    and no other, and no recompile after the first step (its evaluation, before it, included)."""
    expected = COMPILED.get(script + " --dropout" * dropout, COMPILED[script])
    for rank in range(nproc):
        path = os.path.join(out_dir, f"dynamo_rank{rank}.json")
        assert os.path.exists(path), f"{path}: the compiled row ran outside tests/runs.py"
        counters = json.load(open(path))
        first, end = counters["after_first_step"], counters["end"]
        graphs = end["stats"].get("unique_graphs", 0)
        assert graphs > 0 and expected["graphs"] in (None, graphs), end
        assert graph_breaks(end) == expected["breaks"], (rank, graph_breaks(end))
        assert first == end, ("recompiled after the first step", rank, first, end)


def test_reference_equals_plain_pytorch(references):
    reference, plain = references()
    assert len(reference["loss"]) == len(plain["loss"]) == STEPS
    assert [e[0] for e in reference["eval"]] == [e[0] for e in plain["eval"]] == [0, STEPS]
    dloss, dnorm = differences(reference, plain)
    record("reference vs plain", {"max_abs_dloss": dloss, "max_rel_dnorm": dnorm})
    assert dloss <= TOL and dnorm <= NORM_TOL
    assert reference["loss"][-1] < reference["loss"][0] - 0.5, "the loss should fall visibly"
    assert reference["eval"][-1][2] < reference["eval"][0][2] - 0.5, "and the val loss with it"
    assert min(plain["grad_norm"]) > 1.0, "every step clips (the test's premise)"


def test_check_fails_on_any_nan_a_short_reference_or_a_missing_evaluation(monkeypatch):
    """check() without a launch: a run equal to its reference at step 0 and NaN (or inf) after it, in its losses,
    grad norms or evaluations, fails; so does a reference cut short, or without the run's evaluation. Python's max
    keeps a NaN only when it comes first, and zip stops at the shorter list: each passed before."""
    monkeypatch.setattr(__import__(__name__), "record", lambda name, deltas: None)  # not in out/parity.jsonl
    ref = dict(loss=[10.0 - 0.1 * s for s in range(STEPS)], grad_norm=[3.0 - 0.1 * s for s in range(STEPS)],
               eval=[(0, 10.9, 10.95), (STEPS, 9.0, 9.1)])
    check("whole", ref, ref, ref)
    nan, inf = float("nan"), float("inf")
    runs = {"loss": dict(ref, loss=ref["loss"][:1] + [nan] * (STEPS - 1)),
            "grad_norm": dict(ref, grad_norm=ref["grad_norm"][:1] + [nan] * (STEPS - 1)),
            "evaluation": dict(ref, eval=[ref["eval"][0], (STEPS, nan, nan)]),
            "inf": dict(ref, loss=ref["loss"][:-1] + [inf])}
    for what, run in runs.items():
        with pytest.raises(AssertionError, match="non-finite"):
            check(f"nan {what}", run, ref, ref)
        with pytest.raises(AssertionError, match="non-finite"):  # the reference's own NaN
            check(f"nan reference {what}", ref, run, ref)
    with pytest.raises(AssertionError, match="against the reference's"):
        check("short reference", ref, dict(ref, loss=ref["loss"][:-1]), ref)
    with pytest.raises(AssertionError, match="no evaluation"):
        check("no reference evaluation", ref, dict(ref, eval=ref["eval"][:1]), ref)


# tests/test_plan.py's memory runs, in the 2-rank launch: a step's peak on a modelled GPU (tests/runs.py's MEMORY)
# against plan.Rank.memory, every custom script's formulas once (its loss, FSDP's gathered units, ZeRO-3's fetched
# head, the pipelines' first stage and vocabulary pass) and the peers whose peak the plan gives, within `tolerance`
# bytes either way: what the plan leaves out (a few small tensors; the pipelines' first stage: its activations
# bounded by their peak; ep: routing's rows)
MEMORY_FLAGS = TINY + ["--max_iters", "2", "--seed", "1337"]
MEMORY_RUNS = [  # (script, flags, tolerance)
    ("ddp_train.py", ["--dtype", "bfloat16", "--grad_accum_steps", "2"], 2**17),
    ("fsdp_train.py", [], 2**17),
    ("fsdp_train.py", ["--reshard_after_forward", "false", "--activation_checkpointing", "full"], 2**17),
    ("zero3_train.py", ["--dtype", "bfloat16"], 2**17),
    ("zero3_train.py", ["--stage", "2"], 2**17),
    ("tp_train.py", ["--sequence_parallel", "--dtype", "bfloat16"], 2**17),
    ("cp_train.py", [], 2**17),
    ("ep_train.py", [], 2**19),
    ("pp_train.py", [], 2**19),
    ("pp_vocab_train.py", [], 2**19),
    ("hybrid_train.py", ["--pipeline_parallel_size", "2", "--data_parallel_size", "1"], 2**19),
    # the peers built on torch DDP (plan_report.peak_measured): the custom's loss and buffers
    ("ddp_train.py", ["--implementation", "pytorch"], 2**17),
    ("zero3_train.py", ["--implementation", "pytorch", "--stage", "1"], 2**17),
    ("ep_train.py", ["--implementation", "pytorch"], 2**19),
]


def memory_args(flags):
    from runs import MEMORY
    return [MEMORY] + MEMORY_FLAGS + flags


def launch_group(nproc, as_user=False):
    """Every run of this file at nproc ranks under one launcher (tests/user_torch.py or tests/runs.py) that this torch
    runs, every script's, as (script, args): one launch. The parity rows; under runs.py also the activation-
    checkpointing, zero-bubble and 4-rank hybrid runs (the 8-rank hybrid launch resumes a checkpoint it writes)."""
    group = [(s, FLAGS + ["--implementation", i] + list(x)) for s, i, n, x in STRATEGIES
             if n == nproc and ((s, i, n, tuple(x)) in AS_USERS_TORCH) == as_user and runs_here(s, i)]
    if not as_user:
        group += [(script, args) for script, n, variants in AC_ROWS if n == nproc
                  for args in ac_runs(variants).values()]
        group += [("pp_zb_train.py", args) for args in zero_bubble_runs(nproc)]
        group += [("hybrid_train.py", args) for args in hybrid_runs(nproc)] if nproc == 4 else []
        group += [("tp_train.py", tp_dropout_args(*run) + ["--max_iters", str(TP_DROPOUT_STEPS)])
                  for run in TP_DROPOUT] if nproc == 2 else []  # tests/test_tp.py's, compared with runs alone
        group += [(script, memory_args(flags)) for script, flags, _ in MEMORY_RUNS] if nproc == 2 else []
        from test_diloco import diloco_runs  # tests/test_diloco.py's, compared with its simulation there
        group += [("ddp_diloco_train.py", args) for args in diloco_runs(nproc)]
    return group


@pytest.mark.parametrize("script,implementation,nproc,extra",
                         [pytest.param(*row, marks=peer_needs(*row[:2])) for row in STRATEGIES],
                         ids=[row_id(*row) for row in STRATEGIES])
def test_parity(script, implementation, nproc, extra, references, shared_run):
    reference, plain = references(extra)
    as_user = (script, implementation, nproc, tuple(extra)) in AS_USERS_TORCH
    shared_run.batch(nproc, launch_group(nproc, as_user), as_user)
    out_dir, result = shared_run(script, nproc, FLAGS + ["--implementation", implementation] + extra, as_user)
    if as_user:  # every rank took AdamW's multi-tensor path at every step
        assert min(result.adamw_multi_tensor_steps) >= STEPS, result.adamw_multi_tensor_steps
    compiled = "--compile" in extra
    check(row_id(script, implementation, nproc, extra), run_record(out_dir), reference, plain,
          COMPILE_TOL if compiled else TOL)
    if compiled:
        check_compiled(script, nproc, out_dir)


@pytest.mark.parametrize("nproc,extra", [(nproc, extra) for script, _, nproc, extra in STRATEGIES
                                         if script == "tp_overlap_train.py"])
def test_tp_overlap_equals_plain_tp(nproc, extra, shared_run):
    """tp_overlap_train.py sends the same numbers in pieces and adds the pieces in another order: its losses and
    grad norms equal tp_train.py's with the same flags (both runs are parity rows above, shared)."""
    flags = FLAGS + ["--implementation", "custom"]
    runs = {}
    for script in ("tp_overlap_train.py", "tp_train.py"):
        as_user = (script, "custom", nproc, tuple(extra)) in AS_USERS_TORCH
        runs[script] = run_record(shared_run(script, nproc, flags + extra, as_user)[0])
    overlapped, reference = runs["tp_overlap_train.py"], runs["tp_train.py"]
    delta = worst(abs(a - b) / abs(b) for a, b in paired(overlapped["loss"], reference["loss"], "loss"))
    _, dnorm = differences(overlapped, reference)
    record(f"tp-overlap-{nproc}r{''.join(extra)} vs plain", {"max_rel_dloss": delta, "max_rel_dnorm": dnorm})
    assert len(overlapped["loss"]) == len(reference["loss"]) == STEPS
    assert delta <= OVERLAP_TOL and dnorm <= NORM_TOL, (overlapped, reference)


def test_hsdp_of_one_replica_is_fsdp_bit_for_bit(shared_run):
    """fsdp_hsdp_train.py at --replicate_size 1 shards over every rank and has no replica to all-reduce with: the
    same collectives on the same numbers as fsdp_train.py, so the same bits (both runs are parity rows above)."""
    flags = FLAGS + ["--implementation", "custom"]
    shared_run.batch(2, launch_group(2, as_user=True), as_user=True)  # both rows run as users' torch does
    hsdp, fsdp = (run_record(shared_run(script, 2, flags, as_user=True)[0])
                  for script in ("fsdp_hsdp_train.py", "fsdp_train.py"))
    assert len(hsdp["loss"]) == STEPS and hsdp == fsdp, (hsdp, fsdp)


def test_hsdp_bytes_within_and_between_nodes_are_the_plans(shared_run):
    """The 2 x 2 custom row's second step, counted by tests/runs.py per collective and process group, on two nodes
    of 2 ranks: within a node (the shard group) the all-gathers, reduce-scatters and the norm's 4 bytes; between
    nodes (the replicate group) only the all-reduce of the rank's gradient shard, once a step whatever the
    micro-steps: its fp32 bytes, 4P/S. Each figure plan.py's."""
    import plan
    R = S = 2
    args = FLAGS + ["--implementation", "custom", "--replicate_size", str(R), "--grad_accum_steps", "2"]
    shared_run.batch(R * S, launch_group(R * S))
    out_dir = shared_run("fsdp_hsdp_train.py", R * S, args)[0]
    ranks = plan.plan("fsdp_hsdp_train.py", R * S, args, nproc_per_node=S)
    for rank in range(R * S):
        node = rank // S * S
        names = {",".join(map(str, range(node, node + S))): "shard", ",".join(map(str, range(rank % S, R * S, S))):
                 "replicate"}
        counted = json.load(open(os.path.join(out_dir, f"comm_steps_rank{rank}.json")))[0]  # the second step
        counted = {f"{key.split('@')[0]}@{names[key.split('@')[1]]}": nbytes for key, nbytes in counted.items()}
        planned = next(r for r in ranks if rank in r.ranks)
        assert counted == planned.comm, (rank, counted, planned.comm)
        assert planned.between == {k: v * k.endswith("@replicate") for k, v in planned.comm.items()}, planned.between
        assert counted["all_reduce@replicate"] == planned.params  # the shard, once a step: 4P/S


# A run batched with others in one process (tests/runs.py, tests/user_torch.py) equals the same run alone: each launcher
# resets what a run sets (tests/runs.py's fresh_run_state). Each row below runs alone, in a launch of its own, for its
# first STANDALONE_STEPS steps (--lr_decay_iters pins the schedule, so they are its batched run's first steps): its
# losses, grad norms and first evaluation must be the batched row's, bit for bit: a compiled row, last of every 2-rank
# run, compiled ones included; both implementations at 4 ranks, under both launchers. (tests/test_tp.py compares tp's
# runs with dropout 0.5 at 2 ranks, custom and pytorch, the same way.)
STANDALONE_STEPS = 3
STANDALONE = [("ddp_train.py", "custom", 2, ["--compile"]),
              ("tp_train.py", "custom", 4, ["--tensor_parallel_size", "4", "--sequence_parallel"]),
              ("tp_train.py", "pytorch", 4, ["--tensor_parallel_size", "2", "--sequence_parallel", "--grad_accum_steps",
                                             "2"])]  # under tests/user_torch.py


@pytest.mark.parametrize("script,implementation,nproc,extra", STANDALONE, ids=[row_id(*row) for row in STANDALONE])
def test_a_batched_run_equals_the_same_run_alone(script, implementation, nproc, extra, shared_run, tmp_path):
    from conftest import launch, launch_as_user
    as_user = (script, implementation, nproc, tuple(extra)) in AS_USERS_TORCH
    shared_run.batch(nproc, launch_group(nproc, as_user), as_user)
    batched = run_record(shared_run(script, nproc, FLAGS + ["--implementation", implementation] + extra, as_user)[0])
    args = PARITY + ["--max_iters", str(STANDALONE_STEPS), "--lr_decay_iters", str(STEPS),
                     "--implementation", implementation, *extra, "--out_dir", str(tmp_path)]
    if as_user:
        launch_as_user(script, nproc, args)
    else:
        result = launch(script, nproc, args, torchrun=False)
        assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    alone = run_record(tmp_path)
    assert [e[0] for e in alone["eval"]] == [0, STANDALONE_STEPS], alone["eval"]
    assert_alone_is_batched_prefix(alone, batched, STANDALONE_STEPS)


# --activation_checkpointing: each row runs the script's main() once per (implementation, dropout, extra flags)
# variant and mode, in the launch of its rank count (launch_group). full and selective recompute what none keeps, with
# the same random numbers: their losses, grad norms and evaluations must be none's, bit for bit. The proof that the
# mode ran, in every run: tests/runs.py's count of attention cores run again in backward (none: 0 on every rank;
# full and selective: some on every rank); and the saved-activation meter shows that they kept less: full always;
# selective with dropout, where SDPA's math path keeps the T x T probabilities and mask (without, the fused kernel
# keeps only its B*nh*T log-sum-exp, which the meter's count of FSDP's gathered buffers can hide). PyTorch's pipeline
# has no meter (its schedule runs every micro-batch in one call). Every script at 2 ranks, custom and
# pytorch (cp: custom, its peer needs CUDA), dropout 0 and 0.1 (cp's ring: 0, its only one); TP+SP (DP 2 x
# TP 2) and the interleaved pipeline (4 ranks x 2 chunks) at 4 ranks.
AC_STEPS = 3
AC_MODES = ("none", "full", "selective")
BOTH = ("custom", "pytorch")
AC_ROWS = [
    ("ddp_train.py", 2, [(impl, d, []) for impl in BOTH for d in (0.0, 0.1)]),
    ("fsdp_train.py", 2, [(impl, d, []) for impl in BOTH for d in (0.0, 0.1)]),
    ("zero3_train.py", 2, [(impl, d, []) for impl in BOTH for d in (0.0, 0.1)]),
    ("tp_train.py", 2, [(impl, d, []) for impl in BOTH for d in (0.0, 0.1)]
     + [("custom", 0.1, ["--sequence_parallel"]),  # and compiled (below): every dropout on the rank's own stream
        ("custom", 0.1, ["--sequence_parallel", "--compile", "true"])]),
    ("pp_train.py", 2, [(impl, d, ["--schedule", "1f1b"]) for impl in BOTH for d in (0.0, 0.1)]),
    ("pp_zb_train.py", 2, [("custom", 0.1, ["--schedule", "zbv", "--n_layer", "4"])]),  # recomputed inside B, W later
    ("cp_train.py", 2, [("custom", 0.0, []), ("custom", 0.0, ["--cp_mode", "ulysses"]),
                        ("custom", 0.1, ["--cp_mode", "ulysses"])]),
    ("tp_train.py", 4, [(impl, 0.1, ["--tensor_parallel_size", "2", "--sequence_parallel"]) for impl in BOTH]),
    ("pp_train.py", 4, [(impl, 0.1, ["--schedule", "interleaved", "--n_layer", "8"]) for impl in BOTH]),
    # hybrid: the ring recomputed inside TP's heads with SP, and at a pipeline stage's B
    ("hybrid_train.py", 4, [("custom", 0.0, ["--tensor_parallel_size", "2", "--context_parallel_size", "2",
                                             "--sequence_parallel"]),
                            ("custom", 0.0, ["--pipeline_parallel_size", "2", "--context_parallel_size", "2"])]),
]


def kept_bytes(summary):
    """The bytes the run's meter saw kept for backward, summed over the ranks: the forward's
    (saved_activation_bytes), or the custom pipeline's per micro-batch on its chunks; None: no meter."""
    values = summary.get("saved_activation_bytes_per_rank") or summary.get("peak_activation_bytes_per_rank")
    return values and sum(values)


def attend_counts(out_dir, nproc):
    """Each rank's attention-core calls in the run, forward and in backward (tests/runs.py counts them)."""
    return [json.load(open(os.path.join(out_dir, f"attend_rank{rank}.json"))) for rank in range(nproc)]


def ac_runs(variants):
    """{(implementation, dropout, extra, mode): the run's args} of an AC_ROWS row: every mode of each variant (a
    compiled variant: none only)."""
    flags = FLAGS[:FLAGS.index("--max_iters")] + ["--max_iters", str(AC_STEPS), "--lr_decay_iters", str(STEPS)]
    return {(implementation, dropout, tuple(extra), mode):
            flags + extra + ["--implementation", implementation, "--dropout", str(dropout),
                             "--activation_checkpointing", mode]
            for implementation, dropout, extra in variants
            for mode in (("none",) if "--compile" in extra else AC_MODES)}


@pytest.mark.parametrize("script,nproc,variants", AC_ROWS,
                         ids=[f"{script[:-9]}-{nproc}r" for script, nproc, _ in AC_ROWS])
def test_activation_checkpointing_is_bit_identical(script, nproc, variants, references, shared_run):
    runs = ac_runs(variants)
    shared_run.batch(nproc, launch_group(nproc))
    out_dirs = {name: shared_run(script, nproc, args)[0] for name, args in runs.items()}
    records = {}
    for name, out_dir in out_dirs.items():
        if "--compile" in name[2]:
            check_compiled(script, nproc, out_dir, dropout=name[1] > 0)
        rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
        run = run_record(out_dir)
        assert len(run["loss"]) == len(run["grad_norm"]) == AC_STEPS, name
        assert [e[0] for e in run["eval"]] == [0, AC_STEPS], (name, run["eval"])
        finite(run["loss"] + run["grad_norm"] + [x for e in run["eval"] for x in e], name)
        records[name] = run, kept_bytes(next(r for r in rows if r.get("summary"))), attend_counts(out_dir, nproc)
    for implementation, dropout, extra in variants:
        none, none_bytes, none_attends = records[(implementation, dropout, tuple(extra), "none")]
        if "--compile" in extra:  # compiled (fallback_random): eager's dropout masks, so eager's losses and norms
            eager, _, _ = records[(implementation, dropout, tuple(extra[:-2]), "none")]
            delta = worst(abs(a - b) for key in ("loss", "grad_norm") for a, b in paired(none[key], eager[key], key))
            record(f"activation-checkpointing-{script[:-9]}-{nproc}r-compiled vs eager", {"max_abs_delta": delta})
            assert delta <= COMPILE_TOL
            continue
        # the proof that each mode ran, on every rank: none recomputes nothing; full and selective run attention
        # cores again in backward, at most once each (the custom pipeline, PyTorch's, zero bubble's B alike; a
        # pipeline's forward count also holds one micro-batch run outside the steps, hence not equal)
        assert all(n["backward"] == 0 < n["forward"] for n in none_attends), (implementation, extra, none_attends)
        for mode in ("full", "selective"):
            run, kept, attends = records[(implementation, dropout, tuple(extra), mode)]
            assert run == none, (implementation, dropout, extra, mode, run, none)  # evaluations included
            assert all(0 < n["backward"] <= n["forward"] for n in attends), (implementation, extra, mode, attends)
            if none_bytes is not None and (mode == "full" or dropout > 0):
                assert kept < none_bytes, (implementation, dropout, extra, mode, kept, none_bytes)
        if dropout == 0.0:  # and none equals single-process training: losses, grad norms, the evaluation at 0
            reference, _ = references(extra)
            dloss, dnorm = differences(dict(none, eval=none["eval"][:1]), reference, last=AC_STEPS)
            assert dloss <= TOL and dnorm <= NORM_TOL, (implementation, extra, dloss, dnorm)
    record(f"activation-checkpointing-{script[:-9]}-{nproc}r", {"runs": len(runs), "bit_identical": True})


# pp_zb_train.py's zero-bubble schedules, ZB-H1 (zb1p) and ZB-V (zbv), custom and torch's
# (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble), at 2 and 4 ranks, in the launch of their rank count
# (launch_group), each compared with the single-process reference as a row above is.
ZERO_BUBBLE_ROWS = {
    2: [("custom", ["--schedule", "zb1p", "--grad_accum_steps", "2"]), ("pytorch", ["--schedule", "zb1p"]),
        ("custom", ["--schedule", "zbv", "--n_layer", "4", "--grad_accum_steps", "2"]),
        ("pytorch", ["--schedule", "zbv", "--n_layer", "4"])],
    4: [("custom", ["--schedule", "zb1p", "--n_layer", "4"]), ("pytorch", ["--schedule", "zb1p", "--n_layer", "4"]),
        ("custom", ["--schedule", "zbv", "--n_layer", "8"]), ("pytorch", ["--schedule", "zbv", "--n_layer", "8"])],
}


def zero_bubble_runs(nproc):
    """The args of each ZERO_BUBBLE_ROWS run at nproc ranks that this torch runs."""
    rows = ZERO_BUBBLE_ROWS.get(nproc, [])
    return [FLAGS + ["--implementation", implementation] + extra for implementation, extra in rows
            if runs_here("pp_zb_train.py", implementation)]


@pytest.mark.parametrize("nproc", sorted(ZERO_BUBBLE_ROWS))
def test_zero_bubble_parity(nproc, references, shared_run):
    shared_run.batch(nproc, launch_group(nproc))
    for args in zero_bubble_runs(nproc):
        implementation, extra = args[len(FLAGS) + 1], args[len(FLAGS) + 2:]
        reference, plain = references(extra)
        out_dir, _ = shared_run("pp_zb_train.py", nproc, args)
        check(row_id("pp_zb_train.py", implementation, nproc, extra), run_record(out_dir), reference, plain)


# hybrid_train.py: every pair of axes at 4 ranks, and two grids of three at 8, each with gradient accumulation and
# clipping (the parity config clips: its norms are above 1), the 4-rank runs in the launch of their rank count
# (launch_group), the 8-rank ones in a launch of their own that also writes a checkpoint at dp2 x tp2 x pp2 after
# CUT steps and resumes it at tp2 x pp2 x cp2 to STEPS; a single process then resumes the same checkpoint in
# ddp_train.py. (dp2 x tp2 x pp2 x cp2 on 16 ranks: run_all.sh.)
# PyTorch's peer (a DeviceMesh, parallelize_module, pipelining; no CP on CPU) at the grids without CP, in the same
# launches; the 8-rank one's checkpoint resumes in the custom tp2 x pp2 x cp2 run.
HYBRID_ROWS = {
    4: [("custom", ["--data_parallel_size", "2", "--tensor_parallel_size", "2", "--print_grid"]),
        ("custom", ["--data_parallel_size", "2", "--pipeline_parallel_size", "2", "--n_microbatches", "2"]),
        ("custom", ["--data_parallel_size", "2", "--context_parallel_size", "2"]),
        ("custom", ["--tensor_parallel_size", "2", "--pipeline_parallel_size", "2", "--sequence_parallel"]),
        ("custom", ["--tensor_parallel_size", "2", "--context_parallel_size", "2", "--sequence_parallel"]),
        ("custom", ["--pipeline_parallel_size", "2", "--context_parallel_size", "2"]),
        ("pytorch", ["--data_parallel_size", "2", "--tensor_parallel_size", "2"]),
        ("pytorch", ["--data_parallel_size", "2", "--pipeline_parallel_size", "2", "--n_microbatches", "2"]),
        ("pytorch", ["--tensor_parallel_size", "2", "--pipeline_parallel_size", "2", "--sequence_parallel"])],
    8: [("pytorch", ["--data_parallel_size", "2", "--tensor_parallel_size", "2", "--pipeline_parallel_size", "2",
                     "--n_microbatches", "2"]),
        ("custom", ["--tensor_parallel_size", "2", "--pipeline_parallel_size", "2", "--context_parallel_size", "2",
                    "--sequence_parallel"]),
        ("custom", ["--data_parallel_size", "2", "--tensor_parallel_size", "2", "--pipeline_parallel_size", "2",
                    "--n_microbatches", "2"])],
}
HYBRID_CUT = 6
HYBRID_FLAGS = FLAGS + ["--grad_accum_steps", "2", "--lr_decay_iters", str(STEPS)]


def grid_lines(stdout):
    """--print_grid's lines: rank -> its text."""
    return {int(line.split(":")[0][5:]): line for line in stdout.splitlines() if line.startswith("rank ")}


def hybrid_runs(nproc):
    """The args of each HYBRID_ROWS run at nproc ranks that this torch runs."""
    return [HYBRID_FLAGS + ["--implementation", implementation] + extra for implementation, extra in HYBRID_ROWS[nproc]
            if runs_here("hybrid_train.py", implementation)]


@pytest.mark.parametrize("nproc", sorted(HYBRID_ROWS))
def test_hybrid_parity(nproc, references, shared_run, tmp_path):
    from conftest import launch
    runs = hybrid_runs(nproc)
    ckpt = tmp_path / "cut" / "ckpt.pt"
    if nproc == 4:  # in the launch of every 4-rank run of this file
        shared_run.batch(nproc, launch_group(nproc))
        out_dirs = [shared_run("hybrid_train.py", nproc, args)[0] for args in runs]
        result = shared_run("hybrid_train.py", nproc, runs[0])[1]
    else:  # one launch that also cuts at one grid (the peer's, where this torch runs it) and resumes at another
        out_dirs = [tmp_path / str(k) for k in range(len(runs))]
        cut = runs[0] + ["--max_iters", str(HYBRID_CUT), "--out_dir", str(ckpt.parent)]
        resumed = HYBRID_FLAGS + HYBRID_ROWS[8][1][1] + ["--resume_from", str(ckpt)]  # custom tp2 x pp2 x cp2
        argv = [args + ["--out_dir", str(out)] for args, out in zip(runs, out_dirs)]
        argv += [cut, resumed + ["--out_dir", str(tmp_path / "resumed")]]
        result = launch("tests/runs.py", nproc, ["hybrid_train.py"] + [a for run in argv for a in run + ["---"]][:-1],
                        torchrun=False)
        assert result.returncode == 0, f"failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    reference, plain = references()
    for args, out_dir in zip(runs, out_dirs):
        implementation, extra = args[len(HYBRID_FLAGS) + 1], args[len(HYBRID_FLAGS) + 2:]
        check(row_id("hybrid_train.py", implementation, nproc, extra), run_record(out_dir), reference, plain)
    if nproc == 4:  # dp 2 x tp 2: rank = d * 2 + t
        lines = grid_lines(result.stdout)
        assert sorted(lines) == [0, 1, 2, 3]
        for rank, line in lines.items():
            d, t = divmod(rank, 2)
            assert line.startswith(f"rank {rank}: dp={d} pp=0 cp=0 tp={t}; tp {[2 * d, 2 * d + 1]}, "), line
            assert f"dpxcp {[t, 2 + t]}" in line and f"ppxtp {[2 * d, 2 * d + 1]}" in line, line
    if nproc == 8:
        assert f"resuming from {ckpt} at step {HYBRID_CUT}" in result.stdout
        # a new out_dir: steps CUT.. and the evaluation at the end
        check("hybrid-8r-resumed-at-tp2-pp2-cp2", run_record(tmp_path / "resumed"), reference, plain,
              first=HYBRID_CUT)
        single = launch("ddp_train.py", None, HYBRID_FLAGS + ["--resume_from", str(ckpt), "--out_dir",
                                                              str(tmp_path / "ddp")])
        assert single.returncode == 0, single.stderr[-3000:]
        check("hybrid-8r-resumed-in-ddp-train", run_record(tmp_path / "ddp"), reference, plain, first=HYBRID_CUT)
