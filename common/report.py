"""The tables run_all.sh prints, read from the runs' metrics.jsonl files.

  python -m common.report smoke RUNS_DIR      # one row per run vs RUNS_DIR/reference;
                                              # exit 1 on a failure or divergence
  python -m common.report smoke-gpu RUNS_DIR  # the same, bf16 at world size 1 on a GPU
  python -m common.report bench RUNS_DIR      # median tokens/s per (strategy, implementation)
                                              # over alternating rounds, custom/pytorch ratios,
                                              # and ratios to the 1-process limit
  python -m common.report extra RUNS_DIR      # one row per run, strategy-specific summary keys
  python -m common.report markdown RUNS_DIR   # the bench's setup and tables in Markdown, for a
                                              # file in docs/benchmarks/
  python -m common.report setup RUNS_DIR COMMAND  # write RUNS_DIR/setup.json (run_all.sh does)
Run folders are named <strategy>-<implementation>[-r<round>]; each holds metrics.jsonl, exit_code
and device (where it ran, e.g. "cpu x2"). RUNS_DIR/setup.json holds the machine, torch version,
commit and command of its runs.
"""
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A run "diverges" when a step's or an evaluation's loss is further than this from the reference's,
# or a step's pre-clip grad norm relatively further (a gradient N times off trains to the same
# losses under AdamW and a clip that fires: only its norm shows it).
SMOKE_TOL = 1e-4
# The GPU rows: bf16 against a bf16 reference. Each script rounds to bf16 at its own places (fsdp
# gathers bf16 parameters, the pipeline sends bf16 activations) and CUDA's kernels sum in their own
# orders; bf16 against fp32 measured up to 6e-4 over 15 steps on CPU (tests/test_bf16.py, whose
# tolerance this is), while a strategy that trains on the wrong rows, shards or learning rate is
# off by 1e-2 or more within a step. The grad norms: each script at 2 CPU ranks in bf16 against one
# bf16 process, at the smoke's config, within 1.5e-3 relative (fsdp and zero3; the others 5e-4).
GPU_BF16_TOL = 5e-3


def load(run_dir):
    run = {"exit_code": None, "losses": [], "norms": [], "evals": {}, "summary": None,
           "device": "-"}
    code = os.path.join(run_dir, "exit_code")
    if os.path.exists(code):
        run["exit_code"] = int(open(code).read().strip() or 1)
    device = os.path.join(run_dir, "device")
    if os.path.exists(device):
        run["device"] = open(device).read().strip()
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            if "loss" in r:
                run["losses"].append(r["loss"])
                run["norms"].append(r.get("grad_norm"))
            if "val_loss" in r:
                run["evals"][r["step"]] = (r["train_loss"], r["val_loss"])
            if r.get("summary"):
                run["summary"] = r
    run["ok"] = run["exit_code"] == 0 and run["summary"] is not None
    return run


def mib(nbytes):
    return f"{nbytes / 2**20:.0f}"


def divergence(run, reference):
    """The largest difference from the reference: |dloss| over the steps and evaluations, and the
    relative |dnorm| of the steps' pre-clip grad norms; inf if either side has a NaN or an inf."""
    losses = list(zip(run["losses"], reference["losses"]))
    for step, pair in run["evals"].items():
        losses += zip(pair, reference["evals"].get(step, (float("inf"),) * 2))  # none: diverged
    norms = [(a, b) for a, b in zip(run["norms"], reference["norms"]) if a is not None]
    values = [x for pair in losses + norms for x in pair]
    if not all(math.isfinite(x) for x in values):  # max keeps a NaN only when it comes first
        return float("inf")
    return max([abs(a - b) for a, b in losses] + [abs(a - b) / abs(b) for a, b in norms])


def smoke(runs_dir, tol=SMOKE_TOL):
    reference = load(os.path.join(runs_dir, "reference"))
    if not reference["ok"]:
        print(f"FAILED: the single-process reference run ({runs_dir}/reference) failed")
        return 1
    failed = []
    print(f"{'strategy':<10} {'impl':<8} {'device':<8} {'final loss':>10} {'max |dloss|':>12} "
          f"{'tokens/s':>10} {'peak MiB/rank':>14}  status")
    for name in sorted(os.listdir(runs_dir)):
        if name == "reference" or not os.path.isdir(os.path.join(runs_dir, name)):
            continue
        strategy, implementation = name.rsplit("-", 1)
        run = load(os.path.join(runs_dir, name))
        status, final, delta, tps, peak = "ok", "-", "-", "-", "-"
        if not run["ok"]:
            status = f"FAILED (exit {run['exit_code']})"
        else:
            d = divergence(run, reference)
            if (len(run["losses"]) != len(reference["losses"])
                    or run["evals"].keys() != reference["evals"].keys() or not d <= tol):
                status = f"DIVERGED (> {tol:g})"
            final, delta = f"{run['losses'][-1]:.4f}", f"{d:.2e}"
            tps = f"{run['summary']['tokens_per_sec']:,.0f}"
            peak = mib(max(run["summary"]["peak_mem_bytes_per_rank"]))
        if status != "ok":
            failed.append(name)
        print(f"{strategy:<10} {implementation:<8} {run['device']:<8} {final:>10} {delta:>12} "
              f"{tps:>10} {peak:>14}  {status}")
    print(f"reference (1 process, {reference['device']}): "
          f"final loss {reference['losses'][-1]:.4f}, "
          f"{reference['summary']['tokens_per_sec']:,.0f} tokens/s")
    if failed:
        print("FAILED: " + ", ".join(failed))
        return 1
    return 0


# (strategy, implementation) pairs whose tokens/s ratio the bench prints: run_all.sh's variants
COMPARE = [
    (("zero3-stage1", "custom"), ("zero3-stage1", "pytorch")),  # vs DDP + ZeroRedundancyOptimizer
    (("zero3-stage1", "custom"), ("ddp", "custom")),  # only the optimizer is split
    (("zero3-stage2", "custom"), ("zero3-stage1", "custom")),
    (("zero3", "custom"), ("zero3-stage2", "custom")),
    # HSDP (2 replicas) against FSDP; DiLoCo (4P every H steps) against DDP (4P a step)
    (("fsdp_hsdp", "custom"), ("fsdp", "custom")),
    (("ddp_diloco", "custom"), ("ddp", "custom")),
    # the head split over the pipeline ranks
    (("pp-1f1b-m8-vocab", "custom"), ("pp-1f1b-m8", "custom")),
    # zero bubble against 1F1B, on the default model and on balanced stages
    (("pp-zb1p-m8", "custom"), ("pp-1f1b-m8", "custom")),
    (("pp-zb1p-m8@balanced", "custom"), ("pp-1f1b-m8@balanced", "custom")),
    (("pp-zbv-m8", "custom"), ("pp-1f1b-m8", "custom")),
    (("pp-zbv-m8@balanced", "custom"), ("pp-1f1b-m8@balanced", "custom")),
    # TP's collectives in pieces under the matmuls (tp_overlap_train.py), without and with SP
    (("tp_overlap", "custom"), ("tp", "custom")),
    (("tp-sp-overlap", "custom"), ("tp-sp", "custom")),
    # hybrid_train.py's grids of 4 ranks against the single-strategy script on the same grid, or DDP
    (("hybrid@dp4", "custom"), ("ddp@dp4", "custom")),
    (("hybrid@pp4", "custom"), ("pp@pp4", "custom")),
    (("hybrid@dp2tp2", "custom"), ("tp@dp2tp2", "custom")),
    (("hybrid@dp2cp2", "custom"), ("cp@dp2cp2", "custom")),
    (("hybrid@tp2pp2", "custom"), ("ddp@dp4", "custom")),
    (("hybrid@pp2cp2", "custom"), ("ddp@dp4", "custom")),
]


def bench_rounds(runs_dir):
    """{(strategy, implementation): {round: run}} from the folders <strategy>-<impl>-r<round>."""
    rounds = {}
    for name in sorted(os.listdir(runs_dir)):
        if os.path.isdir(os.path.join(runs_dir, name)):
            strategy, implementation, r = name.rsplit("-", 2)
            by_round = rounds.setdefault((strategy, implementation), {})
            by_round[int(r.lstrip("r"))] = load(os.path.join(runs_dir, name))
    return rounds


def paired_ratios(a, b):
    """a's tokens/s over b's, round by round ({round: tokens/s} each), for the rounds both have."""
    return [a[r] / b[r] for r in sorted(a) if r in b]


def limit_of(strategy):
    """The one-process run at the same config: limit for the default, limit@<tag> for x@<tag>."""
    config = strategy.partition("@")[2]
    return ("limit@" + config if config else "limit", "1proc")


def bench(runs_dir):
    rounds = bench_rounds(runs_dir)  # (strategy, implementation) -> {round: run}
    medians = {}
    per_rounds = {}  # (strategy, implementation) -> {round: tokens/s}
    failed = []
    print(f"{'strategy':<20} {'impl':<8} {'tokens/s (median of rounds)':>28} {'per round':>28} "
          f"{'peak MiB/rank':>14} {'model state MiB/rank':>21}")
    for (strategy, implementation), by_round in sorted(rounds.items()):
        runs = [by_round[r] for r in sorted(by_round)]
        if not all(r["ok"] for r in runs):
            failed.append(f"{strategy}-{implementation}")
            print(f"{strategy:<20} {implementation:<8} FAILED")
            continue
        key = (strategy, implementation)
        per_rounds[key] = {r: by_round[r]["summary"]["tokens_per_sec"] for r in sorted(by_round)}
        per_round = list(per_rounds[key].values())
        medians[key] = statistics.median(per_round)
        peak = max(max(r["summary"]["peak_mem_bytes_per_rank"]) for r in runs)
        state = "/".join(mib(b) for b in runs[0]["summary"]["model_state_bytes_per_rank"])
        rounds_text = " ".join(f"{t:,.0f}" for t in per_round)
        print(f"{strategy:<20} {implementation:<8} {medians[key]:>28,.0f} "
              f"{rounds_text:>28} {mib(peak):>14} {state:>21}")
    print()

    def ratio(a, b):
        """The ratio of the medians, and the median of the per-round ratios: the two runs of a
        round ran minutes apart, so a machine that is slower for a while slows both, and their
        ratio keeps."""
        paired = paired_ratios(per_rounds[a], per_rounds[b])
        of_medians = medians[a] / medians[b]
        paired_median = statistics.median(paired)
        paired_text = " ".join(f"{q:.3f}" for q in paired)
        return (f"{of_medians:.3f} (paired by round: median {paired_median:.3f}, "
                f"per round {paired_text})")

    for (strategy, implementation), tps in sorted(medians.items()):
        if implementation == "custom" and (strategy, "pytorch") in medians:
            custom_vs_pytorch = ratio((strategy, implementation), (strategy, "pytorch"))
            print(f"{strategy}: custom/pytorch tokens/s = {custom_vs_pytorch}")
        limit = limit_of(strategy)
        if limit in medians and not strategy.startswith("limit"):
            print(f"{strategy} {implementation}: tokens/s vs one process on all cores = "
                  f"{ratio((strategy, implementation), limit)}")
    for a, b in COMPARE:
        if a in medians and b in medians:
            print(f"{'-'.join(a)} / {'-'.join(b)} tokens/s = {ratio(a, b)}")
    if failed:
        print("FAILED: " + ", ".join(failed))
        return 1
    return 0


def markdown(runs_dir):
    """A benchmark file's setup and tables from a bench's runs: the machine, torch version, commit
    and command (setup_lines), median tokens/s over the rounds, and each ratio as the median of the
    per-round ratios, with their range (min-max)."""
    for line in setup_lines(runs_dir):
        print(line)
    print()
    tps = {key: {r: run["summary"]["tokens_per_sec"] for r, run in by_round.items() if run["ok"]}
           for key, by_round in bench_rounds(runs_dir).items()}

    def cell(a, b):
        if not tps.get(a) or not tps.get(b):
            return "-"
        paired = paired_ratios(tps[a], tps[b])
        return f"{statistics.median(paired):.2f} ({min(paired):.2f}-{max(paired):.2f})"

    print("| run | impl | tokens/s | vs one process | custom vs pytorch |")
    print("|---|---|---:|---|---|")
    for (strategy, implementation), by_round in sorted(tps.items()):
        median = f"{statistics.median(by_round.values()):,.0f}" if by_round else "FAILED"
        vs_pytorch = cell((strategy, "custom"), (strategy, "pytorch"))
        vs_pytorch = vs_pytorch if implementation == "custom" else ""
        vs_limit = "" if strategy.startswith("limit") else cell((strategy, implementation),
                                                                limit_of(strategy))
        print(f"| {strategy} | {implementation} | {median} | {vs_limit} | {vs_pytorch} |")
    print()
    print("| run | against | tokens/s ratio |")
    print("|---|---|---|")
    for a, b in COMPARE:
        if tps.get(a) and tps.get(b):
            print(f"| {'-'.join(a)} | {'-'.join(b)} | {cell(a, b)} |")
    return 0


def write_setup(runs_dir, command):
    """runs_dir/setup.json, which run_all.sh writes before its runs: the CPU's model, the logical
    CPUs, the GPUs' names, the torch version, the commit and the command that made the runs."""
    import torch  # only here: the tables need no torch
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    version = torch.__version__
    if torch.version.cuda:
        version += f" (CUDA {torch.version.cuda})"
    setup = {"cpu": cpu_model(), "cpus": os.cpu_count(), "gpus": gpus, "torch": version,
             "commit": commit(), "command": command}
    with open(os.path.join(runs_dir, "setup.json"), "w") as f:
        json.dump(setup, f, indent=1)
        f.write("\n")
    return 0


def cpu_model():
    """The CPU's model name (Linux's /proc/cpuinfo, else platform.processor()), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def commit():
    """The checkout's commit, marked when it has uncommitted changes; None outside git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)

    try:
        head = git("rev-parse", "HEAD")
        changes = git("status", "--porcelain", "--untracked-files=no")
    except OSError:  # no git on this machine
        return None
    if head.returncode != 0:
        return None
    if changes.stdout.strip():
        return head.stdout.strip() + " (with uncommitted changes)"
    return head.stdout.strip()


def setup_lines(runs_dir):
    """Markdown lines naming the machine, torch version, commit and command of the runs in runs_dir
    (its setup.json), "unknown" for whatever it does not record."""
    path = os.path.join(runs_dir, "setup.json")
    setup = {}
    if os.path.exists(path):
        with open(path) as f:
            setup = json.load(f)
    cpu = setup.get("cpu") or "unknown"
    if setup.get("cpus"):
        cpu += f" ({setup['cpus']} logical CPUs)"
    gpus = setup.get("gpus")
    if gpus is None:
        gpu = "unknown"
    elif not gpus:
        gpu = "none"
    elif len(set(gpus)) == 1:
        gpu = f"{len(gpus)} x {gpus[0]}"
    else:
        gpu = ", ".join(gpus)
    command = f"`{setup['command']}`" if setup.get("command") else "unknown"
    return [f"- CPU: {cpu}", f"- GPU: {gpu}", f"- torch: {setup.get('torch') or 'unknown'}",
            f"- commit: {setup.get('commit') or 'unknown'}", f"- command: {command}"]


def _slashed(values, spec):
    """One value per rank in one cell, "a/b/c", each formatted with `spec`."""
    return "/".join(format(x, spec) for x in values)


def _slashed_mib(values):
    return _slashed([x / 2**20 for x in values], ".1f")


EXTRA_KEYS = {  # summary key -> (column, format)
    "exposed_comm_ms_per_rank": ("exposed comm ms/rank", lambda v: _slashed(v, ".1f")),
    "saved_activation_bytes_per_rank": ("activations MiB/rank", lambda v: mib(max(v))),
    "bubble_measured": ("bubble", lambda v: f"{v:.1%}"),
    "bubble_theory": ("theory", lambda v: f"{v:.1%}"),
    "bubble_for_stage_times": ("for these stage times", lambda v: f"{v:.1%}"),
    "peak_activation_bytes_per_rank": ("peak act. MiB/rank", _slashed_mib),
    "compute_ms_per_rank": ("F+B ms/rank", lambda v: _slashed(v, ".0f")),
    "broadcast_wait_ms_per_rank": ("broadcast wait ms/rank", lambda v: _slashed(v, ".0f")),
    "reduce_wait_ms_per_rank": ("reduce wait ms/rank", lambda v: _slashed(v, ".0f")),
    "attention_ms_per_rank": ("attention ms/rank", lambda v: _slashed(v, ".0f")),
}


def extra(runs_dir):
    failed = []
    print(f"{'run':<32} {'tokens/s':>10} {'peak MiB/rank':>14}  strategy-specific")
    for name in sorted(os.listdir(runs_dir)):
        if not os.path.isdir(os.path.join(runs_dir, name)):  # setup.json
            continue
        run = load(os.path.join(runs_dir, name))
        if not run["ok"]:
            failed.append(name)
            print(f"{name:<32} FAILED (exit {run['exit_code']})")
            continue
        s = run["summary"]
        cells = []
        for key, (column, fmt) in EXTRA_KEYS.items():
            if key in s:
                cells.append(f"{column} {fmt(s[key])}")
        details = ", ".join(cells)
        peak = mib(max(s["peak_mem_bytes_per_rank"]))
        print(f"{name:<32} {s['tokens_per_sec']:>10,.0f} {peak:>14}  {details}")
    activation_checkpointing(runs_dir)
    if failed:
        print("FAILED: " + ", ".join(failed))
        return 1
    return 0


def activation_checkpointing(runs_dir):
    """The ac-<strategy>-<mode> runs: each mode's tokens/s, peak memory and kept bytes, against
    none's."""
    runs = {}
    for name in os.listdir(runs_dir):
        if name.startswith("ac-"):
            run = load(os.path.join(runs_dir, name))
            if run["ok"]:
                runs[tuple(name[3:].rsplit("-", 1))] = run["summary"]
    if not runs:
        return
    print(f"\n{'--activation_checkpointing':<28} {'tokens/s':>10} {'vs none':>8} "
          f"{'peak MiB/rank':>14} {'kept MiB/rank':>14} {'vs none':>8}")
    for strategy in sorted({s for s, _ in runs}):
        none = runs.get((strategy, "none"))
        for mode in ("none", "selective", "full"):
            s = runs.get((strategy, mode))
            if s is None or none is None:
                continue
            kept, kept_none = (run.get("saved_activation_bytes_per_rank")
                               or run.get("peak_activation_bytes_per_rank") for run in (s, none))
            kept_cells = f"{'-':>14} {'-':>8}"
            if kept and kept_none:
                kept_cells = f"{max(kept) / 2**20:>14.1f} {max(kept) / max(kept_none):>8.2f}"
            speed = s["tokens_per_sec"] / none["tokens_per_sec"]
            peak = mib(max(s["peak_mem_bytes_per_rank"]))
            print(f"{strategy + ' ' + mode:<28} {s['tokens_per_sec']:>10,.0f} {speed:>8.2f} "
                  f"{peak:>14} {kept_cells}")


if __name__ == "__main__":
    mode, runs_dir = sys.argv[1], sys.argv[2]
    smoke_gpu = functools.partial(smoke, tol=GPU_BF16_TOL)
    modes = {"smoke": smoke, "smoke-gpu": smoke_gpu, "bench": bench, "extra": extra,
             "markdown": markdown, "setup": write_setup}
    sys.exit(modes[mode](runs_dir, *sys.argv[3:]))
