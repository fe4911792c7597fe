"""Runs a strategy script's main() several times in one process per rank, so that one torchrun launch
serves several short runs (a launch costs seconds of start-up, a tiny run a fraction of one).

    torchrun --standalone --nproc_per_node=N tests/runs.py <script> <flags...> [--- <flags...>]...

Each group of flags after the script is one run, in order; the process group is set up by the first.
"""
import importlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common.distributed import teardown  # noqa: E402


def split_runs(argv):
    runs = [[]]
    for arg in argv:
        if arg == "---":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


if __name__ == "__main__":
    script = importlib.import_module(os.path.basename(sys.argv[1])[:-3])
    for argv in split_runs(sys.argv[2:]):
        script.main(argv)
    teardown()
