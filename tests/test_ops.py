"""Operators per training step at world size 1, a CPU proxy for kernel launches: the `aten::` ops that
torch.profiler records on CPU in one steady-state step, at every nesting level, for each hand-written strategy and
for a plain single-process loop written below (common.model's GPT and its loss, fused AdamW as
common.model.configure_optimizer builds it, torch.nn.utils.clip_grad_norm_). With nothing to communicate, what a
strategy adds to that loop is its bookkeeping: hooks, copies, per-parameter passes. On CPU an op is not a launch (a
foreach op falls back to one op per tensor here, one kernel on CUDA), so the counts are a proxy, not a kernel count.

Each script's real main() runs in this process (--profile, common.metrics.Profiler: steps 0 and 1 warm up, step 2
is recorded), its one-rank gloo group from its own setup, as tests/runs.py runs several; the plain loop is profiled
by the same Profiler. All of it takes about 15 s here (2 cores).
"""
import glob
import importlib
import json
import os
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

import common.distributed
import common.metrics
from conftest import TINY
from common.data import get_batch
from common.metrics import Profiler
from common.model import GPT, GPTConfig

STEPS = 3  # the Profiler records step 2, after 2 steps of warm-up

# (name, script, flags, the most ops a step as a multiple of the plain loop's): ddp and fsdp within 1.1x, the other
# hand-written scripts 1.3x. cp's ring attention is hand-written math on CPU (its fused path is CUDA's): about
# 1.29x, just within its 1.3x.
RUNS = [
    ("ddp", "ddp_train", [], 1.1),
    ("fsdp", "fsdp_train", [], 1.1),
    ("zero1", "zero3_train", ["--stage", "1"], 1.3),
    ("zero2", "zero3_train", ["--stage", "2"], 1.3),
    ("zero3", "zero3_train", ["--stage", "3"], 1.3),
    ("tp", "tp_train", [], 1.3),
    ("pp", "pp_train", ["--n_microbatches", "1"], 1.3),
    ("cp", "cp_train", [], 1.3),
    ("hybrid", "hybrid_train", [], 1.3),
    # tier 2 (pp_vocab_train.py, whose vocabulary pass at one rank is a single slice, is not counted here)
    ("zero3_tuning", "zero3_tuning_train", ["--persistence_threshold", "1024"], 1.3),
    ("tp_overlap", "tp_overlap_train", [], 1.4),  # each matmul cut in pieces, by design: 1.36x measured
    ("pp_zb", "pp_zb_train", ["--schedule", "zb1p", "--n_microbatches", "1"], 1.3),
]


def ops_in_recorded_step(out_dir):
    """The aten:: ops of the recorded step (ProfilerStep#2) in out_dir's one trace, every thread and depth."""
    [trace] = glob.glob(os.path.join(out_dir, "profile", "*.pt.trace.json"))
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    [step] = [e for e in events if e["name"] == f"ProfilerStep#{STEPS - 1}"]
    start, end = step["ts"], step["ts"] + step["dur"]
    return sum(1 for e in events if e["name"].startswith("aten::") and start <= e["ts"] <= end)


def plain_loop(out_dir):
    """nanoGPT's loop at TINY's sizes: no strategy, no process group; profiled as the scripts' loops are."""
    config = GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True)
    model = GPT(config, seed=1337)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)  # as the scripts
    profiler = Profiler(SimpleNamespace(profile=True, out_dir=str(out_dir)), rank=0)
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = 1e-3
        x, y = get_batch("train", step, 8, 32, 1337)
        _, loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"iter {step}: loss {loss.item():.4f}, norm {norm.item():.3f}")  # the log line's host syncs
        profiler.step()
    profiler.stop()
    return ops_in_recorded_step(out_dir)


# The calls that make the host wait for the device: a `.item()` inside forward/backward, the clip or the optimizer
# step would stall CUDA's queue every step.
SYNCS = [(torch.Tensor, "item"), (torch.Tensor, "cpu"), (torch.Tensor, "tolist"), (torch.Tensor, "numpy"),
         (torch.Tensor, "__bool__"), (torch.Tensor, "__float__"), (torch.Tensor, "__int__"),
         (torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize")]


@contextmanager
def host_syncs():
    """Yields `steps`: after the run, the sorted names of the syncing calls between each two steps' log lines
    (Metrics.step), that is in each steady step but the first."""
    calls, marks, steps = [], [], []
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr in SYNCS]
    log_step = common.metrics.Metrics.step

    def counted(attr, original):
        def call(*args, **kwargs):
            calls.append(attr)
            return original(*args, **kwargs)
        return call

    def marked(self, *args, **kwargs):
        marks.append(len(calls))
        return log_step(self, *args, **kwargs)
    try:
        for owner, attr, original in originals:
            setattr(owner, attr, counted(attr, original))
        common.metrics.Metrics.step = marked
        yield steps
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)
        common.metrics.Metrics.step = log_step
    steps.extend(sorted(calls[a:b]) for a, b in zip(marks, marks[1:]))


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """Runs a script's main() here; after the module, the one-rank group is destroyed (common.distributed.teardown)
    and this process's torch threads restored. The scripts' malloc policy for CPU runs (keep_freed_memory) is left
    out: it changes no op, and it would stay with this pytest process for the rest of the suite."""
    threads = torch.get_num_threads()
    keep_freed_memory = common.distributed.keep_freed_memory
    common.distributed.keep_freed_memory = lambda: None

    def run(module, flags):
        out_dir = tmp_path_factory.mktemp("ops")
        argv = TINY + flags + ["--implementation", "custom", "--profile", "--max_iters", str(STEPS),
                               "--out_dir", str(out_dir)]
        with host_syncs() as syncs:
            importlib.import_module(module).main(argv)
        return ops_in_recorded_step(out_dir), syncs
    yield run
    common.distributed.keep_freed_memory = keep_freed_memory
    common.distributed.teardown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def plain_ops(tmp_path_factory):
    return plain_loop(tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("name,module,flags,limit", RUNS, ids=[run[0] for run in RUNS])
def test_ops_per_step_near_the_plain_loop_and_one_host_sync(name, module, flags, limit, in_process, plain_ops):
    """Also, in the same runs: one host sync a step, the log line's (the loss and the norm in one .tolist())."""
    ops, syncs = in_process(module, flags)
    assert len(syncs) == STEPS - 1 and all(step == ["tolist"] for step in syncs), (name, syncs)
    print(f"{name}: {ops} aten ops a step, plain loop {plain_ops}: {ops / plain_ops:.3f}x (limit {limit}x)")
    assert ops <= limit * plain_ops, f"{name}: {ops} ops a step, {ops / plain_ops:.3f}x the plain loop's {plain_ops}"
