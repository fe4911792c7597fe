"""The refactor check: short runs of every script's defaults and of every parity layout, recorded before a change
and compared, bit for bit, after it.

    python tests/golden.py record DIR [WORD...]     # the runs below (those whose name holds a WORD); DIR/golden.json
    python tests/golden.py compare A B [WORD...]  # A/golden.json against B/golden.json, run by run

A change that only moves code (a rename, a function split, a comment) leaves every run's losses, pre-clip grad
norms and evaluations the same bits: `compare` then prints "identical" for each run and exits 0. A run that differs
prints its largest |dloss| and relative |dnorm| (judge those against tests/test_parity.py's tolerances: a change that
reorders a sum may move the last bits), a run only one side has is listed, and either makes the exit status 1.

The runs (RUNS): the one-process references of tests/test_parity.py (one per model shape), every run of its launches
at 2 and 4 ranks (the parity rows, as-user rows included; the activation-checkpointing, zero-bubble, 4-rank hybrid
and tp dropout runs), and every script's own defaults at 2 ranks on TINY's model. Each is cut to STEPS steps; a run
is named by its script, ranks and flags (those after test_parity's shared FLAGS), so a reference keeps its name when
the script that computes it changes. It takes a few minutes on 2 CPU cores: each rank count is one launch of
tests/runs.py (its runs one after another in one process group, each equal to the same run alone).
"""
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import conftest  # noqa: E402  (the test environment: offline data, CUDA hidden, TINY)
import test_parity  # noqa: E402

STEPS = 4
SCRIPTS = sorted(f for f in os.listdir(conftest.REPO) if f.endswith("_train.py"))
DEFAULTS = conftest.TINY + ["--seed", "1337", "--deterministic"]


def runs(words=()):
    """{nproc (None: one process): {name: (script, args)}}, every run cut to STEPS steps (those whose name holds
    one of `words`, if any)."""
    todo = {None: list(test_parity.reference_runs()), 2: [], 4: []}
    for nproc in (2, 4):
        todo[nproc] += test_parity.launch_group(nproc) + test_parity.launch_group(nproc, as_user=True)
    todo[2] += [(script, DEFAULTS) for script in SCRIPTS]
    named = {}
    for nproc, group in todo.items():
        for script, args in group:
            args = list(args) + ["--max_iters", str(STEPS)]
            own = list(args)
            for shared in (conftest.PARITY, conftest.TINY):  # the common prefix, left out of the name
                if own[:len(shared)] == shared:
                    own = own[len(shared):]
                    break
            while "--max_iters" in own:  # STEPS, for all
                del own[own.index("--max_iters"):own.index("--max_iters") + 2]
            own = own if (script, own) != (script, DEFAULTS[len(conftest.TINY):]) else ["(defaults)"]
            name = " ".join(["reference" if nproc is None else f"{script} {nproc}r", *own])
            if not words or any(word in name for word in words):
                named.setdefault(nproc, {})[name] = (script, args)
    return named


def record(directory, words=()):
    error = conftest.data.prepare("shakespeare")
    if error:
        sys.exit(error)
    os.makedirs(directory, exist_ok=True)
    results = {}
    for nproc, group in runs(words).items():
        with tempfile.TemporaryDirectory() as scratch:  # each run's checkpoint and metrics: tens of MB, not kept
            argv, out_dirs = [], {}
            for k, (name, (script, args)) in enumerate(group.items()):
                out_dirs[name] = os.path.join(scratch, f"{nproc or 1}r-{k}")
                argv += [script, *args, "--out_dir", out_dirs[name], "---"]
            print(f"{len(group)} runs at {nproc or 1} rank(s)", flush=True)
            result = conftest.launch("tests/runs.py", nproc, argv[:-1], timeout=120 + 30 * len(group),
                                     torchrun=False)
            if result.returncode:
                sys.exit(f"the launch at {nproc or 1} rank(s) failed:\n{result.stdout[-3000:]}\n"
                         f"{result.stderr[-3000:]}")
            results.update({name: conftest.run_record(out_dir) for name, out_dir in out_dirs.items()})
    with open(os.path.join(directory, "golden.json"), "w") as f:
        json.dump(results, f, indent=0, sort_keys=True)
    print(f"{len(results)} runs recorded in {directory}/golden.json")


def compare(a, b, words=()):
    old, new = ({name: run for name, run in json.load(open(os.path.join(d, "golden.json"))).items()
                 if not words or any(word in name for word in words)} for d in (a, b))
    bad = 0
    for name in sorted(old.keys() | new.keys()):
        if name not in old or name not in new:
            print(f"only in {a if name in old else b}: {name}")
            bad += 1
        elif old[name] == new[name]:
            print(f"identical: {name}")
        else:
            try:
                dloss, dnorm = test_parity.differences(new[name], old[name])
                print(f"differs: {name}: |dloss| {dloss:.3g}, |dnorm| relative {dnorm:.3g}")
            except AssertionError as error:  # another length, or a NaN
                print(f"differs: {name}: {str(error).splitlines()[0]}")
            bad += 1
    total = len(old.keys() | new.keys())
    print(f"{total - bad} of {total} runs identical")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) >= 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3], sys.argv[4:]))
    else:
        sys.exit(__doc__.split("\n\n")[1])
