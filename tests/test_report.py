"""common/report.py's tables and verdict, and run_all.sh's plan (--dry-run) for 0, 1 and 2 GPUs."""
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO
from common import report


def fake_run(runs, name, losses, exit_code=0, tokens_per_sec=1000.0, summary=True, norms=None, evals=()):
    run = runs / name
    run.mkdir()
    (run / "exit_code").write_text(f"{exit_code}\n")
    with open(run / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses):
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": (norms or [2.0] * len(losses))[step]}) + "\n")
        for step, train, val in evals:
            f.write(json.dumps({"step": step, "train_loss": train, "val_loss": val}) + "\n")
        if summary:
            f.write(json.dumps({"summary": True, "tokens_per_sec": tokens_per_sec,
                                "peak_mem_bytes_per_rank": [2**20, 2**21],
                                "model_state_bytes_per_rank": [3 * 2**20, 5 * 2**20]}) + "\n")


def test_smoke_passes_when_every_run_matches_the_reference(tmp_path, capsys):
    fake_run(tmp_path, "reference", [10.0, 9.0])
    fake_run(tmp_path, "ddp-custom", [10.0, 9.00001])
    fake_run(tmp_path, "ddp-pytorch", [10.0, 9.0])
    assert report.smoke(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "ddp        custom" in out and "1.00e-05" in out


def test_smoke_fails_on_divergence_crash_or_missing_reference(tmp_path, capsys):
    fake_run(tmp_path, "reference", [10.0, 9.0])
    fake_run(tmp_path, "ddp-custom", [10.0, 9.1])
    fake_run(tmp_path, "ddp-pytorch", [10.0], exit_code=1, summary=False)
    assert report.smoke(str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "DIVERGED" in out and "FAILED (exit 1)" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.smoke(str(empty)) == 1


def test_smoke_compares_grad_norms_and_evaluations(tmp_path, capsys):
    evals = [(0, 10.0, 10.1), (2, 9.0, 9.2)]
    fake_run(tmp_path, "reference", [10.0, 9.0], norms=[3.0, 2.0], evals=evals)
    fake_run(tmp_path, "ddp-custom", [10.0, 9.0], norms=[3.0, 2.00001], evals=evals)  # within 1e-4 relative
    assert report.smoke(str(tmp_path)) == 0
    fake_run(tmp_path, "fsdp-custom", [10.0, 9.0], norms=[6.0, 4.0], evals=evals)  # a gradient 2x off
    fake_run(tmp_path, "tp-custom", [10.0, 9.0], norms=[3.0, 2.0], evals=[(0, 10.0, 10.1), (2, 9.0, 9.3)])
    fake_run(tmp_path, "pp-custom", [10.0, 9.0], norms=[3.0, 2.0], evals=evals[:1])  # no final evaluation
    assert report.smoke(str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert out.count("DIVERGED") == 3 and "FAILED: fsdp-custom, pp-custom, tp-custom" in out


def test_smoke_fails_on_a_nan_after_the_first_step_on_either_side(tmp_path, capsys):
    nan = float("nan")
    evals = [(0, 10.0, 10.1), (3, 9.0, 9.2)]
    fake_run(tmp_path, "reference", [10.0, 9.5, 9.2], norms=[3.0, 2.5, 2.0], evals=evals)
    fake_run(tmp_path, "ddp-custom", [10.0, nan, nan], norms=[3.0, nan, nan], evals=[(0, 10.0, 10.1), (3, nan, nan)])
    fake_run(tmp_path, "fsdp-custom", [10.0, 9.5, 9.2], norms=[3.0, 2.5, float("inf")], evals=evals)
    assert report.smoke(str(tmp_path)) == 1
    assert "FAILED: ddp-custom, fsdp-custom" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "ddp-custom"), shutil.rmtree(tmp_path / "fsdp-custom")
    fake_run(tmp_path, "tp-custom", [10.0, 9.5, 9.2], norms=[3.0, 2.5, 2.0], evals=evals)
    assert report.smoke(str(tmp_path)) == 0  # the same run, finite, passes
    shutil.rmtree(tmp_path / "reference")
    fake_run(tmp_path, "reference", [10.0, nan, 9.2], norms=[3.0, 2.5, 2.0], evals=evals)  # the reference's own
    assert report.smoke(str(tmp_path)) == 1


def test_bench_ratios_use_the_median_of_alternating_rounds(tmp_path, capsys):
    rounds = [(110, 100, 100), (90, 100, 100), (130, 100, 120)] + [(100, 100, 100)] * 7
    for r, (custom, pytorch, limit) in enumerate(rounds, 1):  # rounds 1 to 10: round 10 sorts after round 9
        fake_run(tmp_path, f"ddp-custom-r{r}", [1.0], tokens_per_sec=custom)
        fake_run(tmp_path, f"ddp-pytorch-r{r}", [1.0], tokens_per_sec=pytorch)
        fake_run(tmp_path, f"limit-1proc-r{r}", [1.0], tokens_per_sec=limit)
    assert report.bench(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "ddp: custom/pytorch tokens/s = 1.000 (paired by round: median 1.000, per round 1.100 0.900 1.300 1.000" in out
    assert "ddp custom: tokens/s vs one process on all cores = 1.000" in out
    assert "3/5" in out  # model state MiB per rank


def test_bench_compares_a_config_with_its_own_one_process_run(tmp_path, capsys):
    for r in (1, 2, 3):  # ddp@b8t128 (batch 8, block 128) against limit@b8t128, not the default's limit
        fake_run(tmp_path, f"limit-1proc-r{r}", [1.0], tokens_per_sec=400)
        fake_run(tmp_path, f"limit@b8t128-1proc-r{r}", [1.0], tokens_per_sec=200)
        fake_run(tmp_path, f"ddp@b8t128-custom-r{r}", [1.0], tokens_per_sec=190 + r)
        fake_run(tmp_path, f"ddp@b8t128-pytorch-r{r}", [1.0], tokens_per_sec=200)
    assert report.bench(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "ddp@b8t128 custom: tokens/s vs one process on all cores = 0.960 (paired by round: median " \
           "0.960, per round 0.955 0.960 0.965)" in out
    assert "ddp@b8t128 pytorch: tokens/s vs one process on all cores = 1.000" in out
    assert "ddp@b8t128: custom/pytorch tokens/s = 0.960" in out
    assert "limit@b8t128 1proc: tokens/s vs" not in out


def test_markdown_tables_give_each_ratio_as_the_median_of_the_rounds_with_their_range(tmp_path, capsys):
    for r, (custom, pytorch, limit, overlap) in enumerate([(90, 100, 100, 99), (120, 100, 100, 60), (99, 90, 110, 99)], 1):
        fake_run(tmp_path, f"tp-custom-r{r}", [1.0], tokens_per_sec=custom)
        fake_run(tmp_path, f"tp-pytorch-r{r}", [1.0], tokens_per_sec=pytorch)
        fake_run(tmp_path, f"limit-1proc-r{r}", [1.0], tokens_per_sec=limit)
        fake_run(tmp_path, f"tp_overlap-custom-r{r}", [1.0], tokens_per_sec=overlap)
    assert report.markdown(str(tmp_path)) == 0
    lines = capsys.readouterr().out.splitlines()
    # custom/limit per round 0.9, 1.2, 0.9; custom/pytorch 0.9, 1.2, 1.1; overlap/custom 1.1, 0.5, 1.0
    assert "| tp | custom | 99 | 0.90 (0.90-1.20) | 1.10 (0.90-1.20) |" in lines
    assert "| tp | pytorch | 100 | 1.00 (0.82-1.00) |  |" in lines
    assert "| limit | 1proc | 100 |  |  |" in lines
    assert "| tp_overlap-custom | tp-custom | 1.00 (0.50-1.10) |" in lines
    assert not any(line.startswith("| zero3") for line in lines)  # variants without runs: no row


def test_markdown_first_names_the_machine_torch_commit_and_command(tmp_path, capsys, monkeypatch):
    """write_setup (run_all.sh calls it) records them in RUNS_DIR/setup.json, and markdown prints them before the
    tables; a folder without setup.json prints "unknown" for each, and extra() does not take the file for a run."""
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a GPU machine, faked (no GPU here)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    fake_run(tmp_path, "ddp-custom-r1", [1.0])
    assert report.write_setup(str(tmp_path), "NPROC=2 ROUNDS=3 ./run_all.sh --bench") == 0
    assert report.markdown(str(tmp_path)) == 0
    lines = capsys.readouterr().out.splitlines()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    head = head or "unknown"  # outside a git checkout
    assert lines[0] == f"- CPU: {report.cpu_model()} ({os.cpu_count()} logical CPUs)"
    assert lines[1:3] == ["- GPU: 2 x NVIDIA H100 80GB HBM3", f"- torch: {torch.__version__}"
                          + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else "")]
    assert lines[3].startswith(f"- commit: {head}")
    assert lines[4:6] == ["- command: `NPROC=2 ROUNDS=3 ./run_all.sh --bench`", ""]
    assert lines[6].startswith("| run | impl |") and "| ddp | custom | 1,000 | - | - |" in lines
    assert report.extra(str(tmp_path)) == 0 and "FAILED" not in capsys.readouterr().out  # setup.json: not a run
    bare = tmp_path / "bare"
    bare.mkdir()
    assert report.markdown(str(bare)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == [f"- {key}: unknown" for key in ("CPU", "GPU", "torch", "commit", "command")]


def test_bench_prints_the_ratios_of_the_variants(tmp_path, capsys):
    for r, (stage1, peer, ddp) in enumerate([(90, 100, 100), (120, 100, 100), (99, 90, 110)], 1):
        fake_run(tmp_path, f"zero3-stage1-custom-r{r}", [1.0], tokens_per_sec=stage1)
        fake_run(tmp_path, f"zero3-stage1-pytorch-r{r}", [1.0], tokens_per_sec=peer)
        fake_run(tmp_path, f"ddp-custom-r{r}", [1.0], tokens_per_sec=ddp)
    assert report.bench(str(tmp_path)) == 0
    out = capsys.readouterr().out
    # ratio of the medians, then the median of the per-round ratios (0.9, 1.2, 1.1: 1.1) and each round's
    assert "zero3-stage1-custom / zero3-stage1-pytorch tokens/s = 0.990 (paired by round: median 1.100, " \
           "per round 0.900 1.200 1.100)" in out
    assert "zero3-stage1-custom / ddp-custom tokens/s = 0.990 (paired by round: median 0.900," in out
    assert "pp-1f1b-m8-vocab" not in out  # a pair with no runs prints nothing


def test_extra_table_shows_strategy_specific_keys_and_fails_on_a_crash(tmp_path, capsys):
    fake_run(tmp_path, "pp-custom-1f1b-m8", [10.0])
    with open(tmp_path / "pp-custom-1f1b-m8" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"summary": True, "tokens_per_sec": 500.0, "peak_mem_bytes_per_rank": [2**20],
                            "bubble_measured": 0.25, "bubble_theory": 0.111}) + "\n")
    assert report.extra(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "bubble 25.0%" in out and "theory 11.1%" in out
    fake_run(tmp_path, "fsdp-custom-noprefetch", [10.0], exit_code=1)
    assert report.extra(str(tmp_path)) == 1


def plan(gpus, *args, nproc="2"):
    """run_all.sh --dry-run's plan for a machine with `gpus` GPUs: [(run, ranks, device, command)], stdout, exit."""
    env = dict(os.environ, GPUS=str(gpus), NPROC=nproc)
    result = subprocess.run(["bash", "run_all.sh", "--dry-run", *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    rows = [re.match(r"\s+(\S+)\s+(\d+) rank\(s\) on (\w+)\s+(.*)", line) for line in result.stdout.splitlines()]
    return [m.groups() for m in rows if m], result


HYBRID_4D = "runs/smoke/hybrid@dp2tp2pp2cp2-custom"  # hybrid_train.py on 16 ranks: the CPU unless 16 GPUs
MOE_REFERENCE = "runs/smoke-moe/reference"  # the mixture of experts' own one-process reference
DILOCO_ONE = "runs/smoke/ddp_diloco@1replica-custom"  # DiLoCo's one replica: plain AdamW, against the reference


def test_run_all_plans_cpu_without_a_gpu():
    rows, result = plan(0)
    assert result.returncode == 0 and "GPU(s) for" not in result.stdout
    assert {device for _, _, device, _ in rows} == {"cpu"}
    assert ("runs/smoke/reference", "1") == rows[0][:2]
    assert all(ranks == "2" for name, ranks, _, _ in rows[1:] if name not in (HYBRID_4D, MOE_REFERENCE, DILOCO_ONE))
    assert [ranks for name, ranks, _, _ in rows if name == DILOCO_ONE] == ["1"]
    assert [ranks for name, ranks, _, _ in rows if name == HYBRID_4D] == ["16"]
    assert [ranks for name, ranks, _, _ in rows if name == MOE_REFERENCE] == ["1"]
    assert "runs/smoke/cp-pytorch" not in [r[0] for r in rows]  # torch's context_parallel: CUDA only
    assert not any(name.startswith("runs/smoke-gpu") for name, *_ in rows)


def test_run_all_on_one_gpu_runs_the_ranks_on_cpu_and_each_script_at_world_size_1_on_the_gpu():
    rows, result = plan(1)
    assert result.returncode == 0
    assert result.stdout.count("1 GPU(s) for 2 ranks: the 2-rank runs use the CPU (gloo)") == 1
    cpu = [r for r in rows if r[0].startswith("runs/smoke/")]
    gpu = [r for r in rows if r[0].startswith("runs/smoke-gpu/")]
    assert {r[2] for r in cpu} == {"cpu"} and {r[2] for r in gpu} == {"cuda"}
    assert all(ranks == "2" for name, ranks, _, _ in cpu if not name.endswith("reference")
               and name not in (HYBRID_4D, DILOCO_ONE))
    assert all(ranks == "1" and "--dtype bfloat16" in command for _, ranks, _, command in gpu)
    scripts = ["ddp", "fsdp", "fsdp_hsdp", "zero3", "zero3_tuning", "tp", "tp_overlap", "pp", "pp_zb", "pp_vocab", "cp",
               "hybrid"]
    custom_only = {"zero3_tuning", "tp_overlap", "pp_vocab"}  # tier-2 variants that PyTorch's peer refuses
    assert [r[0] for r in gpu] == ["runs/smoke-gpu/reference"] + [f"runs/smoke-gpu/{s}-{i}" for s in scripts
                                                                  for i in ("custom", "pytorch")
                                                                  if i == "custom" or s not in custom_only]
    rows, result = plan(1, "--bench")  # refused, with one line
    assert rows == [] and result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("error: run_all.sh --bench: 2 ranks need 2 GPUs, this machine has 1")


def test_run_all_uses_the_gpus_when_there_are_enough():
    rows, result = plan(2)
    assert result.returncode == 0 and {r[2] for r in rows if r[0] != HYBRID_4D} == {"cuda"}
    assert "runs/smoke/cp-pytorch" in [r[0] for r in rows]
    assert [r[2] for r in rows if r[0] == HYBRID_4D] == ["cpu"]  # 16 ranks need 16 GPUs
    rows, _ = plan(16)
    assert [r[2] for r in rows if r[0] == HYBRID_4D] == ["cuda"]
    rows, _ = plan(1, nproc="1")  # NPROC=1 on one GPU: every run on it
    assert {r[2] for r in rows if r[0] != HYBRID_4D} == {"cuda"}
    assert not any(r[0].startswith("runs/smoke-gpu") for r in rows)


@pytest.mark.parametrize("gpus,mode,folders", [("1", "", ["runs/smoke", "runs/smoke-gpu"]),
                                               ("0", "--bench", ["runs/bench", "runs/bench-extra"])])
def test_run_all_records_the_setup_of_each_run_folder(tmp_path, gpus, mode, folders):
    """run_all.sh asks common.report to write setup.json into each folder it makes, with the command that made it
    (a copy of run_all.sh, with a python that records its calls and runs nothing)."""
    shutil.copy(os.path.join(REPO, "run_all.sh"), tmp_path)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {tmp_path}/calls\n')
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), GPUS=gpus, NPROC="2", ROUNDS="1")
    env.pop("ONLY", None)
    args = [mode] if mode else []
    result = subprocess.run(["bash", str(tmp_path / "run_all.sh"), *args], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    command = f"NPROC=2 ROUNDS=1 GPUS={gpus} ./run_all.sh {mode}"
    assert [c for c in calls if c.startswith("-m common.report setup")] == [
        f"-m common.report setup {folder} {command}" for folder in folders]
    first_run = next(i for i, c in enumerate(calls) if f"--out_dir {folders[0]}/" in c)
    assert calls.index(f"-m common.report setup {folders[0]} {command}") < first_run
