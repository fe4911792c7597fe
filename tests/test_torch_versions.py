"""The scripts as our users' torch runs them and this CPU does not (tests/user_torch.py), and the torch floor.

On CUDA, AdamW updates all parameters in one multi-tensor call (fused, the scripts' path on every device, or
foreach, CUDA's default), which refuses a mix of DTensor and Tensor: the TP peer crashed there on foreach while
every CPU test, then on the per-tensor loop, passed. And torch < 2.13 has no
all_gather_single or reduce_scatter_single: on the GPU machine's 2.11, fsdp and cp allgather crashed.
test_parity's AS_USERS_TORCH rows train every script and implementation (cp's pytorch needs CUDA) for 15
steps with both in force, against the single-process reference (the TP peer with sequence parallelism off,
on, and in 2D). Here: the TP peer on what those rows leave out (foreach AdamW; a resume, whose AdamW state
comes back as DTensors), and the one-line refusals below the floor and below what a peer needs.
"""
import shutil

import torch
from torch.torch_version import TorchVersion

from conftest import PARITY, PARITY_STEPS, cut_run_dir, launch_as_user, paired, refusal, step_losses, worst
from common import config
from test_parity import AS_USERS_TORCH, STRATEGIES

STEPS = PARITY_STEPS
FLAGS = PARITY + ["--lr_decay_iters", str(STEPS)]  # the parity schedule: a shorter run's steps are its first ones
TOL = 1e-5  # as tests/test_parity.py


def reference(shared_run):
    return step_losses(shared_run("ddp_train.py", None, PARITY + ["--max_iters", str(STEPS)])[0])


def test_parity_runs_every_script_and_implementation_as_users_torch_does():
    assert {(s, i) for s, i, _, _ in AS_USERS_TORCH} == {(s, i) for s, i, _, _ in STRATEGIES}


def test_the_tp_peer_on_foreach_adamw(shared_run, tmp_path):
    # CUDA's default path for an AdamW built without fused=True (common.model.FUSED_ADAMW off)
    result = launch_as_user("tp_train.py", 2, FLAGS + ["--max_iters", "3", "--implementation", "pytorch",
                                                       "--out_dir", str(tmp_path)], "foreach")
    assert min(result.adamw_multi_tensor_steps) >= 3, result.adamw_multi_tensor_steps
    losses = step_losses(tmp_path)
    assert worst(abs(a - b) for a, b in paired(losses, reference(shared_run)[:3], "losses")) <= TOL


def test_the_tp_peer_resumes_on_the_fused_path(shared_run, tmp_path):
    # test_reliability's run of 6 steps (its checkpoint at step 6), continued to step 15 as a CUDA user's would
    cut = cut_run_dir(shared_run, "tp_train.py", "pytorch")
    shutil.copytree(cut, tmp_path, dirs_exist_ok=True)
    result = launch_as_user("tp_train.py", 2, FLAGS + ["--implementation", "pytorch", "--max_iters", str(STEPS),
                                                       "--resume", "--out_dir", str(tmp_path)])
    assert f"resuming from {tmp_path / 'ckpt.pt'} at step 6" in result.stdout
    assert min(result.adamw_multi_tensor_steps) >= STEPS - 6
    losses = step_losses(tmp_path)
    assert worst(abs(a - b) for a, b in paired(losses, reference(shared_run), "losses")) <= TOL


def test_a_torch_below_the_floor_or_what_a_peer_needs_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.8.0"))
    error = refusal("ddp_train.py", 2, [], monkeypatch, capsys)
    assert error.startswith(f"error: nanodist needs torch >= {config.TORCH_FLOOR}, this is 2.8.0 (")
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.9.1"))  # what torch's pipelining needs: 2.10, 2.11
    error = refusal("pp_train.py", 2, ["--implementation", "pytorch"], monkeypatch, capsys)
    assert error.startswith("error: --implementation: pytorch (torch.distributed.pipelining) needs torch >= 2.10")
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.10.0"))
    error = refusal("pp_train.py", 2, ["--implementation", "pytorch", "--dtype", "bfloat16"], monkeypatch, capsys)
    assert error.startswith("error: --dtype: bfloat16 with --implementation pytorch needs torch >= 2.11")
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0"))  # torch's ZB-V on gloo: 2.12
    error = refusal("pp_zb_train.py", 2, ["--implementation", "pytorch", "--schedule", "zbv", "--n_layer", "4"],
                    monkeypatch, capsys)
    assert error.startswith("error: --schedule: zbv with --implementation pytorch needs torch >= 2.12")
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.10.0"))  # compared as a version, not as text
    assert config.check_torch() is None and config.check_torch("2.10") is None
