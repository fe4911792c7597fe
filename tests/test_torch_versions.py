"""Every script, both implementations, as our users' torch runs them and this CPU does not (tests/user_torch.py):

- AdamW's foreach path, its default on CUDA (and fused for the TP peer and fsdp's ShardedAdamW): the TP peer
  crashed there ("aten._foreach_mul_ got mixed torch.Tensor and DTensor") while every CPU test passed;
- torch < 2.13's torch.distributed namespace, without all_gather_single and reduce_scatter_single, for the
  project's own code (the GPU machine's torch 2.11: fsdp and cp allgather crashed on the missing names).

Each row trains 3 steps at 2 ranks (the 2D rows at 4) with both in force and must match the first 3 steps of
the single-process parity reference (1e-5, as tests/test_parity.py), count foreach (or fused) steps on every
rank, and exit cleanly. The TP peer's rows cover what changes which of its parameters were plain tensors:
sequence parallelism on and off, 2D, and a resume. And below the supported torch range a script refuses in one
line (common.config.TORCH_FLOOR).
"""
import json
import os

import pytest
import torch
from torch.torch_version import TorchVersion

from conftest import PARITY, PARITY_STEPS, launch, refusal, step_losses
from common import config

# --lr_decay_iters: the 15-step parity run's schedule, so its first steps are the reference here.
FLAGS = PARITY + ["--lr_decay_iters", str(PARITY_STEPS)]
TOL = 1e-5
ROWS = [  # (script, implementation, ranks, extra flags, AdamW path)
    ("ddp_train.py", "custom", 2, [], "foreach"),
    ("ddp_train.py", "pytorch", 2, [], "foreach"),
    ("fsdp_train.py", "custom", 2, [], "foreach"),  # ShardedAdamW; its all-gathers and reduce-scatters
    ("fsdp_train.py", "custom", 2, [], "fused"),
    ("fsdp_train.py", "pytorch", 2, [], "foreach"),
    ("zero3_train.py", "custom", 2, [], "foreach"),
    ("zero3_train.py", "pytorch", 2, [], "foreach"),
    ("zero3_train.py", "custom", 2, ["--stage", "1"], "foreach"),  # OwnedAdamW
    ("zero3_train.py", "pytorch", 2, ["--stage", "1"], "foreach"),  # inside ZeroRedundancyOptimizer
    ("zero3_train.py", "custom", 2, ["--stage", "2"], "foreach"),
    ("tp_train.py", "custom", 2, ["--sequence_parallel"], "foreach"),
    ("tp_train.py", "pytorch", 2, [], "foreach"),  # without SP the LayerNorms and wpe were plain tensors
    ("tp_train.py", "pytorch", 2, [], "fused"),
    ("tp_train.py", "pytorch", 2, ["--sequence_parallel"], "foreach"),
    ("tp_train.py", "pytorch", 4, ["--tensor_parallel_size", "2"], "foreach"),
    ("tp_train.py", "pytorch", 4, ["--tensor_parallel_size", "2", "--sequence_parallel"], "foreach"),
    ("pp_train.py", "custom", 2, ["--schedule", "1f1b", "--vocab_parallel"], "foreach"),
    ("pp_train.py", "pytorch", 2, ["--schedule", "1f1b"], "foreach"),
    ("cp_train.py", "custom", 2, [], "foreach"),
    ("cp_train.py", "custom", 2, ["--cp_mode", "allgather"], "foreach"),
    ("cp_train.py", "custom", 2, ["--cp_mode", "ulysses"], "foreach"),
]


def as_users_run(script, implementation, nproc, extra, adamw, out_dir, steps):
    """The script under tests/user_torch.py; returns each rank's count of multi-tensor AdamW steps."""
    env = {"USER_TORCH_OUT": str(out_dir / "user_torch"), "USER_TORCH_ADAMW": adamw, "USER_TORCH_BEFORE_2_13": "1"}
    os.environ.update(env)
    try:
        result = launch("tests/user_torch.py", nproc, [script, *FLAGS, "--max_iters", str(steps), "--implementation",
                                                       implementation, *extra, "--out_dir", str(out_dir)],
                        torchrun=False)
    finally:
        for key in env:
            del os.environ[key]
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out_dir / "user_torch" / f"rank{r}.json").read_text())["adamw_multi_tensor_steps"]
            for r in range(nproc)]


@pytest.fixture(scope="module")
def reference(shared_run):
    return step_losses(shared_run("ddp_train.py", None, PARITY + ["--max_iters", str(PARITY_STEPS)])[0])


@pytest.mark.parametrize("script,implementation,nproc,extra,adamw", ROWS,
                         ids=[f"{s[:-9]}-{i}-{n}r-{a}{'-' + '-'.join(e).replace('--', '') if e else ''}"
                              for s, i, n, e, a in ROWS])
def test_runs_with_adamw_as_on_cuda_and_the_collective_names_before_torch_2_13(
        script, implementation, nproc, extra, adamw, reference, tmp_path):
    steps = as_users_run(script, implementation, nproc, extra, adamw, tmp_path, 3)
    assert all(n >= 3 for n in steps), steps  # at least one multi-tensor update per optimizer step, on every rank
    losses = step_losses(tmp_path)
    assert len(losses) == 3
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= TOL, (losses, reference[:3])


def test_the_tp_peer_resumes_on_the_foreach_path(reference, tmp_path):
    as_users_run("tp_train.py", "pytorch", 2, [], "foreach", tmp_path, 2)  # writes ckpt.pt at step 2
    as_users_run("tp_train.py", "pytorch", 2, ["--resume"], "foreach", tmp_path, 4)  # its AdamW state, as DTensors
    losses = step_losses(tmp_path)
    assert len(losses) == 4  # steps 0-1 kept from the first run, 2-3 from the resumed one
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= TOL, (losses, reference[:4])


def test_a_torch_below_the_floor_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.8.0"))
    error = refusal("ddp_train.py", 2, [], monkeypatch, capsys)
    assert error.startswith(f"error: torch 2.8.0: nanodist needs torch >= {config.TORCH_FLOOR}")
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.10.0"))  # compared as a version, not as text
    assert config.check_torch() is None
