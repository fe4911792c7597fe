"""common.distributed.setup and the flags it resolves, on CUDA as users run them, faked here (no GPU).

- NCCL always gets device_id: bound to this rank's GPU, the default group connects at once, and every new_group
  inherits the binding and connects at creation (torch 2.9 to 2.13, _new_group_with_tag), so pp's and hybrid's
  first batch_isend_irecv on a group may leave some of its ranks out;
- --dtype's default: bfloat16 on a GPU that computes in it, float32 on an older GPU and on CPU; a given --dtype
  wins; resolved in parse_args, so the scripts' own checks (pp's torch gate) see it.
"""
import pytest
import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from conftest import TINY, refusal
from common import distributed
from common.config import parse_args
from test_clusters import fake_gpus


@pytest.mark.parametrize("launch", ["torchrun", "torchrun restart", "one process"])
def test_nccl_always_gets_the_ranks_gpu_as_device_id(launch, monkeypatch):
    """Every path of setup() that picks nccl passes device_id (init_process_group faked: no GPU here)."""
    rank, local_rank = (1, 1) if launch != "one process" else (0, 0)
    fake_gpus(monkeypatch, 2, local_rank=local_rank, local_world=2 if launch != "one process" else 1)
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    if launch != "one process":
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
    if launch == "torchrun restart":  # a store of this attempt's own (faked: no port opened)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29500")
        monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: "tcp store")
        monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: f"{prefix} over {store}")
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    # torch's global switches and the gc freeze would outlive the test
    monkeypatch.setattr(distributed, "freeze_imports", lambda: None)
    monkeypatch.setattr(distributed.timers, "use_device", lambda device: None)
    monkeypatch.setattr(distributed, "set_numerics", lambda args, use_cuda: None)
    state = torch.get_rng_state()
    try:
        assert distributed.setup(parse_args("pp", None, TINY))[2] == torch.device("cuda", local_rank)
    finally:
        torch.set_rng_state(state)
    [(backend, kw)] = calls
    assert backend == "nccl" and kw["device_id"] == torch.device("cuda", local_rank), kw
    assert kw["rank"] == rank and kw["world_size"] == (2 if launch != "one process" else 1)
    if launch == "torchrun restart":
        assert kw["store"] == "nanodist/attempt_1 over tcp store"


@pytest.mark.parametrize("device,gpu,flags,expected", [
    ("auto", "bf16", [], "bfloat16"),  # A100, H100: nanoGPT's bf16
    ("cuda", "bf16", [], "bfloat16"),
    ("auto", "emulated bf16", [], "float32"),  # V100, T4: no fp16 with a gradient scaler here
    ("auto", None, [], "float32"),  # CPU
    ("cpu", "bf16", [], "float32"),  # --device cpu beside a GPU
    ("auto", "bf16", ["--dtype", "float32"], "float32"),  # a given --dtype wins
    ("auto", None, ["--dtype", "bfloat16"], "bfloat16"),
])
def test_dtype_follows_the_device(device, gpu, flags, expected, monkeypatch):
    if gpu is not None:
        fake_gpus(monkeypatch, 1, local_rank=0, local_world=1, native_bf16=gpu == "bf16")
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_args("ddp", None, TINY + ["--device", device] + flags).dtype == expected


def test_every_cpu_run_here_keeps_fp32():
    """No fake: every test's runs, on any machine (conftest hides its GPUs), default to float32 (their losses
    unchanged)."""
    assert not torch.cuda.is_available() and parse_args("ddp", None, TINY).dtype == "float32"


def test_pps_torch_gate_sees_the_default_bf16(monkeypatch, capsys):
    """On a bf16 GPU the default is bfloat16 before the script's checks run: torch's pipelining on 2.10 lost the
    last stage's lm_head gradient under autocast, so a run that did not ask for bf16 is refused all the same."""
    fake_gpus(monkeypatch, 2, local_rank=0, local_world=2)
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.10.0"))
    error = refusal("pp_train.py", 2, TINY + ["--implementation", "pytorch"], monkeypatch, capsys)
    assert error.startswith("error: --dtype: bfloat16 with --implementation pytorch needs torch >= 2.11"), error
