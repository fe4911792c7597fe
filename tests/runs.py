"""Runs a strategy script's main() several times in one process per rank, so that one torchrun launch
serves several short runs (a launch costs seconds of start-up, a tiny run a fraction of one).

    torchrun --standalone --nproc_per_node=N tests/runs.py <script> <flags...> [--- [<script>] <flags...>]...

Each group of flags after the script is one run, in order; the process group is set up by the first. A group
that starts with a script's name runs that script, and so do the groups after it (split_runs).
Each run starts with dynamo's caches and counters cleared (torch._dynamo.reset() and counters.clear(): a run
compiles as a fresh process would, with no earlier run's graphs, recompile limit or counts) and, when it has an --out_dir, leaves there
dynamo_rank<RANK>.json, this rank's torch._dynamo.utils.counters after its first training step and at its end:
    {"after_first_step": {"frames": {...}, "stats": {...}, "graph_break": {...}}, "end": {...}}
"""
import importlib
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from common.distributed import teardown  # noqa: E402
from common.metrics import Metrics  # noqa: E402

COUNTED = ("frames", "stats", "graph_break")  # what dynamo traced, compiled, and where it broke
after_first_step = []  # this run's counters after its first training step, once taken


def counted():
    return {key: dict(counters[key]) for key in COUNTED}


def step_counted(step):
    def call(self, *args, **kwargs):
        step(self, *args, **kwargs)
        if not after_first_step:
            after_first_step.append(counted())
    return call


def split_runs(argv):
    """[(script module name, flags), ...] from `<script> <flags> --- [<script>] <flags> ...`."""
    groups, runs, script = [[]], [], None
    for arg in argv:
        if arg == "---":
            groups.append([])
        else:
            groups[-1].append(arg)
    for flags in groups:
        if flags and flags[0].endswith("_train.py"):
            script, flags = os.path.basename(flags[0])[:-3], flags[1:]
        runs.append((script, flags))
    return runs


if __name__ == "__main__":
    Metrics.step = step_counted(Metrics.step)  # the scripts' Metrics: common.metrics' one class
    runs = split_runs(sys.argv[1:])
    # Every script imported before the first run makes a process group, as in a run of its own: a module
    # imported later binds the live default group into its functions' default arguments, past teardown.
    scripts = {script: importlib.import_module(script) for script, _ in runs}
    for script, argv in runs:
        torch._dynamo.reset()
        counters.clear()  # each run's own: an earlier run may have compiled too
        after_first_step.clear()
        sys.argv = [f"{script}.py", *argv]  # as in a run of its own (a checkpoint names the script that wrote it)
        scripts[script].main(argv)
        if "--out_dir" in argv and after_first_step:
            name = f"dynamo_rank{os.environ.get('RANK', '0')}.json"
            with open(os.path.join(argv[argv.index("--out_dir") + 1], name), "w") as f:
                json.dump(dict(after_first_step=after_first_step[0], end=counted()), f)
    teardown()
