"""Stress check: every finished run exits 0 (not part of the default pytest run).

    python tests/stress_exit.py                 # 200 launches (default), the other core kept busy
    python tests/stress_exit.py --launches 40 --scripts ddp_train.py --no_load

It launches short 2-rank torchrun jobs round-robin over every strategy script, both
implementations, and fresh and --resume runs (a resume continues the fresh run's checkpoint in the
same out_dir), while a busy process loads a core, and counts the launches that exit non-zero.
A run that did its work and then died at teardown (e.g. SIGABRT, "terminate called without an
active exception") is the failure this exists to catch. Exit status: 0 only if every launch
exited 0. Each failure's last lines of stderr go to <out>/failures.txt.
"""
import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import torch  # noqa: E402

from conftest import TINY, launch  # noqa: E402  (sets up the offline data and tokenizer)

SCRIPTS = ["ddp_train.py", "fsdp_train.py", "zero3_train.py", "tp_train.py", "pp_train.py", "cp_train.py",
           "pp_zb_train.py", "pp_vocab_train.py", "zero3_tuning_train.py", "tp_overlap_train.py",
           "fsdp_hsdp_train.py", "ddp_diloco_train.py"]
CUSTOM_ONLY = ("pp_vocab_train.py", "zero3_tuning_train.py", "tp_overlap_train.py",  # tier 2 without a peer
               "ddp_diloco_train.py")


def busy(parent):
    """Keep a core busy while the harness lives (it ends by itself if the harness is killed)."""
    while os.getppid() == parent:
        for _ in range(1_000_000):
            pass


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=200)
    p.add_argument("--scripts", nargs="+", default=[s for s in SCRIPTS if os.path.exists(os.path.join(REPO, s))])
    p.add_argument("--no_load", action="store_true", help="do not keep a core busy")
    p.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    args = p.parse_args()
    from common import data
    assert data.prepare("shakespeare") is None
    out = args.out or tempfile.mkdtemp(prefix="stress_exit_")
    os.makedirs(out, exist_ok=True)
    loader = None
    if not args.no_load:
        loader = mp.get_context("spawn").Process(target=busy, args=(os.getpid(),), daemon=True)
        loader.start()
    # One cycle: for each script and implementation, a fresh 2-step run, then --resume to 3 steps.
    cycle = [(s, impl, mode) for s in args.scripts for impl in ("custom", "pytorch") for mode in ("fresh", "resume")
             if not (s == "cp_train.py" and impl == "pytorch" and not torch.cuda.is_available())  # CUDA only
             and not (s in CUSTOM_ONLY and impl == "pytorch")]
    failures, leaks, start = [], 0, time.time()
    try:
        for i in range(args.launches):
            script, impl, mode = cycle[i % len(cycle)]
            run_dir = os.path.join(out, f"{script[:-3]}-{impl}")
            if mode == "fresh":
                shutil.rmtree(run_dir, ignore_errors=True)
            steps = ["--max_iters", "2"] if mode == "fresh" else ["--max_iters", "3", "--resume"]
            result = launch(script, 2, TINY + ["--implementation", impl, "--out_dir", run_dir] + steps, timeout=120,
                            check_teardown=False)
            leaks += "warning: teardown" in result.stderr  # a process group outlived destroy_process_group()
            ok = result.returncode == 0
            print(f"{i + 1:4d}/{args.launches} {script:16s} {impl:8s} {mode:7s} exit {result.returncode}"
                  f"  ({time.time() - start:.0f} s)", flush=True)
            if not ok:
                failures.append((i, script, impl, mode, result.returncode))
                with open(os.path.join(out, "failures.txt"), "a") as f:
                    f.write(f"==== launch {i + 1}: {script} {impl} {mode} exit {result.returncode}\n"
                            f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}\n")
    finally:
        if loader is not None:
            loader.kill()
    print(f"stress_exit: {len(failures)} non-zero exits in {args.launches} launches, {leaks} with a process group "
          f"left alive at teardown ({time.time() - start:.0f} s; runs in {out})")
    for f in failures:
        print("  failed:", *f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
