"""The shared loss-parity test: every (strategy, implementation) equals single-process training.

Each row of STRATEGIES runs under torchrun; its per-step logged losses are compared with
  1. the single-process reference, `python ddp_train.py` with the same flags, and
  2. an independent plain-PyTorch loop written below from common.model and common.data only.
The config is small, fp32, dropout 0, 15 steps at a stable learning rate: longer runs are chaotic
(after a loss spike even 1- and 2-thread single-process runs drift apart by 0.1 by step 40).
Each row's max |dloss| is printed and appended to out/parity.jsonl.
The rows of AS_USERS_TORCH, one or more for each script and implementation, run as our users' torch does
(tests/user_torch.py): AdamW on its fused path, the scripts' own, counted, and the project's code without torch 2.13's
collective names (tests/test_torch_versions.py).
"""
import json
import math
import os

import pytest
import torch

from conftest import PARITY, PARITY_STEPS, REPO, peer_needs, step_losses
from common.data import get_batch
from common.model import GPT, GPTConfig

STEPS = PARITY_STEPS
FLAGS = PARITY + ["--max_iters", str(STEPS)]  # TINY, lr 1e-3 -> 1e-4, 5 warmup steps, seed 1337 (conftest)
TOL = 1e-5  # fp32 on CPU; the largest |dloss| measured here is printed by each row
# tp --tp_overlap against plain tp, relative to the loss: the same sums in another order, so the last bits
# differ (a loss near 10 has a float32 spacing of 9.5e-7; the most measured at 4 ranks is 2 of them)
OVERLAP_TOL = 1e-6
# --compile: inductor's fused kernels may sum in another order than eager's (ddp: the whole model, the loss
# included; fsdp and tp: the blocks, with activation checkpointing); measured here: at most 9.5e-7 over the 15
# steps. Each compiled row shares the launch of its script's other rows at 2 ranks (a cold compile costs tens of
# seconds, a launch's start-up 7).
COMPILE_TOL = 1e-4

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
    # with the head split over the ranks (--vocab_parallel), 1F1B at 4 stages with it; uneven stages 2,1 in GPipe
    # (custom, pytorch) and 1F1B with accumulation
    ("pp_train.py", "custom", 2, ["--schedule", "gpipe", "--n_layer", "3", "--stage_layers", "2,1"]),
    ("pp_train.py", "custom", 2, ["--schedule", "gpipe", "--vocab_parallel"]),
    ("pp_train.py", "pytorch", 2, ["--schedule", "gpipe", "--n_layer", "3", "--stage_layers", "2,1"]),
    ("pp_train.py", "custom", 2, ["--schedule", "1f1b", "--grad_accum_steps", "2", "--n_layer", "3",
                                  "--stage_layers", "2,1"]),
    ("pp_train.py", "custom", 2, ["--schedule", "1f1b", "--vocab_parallel", "--grad_accum_steps", "2"]),
    ("pp_train.py", "pytorch", 2, ["--schedule", "1f1b", "--grad_accum_steps", "2"]),
    ("pp_train.py", "custom", 2, ["--schedule", "interleaved", "--n_layer", "4"]),
    ("pp_train.py", "custom", 2, ["--schedule", "interleaved", "--n_layer", "4", "--vocab_parallel"]),
    ("pp_train.py", "pytorch", 2, ["--schedule", "interleaved", "--n_layer", "4"]),
    ("pp_train.py", "custom", 4, ["--schedule", "1f1b", "--n_layer", "4", "--vocab_parallel"]),
    # (the zero-bubble schedules: test_zero_bubble_parity below, several runs a launch)
    # zero3: default (all partitioned); 4 ranks with biases/LayerNorms persistent, accumulation, no prefetch.
    # (PyTorch's FSDP2, the peer of both fsdp and zero3, runs at 2 ranks in three rows: with accumulation in fsdp's.)
    ("zero3_train.py", "custom", 2, []),
    ("zero3_train.py", "pytorch", 2, []),
    ("zero3_train.py", "custom", 4, ["--persistence_threshold", "1024", "--grad_accum_steps", "2",
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
    # tp at 4 (the ring of 4), and --tp_overlap at 2 and 4 ranks, SP off and on: each overlap row also equals
    # its row without --tp_overlap within OVERLAP_TOL (test_tp_overlap_equals_plain_tp)
    ("tp_train.py", "custom", 4, ["--tensor_parallel_size", "4"]),
    ("tp_train.py", "custom", 4, ["--tensor_parallel_size", "4", "--sequence_parallel"]),
    *[("tp_train.py", "custom", nproc, extra + ["--tp_overlap"]) for nproc, extra in (
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
    ("ddp_train.py", "custom", 2, []),
    ("ddp_train.py", "pytorch", 2, []),
    ("ddp_train.py", "custom", 2, ["--grad_accum_steps", "2"]),
    ("ddp_train.py", "pytorch", 2, ["--grad_accum_steps", "2"]),
    ("ddp_train.py", "custom", 2, ["--compile"]),  # the whole model compiled
]


# (script, implementation, ranks, extra flags) of the rows run under tests/user_torch.py.
AS_USERS_TORCH = {
    ("cp_train.py", "custom", 2, ()), ("cp_train.py", "custom", 2, ("--cp_mode", "allgather", "--block_size", "24")),
    ("pp_train.py", "custom", 2, ("--schedule", "1f1b", "--vocab_parallel", "--grad_accum_steps", "2")),
    ("pp_train.py", "pytorch", 2, ("--schedule", "1f1b", "--grad_accum_steps", "2")),
    ("zero3_train.py", "custom", 2, ()), ("zero3_train.py", "pytorch", 2, ()),
    ("zero3_train.py", "custom", 2, ("--stage", "1")),  # OwnedAdamW
    ("zero3_train.py", "pytorch", 2, ("--stage", "1", "--grad_accum_steps", "2")),  # inside ZeroRedundancyOptimizer
    ("zero3_train.py", "custom", 2, ("--stage", "2")),
    ("tp_train.py", "custom", 2, ()),
    ("tp_train.py", "custom", 2, ("--tp_overlap",)),  # as its plain row, which it is compared with
    ("tp_train.py", "pytorch", 2, ()),  # without SP its LayerNorms and wpe were plain tensors: foreach refused them
    ("tp_train.py", "pytorch", 2, ("--sequence_parallel", "--loss_parallel", "false")),
    ("tp_train.py", "pytorch", 4, ("--tensor_parallel_size", "2", "--sequence_parallel", "--grad_accum_steps", "2")),
    ("fsdp_train.py", "custom", 2, ()), ("fsdp_train.py", "pytorch", 2, ()),  # ShardedAdamW; FSDP2
    ("ddp_train.py", "custom", 2, ()), ("ddp_train.py", "pytorch", 2, ()),
}


def runs_here(script, implementation):
    """Whether this torch runs (script, implementation): peer_needs marks no skip."""
    return not any(mark.args[0] for mark in peer_needs(script, implementation))


def row_id(script, implementation, nproc, extra):
    user = "-as_user" if (script, implementation, nproc, tuple(extra)) in AS_USERS_TORCH else ""
    return f"{script[:-9]}-{implementation}-{nproc}r{'-' + '-'.join(extra).replace('--', '') if extra else ''}{user}"


def plain_pytorch_losses(steps=STEPS, lr_max=1e-3, lr_min=1e-4, warmup=5, seed=1337,
                         n_layer=2, n_head=4, n_embd=64, batch_size=8, block_size=32):
    """The textbook loop, independent of every strategy script and of common.config."""
    torch.set_num_threads(2)
    config = GPTConfig(block_size=block_size, vocab_size=50304, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                       dropout=0.0, bias=True)
    model = GPT(config, seed=seed)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=lr_max, betas=(0.9, 0.95), eps=1e-8, fused=True)  # as the scripts
    losses = []
    for step in range(steps):
        if step < warmup:
            lr = lr_max * (step + 1) / (warmup + 1)
        else:
            lr = lr_min + 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))) * (lr_max - lr_min)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch("train", step, batch_size, block_size, seed)
        _, loss = model(x, y)
        loss.backward()
        norm = torch.stack([(p.grad * p.grad).sum() for p in params]).sum().sqrt()
        for p in params:
            p.grad.mul_((1.0 / (norm + 1e-6)).clamp(max=1.0))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# Flags a row may add that change the model or batch (e.g. more layers for 4 pipeline stages): the
# reference and the plain loop are then run with the same values. Anything else a row adds must not
# change the math (strategy flags, --grad_accum_steps).
MODEL_FLAGS = ("--n_layer", "--n_head", "--n_embd", "--batch_size", "--block_size")


def model_flags(extra):
    return tuple(x for i, flag in enumerate(extra) if flag in MODEL_FLAGS for x in (flag, extra[i + 1]))


@pytest.fixture(scope="module")
def references(shared_run):
    """(reference, plain) losses per distinct model_flags(extra), computed once."""
    cache = {}

    def get(extra=()):
        key = model_flags(extra)
        if key not in cache:
            ref = step_losses(shared_run("ddp_train.py", None, FLAGS + list(key))[0])
            sizes = {flag[2:]: int(value) for flag, value in zip(key[::2], key[1::2])}
            cache[key] = ref, plain_pytorch_losses(**sizes)
        return cache[key]
    return get


def record(name, deltas):
    os.makedirs(os.path.join(REPO, "out"), exist_ok=True)
    with open(os.path.join(REPO, "out", "parity.jsonl"), "a") as f:
        f.write(json.dumps({"run": name, **deltas}) + "\n")
    print(name, deltas)


def test_reference_equals_plain_pytorch(references):
    reference, plain = references()
    assert len(reference) == STEPS
    delta = max(abs(a - b) for a, b in zip(reference, plain))
    record("reference vs plain", {"max_abs_dloss": delta})
    assert delta <= TOL
    assert reference[-1] < reference[0] - 0.5, "the loss should fall visibly"


@pytest.mark.parametrize("script,implementation,nproc,extra",
                         [pytest.param(*row, marks=peer_needs(*row[:2])) for row in STRATEGIES],
                         ids=[row_id(*row) for row in STRATEGIES])
def test_parity(script, implementation, nproc, extra, references, shared_run):
    reference, plain = references(extra)
    as_user = (script, implementation, nproc, tuple(extra)) in AS_USERS_TORCH
    # every row of this script, rank count and launcher (as_user or not) that this torch runs: one launch
    group = [FLAGS + ["--implementation", i] + list(x) for s, i, n, x in STRATEGIES
             if (s, n) == (script, nproc) and ((s, i, n, tuple(x)) in AS_USERS_TORCH) == as_user and runs_here(s, i)]
    shared_run.batch(script, nproc, group, as_user)
    out_dir, result = shared_run(script, nproc, FLAGS + ["--implementation", implementation] + extra, as_user)
    if as_user:  # every rank took AdamW's multi-tensor path at every step
        assert min(result.adamw_multi_tensor_steps) >= STEPS, result.adamw_multi_tensor_steps
    losses = step_losses(out_dir)
    assert len(losses) == STEPS
    vs_reference = max(abs(a - b) for a, b in zip(losses, reference))
    vs_plain = max(abs(a - b) for a, b in zip(losses, plain))
    record(row_id(script, implementation, nproc, extra),
           {"max_abs_dloss_vs_reference": vs_reference, "max_abs_dloss_vs_plain": vs_plain})
    tol = COMPILE_TOL if "--compile" in extra else TOL
    assert vs_reference <= tol, (losses, reference)
    assert vs_plain <= tol, (losses, plain)


@pytest.mark.parametrize("nproc,extra", [(nproc, extra) for script, _, nproc, extra in STRATEGIES
                                         if script == "tp_train.py" and "--tp_overlap" in extra])
def test_tp_overlap_equals_plain_tp(nproc, extra, shared_run):
    """--tp_overlap sends the same numbers in pieces and adds the pieces in another order: its losses equal
    tp_train.py's without it (both runs are parity rows above, shared)."""
    flags = FLAGS + ["--implementation", "custom"]
    plain = [flag for flag in extra if flag != "--tp_overlap"]
    as_user = [("tp_train.py", "custom", nproc, tuple(x)) in AS_USERS_TORCH for x in (extra, plain)]
    overlapped = step_losses(shared_run("tp_train.py", nproc, flags + extra, as_user[0])[0])
    reference = step_losses(shared_run("tp_train.py", nproc, flags + plain, as_user[1])[0])
    delta = max(abs(a - b) / abs(b) for a, b in zip(overlapped, reference))
    record(f"tp-overlap-{nproc}r{''.join(plain)} vs plain", {"max_rel_dloss": delta})
    assert len(overlapped) == len(reference) == STEPS
    assert delta <= OVERLAP_TOL, (overlapped, reference)


# --activation_checkpointing: each row is one launch of tests/runs.py, which runs the script's main() once per
# (implementation, dropout, extra flags) variant and mode. full and selective recompute what none keeps, with
# the same random numbers: their losses and grad norms must be none's, bit for bit, and the saved-activation
# meter must show that they kept less (the proof that the mode ran): full always; selective with dropout, where
# SDPA's math path keeps the T x T probabilities and mask (without, the fused kernel keeps only its B*nh*T
# log-sum-exp, which the meter's count of FSDP's gathered buffers can hide). PyTorch's pipeline has no meter (its
# schedule runs every micro-batch in one call). Every script at 2 ranks, custom and
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
    ("pp_train.py", 2, [(impl, d, ["--schedule", "1f1b"]) for impl in BOTH for d in (0.0, 0.1)]
     + [("custom", 0.1, ["--schedule", "zbv", "--n_layer", "4"])]),  # recomputed inside B, weight grads at W
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


@pytest.mark.parametrize("script,nproc,variants", AC_ROWS,
                         ids=[f"{script[:-9]}-{nproc}r" for script, nproc, _ in AC_ROWS])
def test_activation_checkpointing_is_bit_identical(script, nproc, variants, references, tmp_path):
    from conftest import launch
    flags = FLAGS[:FLAGS.index("--max_iters")] + ["--max_iters", str(AC_STEPS), "--lr_decay_iters", str(STEPS)]
    runs, names = [], []
    for implementation, dropout, extra in variants:
        for mode in ("none",) if "--compile" in extra else AC_MODES:
            names.append((implementation, dropout, tuple(extra), mode))
            out_dir = tmp_path / f"run{len(runs)}"
            runs.append(flags + extra + ["--implementation", implementation, "--dropout", str(dropout),
                                         "--activation_checkpointing", mode, "--out_dir", str(out_dir)])
    argv = [script] + [arg for run in runs for arg in run + ["---"]][:-1]
    result = launch("tests/runs.py", nproc, argv, torchrun=False)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    records = {}
    for name, run in zip(names, runs):
        rows = [json.loads(line) for line in open(os.path.join(run[-1], "metrics.jsonl"))]
        steps = [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
        assert len(steps) == AC_STEPS, name
        records[name] = steps, kept_bytes(next(r for r in rows if r.get("summary")))
    for implementation, dropout, extra in variants:
        none, none_bytes = records[(implementation, dropout, tuple(extra), "none")]
        if "--compile" in extra:  # compiled (fallback_random): eager's dropout masks, so eager's losses and norms
            eager, _ = records[(implementation, dropout, tuple(extra[:-2]), "none")]
            assert max(abs(a - b) for step, ref in zip(none, eager) for a, b in zip(step, ref)) <= COMPILE_TOL
            continue
        for mode in ("full", "selective"):
            steps, kept = records[(implementation, dropout, tuple(extra), mode)]
            assert steps == none, (implementation, dropout, extra, mode, steps, none)
            if none_bytes is not None and (mode == "full" or dropout > 0):
                assert kept < none_bytes, (implementation, dropout, extra, mode, kept, none_bytes)
        if dropout == 0.0:  # and none equals single-process training
            reference, _ = references(extra)
            delta = max(abs(loss - ref) for (loss, _), ref in zip(none, reference))
            assert delta <= TOL, (implementation, extra, delta)
    record(f"activation-checkpointing-{script[:-9]}-{nproc}r", {"runs": len(runs), "bit_identical": True})


# The zero-bubble schedules, ZB-H1 (zb1p) and ZB-V (zbv), custom and torch's (ScheduleInterleavedZeroBubble,
# ScheduleZBVZeroBubble), at 2 and 4 ranks: every run of a rank count in one launch of tests/runs.py, each compared
# with the single-process reference as a row above is.
ZERO_BUBBLE_ROWS = {
    2: [("custom", ["--schedule", "zb1p", "--grad_accum_steps", "2"]), ("pytorch", ["--schedule", "zb1p"]),
        ("custom", ["--schedule", "zbv", "--n_layer", "4", "--grad_accum_steps", "2"]),
        ("pytorch", ["--schedule", "zbv", "--n_layer", "4"])],
    4: [("custom", ["--schedule", "zb1p", "--n_layer", "4"]), ("pytorch", ["--schedule", "zb1p", "--n_layer", "4"]),
        ("custom", ["--schedule", "zbv", "--n_layer", "8"]), ("pytorch", ["--schedule", "zbv", "--n_layer", "8"])],
}


@pytest.mark.parametrize("nproc", sorted(ZERO_BUBBLE_ROWS))
def test_zero_bubble_parity(nproc, references, tmp_path):
    from conftest import launch
    rows = ZERO_BUBBLE_ROWS[nproc]
    argv = ["pp_train.py"]
    for k, (implementation, extra) in enumerate(rows):
        argv += FLAGS + ["--implementation", implementation] + extra + ["--out_dir", str(tmp_path / str(k)), "---"]
    result = launch("tests/runs.py", nproc, argv[:-1], torchrun=False)
    assert result.returncode == 0, f"failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    for k, (implementation, extra) in enumerate(rows):
        reference, plain = references(extra)
        losses = step_losses(tmp_path / str(k))
        assert len(losses) == STEPS
        vs_reference = max(abs(a - b) for a, b in zip(losses, reference))
        vs_plain = max(abs(a - b) for a, b in zip(losses, plain))
        record(row_id("pp_train.py", implementation, nproc, extra),
               {"max_abs_dloss_vs_reference": vs_reference, "max_abs_dloss_vs_plain": vs_plain})
        assert vs_reference <= TOL and vs_plain <= TOL, (implementation, extra, losses, reference)


# hybrid_train.py: every pair of axes at 4 ranks, and two grids of three at 8, each with gradient accumulation and
# clipping (the parity config clips: its norms are above 1), as one launch of tests/runs.py per rank count. The 8-rank
# launch also writes a checkpoint at dp2 x tp2 x pp2 after CUT steps and resumes it at tp2 x pp2 x cp2 to STEPS; a
# single process then resumes the same checkpoint in ddp_train.py. (dp2 x tp2 x pp2 x cp2 on 16 ranks: run_all.sh.)
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


def grid_lines(stdout):
    """--print_grid's lines: rank -> its text."""
    return {int(line.split(":")[0][5:]): line for line in stdout.splitlines() if line.startswith("rank ")}


@pytest.mark.parametrize("nproc", sorted(HYBRID_ROWS))
def test_hybrid_parity(nproc, references, tmp_path):
    from conftest import launch
    rows = [(implementation, extra) for implementation, extra in HYBRID_ROWS[nproc]
            if runs_here("hybrid_train.py", implementation)]
    flags = FLAGS + ["--grad_accum_steps", "2", "--lr_decay_iters", str(STEPS)]
    runs = [flags + ["--implementation", implementation] + extra + ["--out_dir", str(tmp_path / str(k))]
            for k, (implementation, extra) in enumerate(rows)]
    ckpt = tmp_path / "cut" / "ckpt.pt"
    if nproc == 8:  # cut at one grid (the peer's, where this torch runs it), resumed at another
        cut = ["--implementation", rows[0][0]] + rows[0][1]
        runs.append(flags + cut + ["--max_iters", str(HYBRID_CUT), "--out_dir", str(ckpt.parent)])
        resumed = HYBRID_ROWS[8][1][1]  # custom tp2 x pp2 x cp2
        runs.append(flags + resumed + ["--resume_from", str(ckpt), "--out_dir", str(tmp_path / "resumed")])
    argv = ["hybrid_train.py"] + [arg for run in runs for arg in run + ["---"]][:-1]
    result = launch("tests/runs.py", nproc, argv, torchrun=False)
    assert result.returncode == 0, f"failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    reference, plain = references()
    for k, (implementation, extra) in enumerate(rows):
        losses = step_losses(tmp_path / str(k))
        assert len(losses) == STEPS
        vs_reference = max(abs(a - b) for a, b in zip(losses, reference))
        vs_plain = max(abs(a - b) for a, b in zip(losses, plain))
        record(row_id("hybrid_train.py", implementation, nproc, extra),
               {"max_abs_dloss_vs_reference": vs_reference, "max_abs_dloss_vs_plain": vs_plain})
        assert vs_reference <= TOL and vs_plain <= TOL, (implementation, extra, losses, reference)
    if nproc == 4:  # dp 2 x tp 2: rank = d * 2 + t
        lines = grid_lines(result.stdout)
        assert sorted(lines) == [0, 1, 2, 3]
        for rank, line in lines.items():
            d, t = divmod(rank, 2)
            assert line.startswith(f"rank {rank}: dp={d} pp=0 cp=0 tp={t}; tp {[2 * d, 2 * d + 1]}, "), line
            assert f"dpxcp {[t, 2 + t]}" in line and f"ppxtp {[2 * d, 2 * d + 1]}" in line, line
    if nproc == 8:
        assert f"resuming from {ckpt} at step {HYBRID_CUT}" in result.stdout
        resumed = step_losses(tmp_path / "resumed")
        delta = max(abs(a - b) for a, b in zip(resumed, reference[HYBRID_CUT:]))  # a new out_dir: steps CUT..
        assert len(resumed) == STEPS - HYBRID_CUT and delta <= TOL, (resumed, reference)
        single = launch("ddp_train.py", None, flags + ["--resume_from", str(ckpt), "--out_dir", str(tmp_path / "ddp")])
        assert single.returncode == 0, single.stderr[-3000:]
        in_ddp = step_losses(tmp_path / "ddp")
        delta_ddp = max(abs(a - b) for a, b in zip(in_ddp, reference[HYBRID_CUT:]))
        record("hybrid-8r-resumed", {"at_tp2_pp2_cp2": delta, "in_ddp_train": delta_ddp})
        assert len(in_ddp) == STEPS - HYBRID_CUT and delta_ddp <= TOL
