"""Runs a strategy script's real main() and records what each rank's model saw, to prove a strategy
is what it claims and not single-process training in disguise (tests/test_ddp.py, tests/test_tp.py).

    PROBE_OUT=<dir> python tests/probe.py <script> <flags...>      (or as a torchrun/launch() worker)

A global forward pre-hook on every common.model.GPT (and subclass) records, per rank, the row count of
each training forward's input and, at the first one, the local shape of each of the model's
parameters (a DTensor's local shard). At exit it writes <dir>/rank<RANK>.json:
    {"rank", "world_size", "train_rows": [rows per training forward], "eval_rows": [...],
     "params": {name: local shape}}
"""
import atexit
import json
import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from common.model import GPT  # noqa: E402

record = dict(rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
              train_rows=[], eval_rows=[], params=None)


def local_shape(p):
    return list(p.to_local().shape if hasattr(p, "to_local") else p.shape)


def hook(module, inputs):
    if not isinstance(module, GPT):
        return
    (record["train_rows"] if module.training else record["eval_rows"]).append(inputs[0].shape[0])
    if module.training and record["params"] is None:
        record["params"] = {n: local_shape(p) for n, p in module.named_parameters()}


def write():
    os.makedirs(os.environ["PROBE_OUT"], exist_ok=True)
    with open(os.path.join(os.environ["PROBE_OUT"], f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)


torch.nn.modules.module.register_module_forward_pre_hook(hook)
atexit.register(write)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = REPO
runpy.run_path(os.path.join(REPO, script), run_name="__main__")
