"""Runs a strategy script's real main() and records what each rank's model saw, to prove a strategy
is what it claims and not single-process training in disguise (tests/test_ddp.py, tests/test_tp.py).

    PROBE_OUT=<dir> python tests/probe.py <script> <flags...> [--- [<script>] <flags...>]...   (a launch() worker)

A global forward pre-hook on every common.model.GPT (and subclass) records, per rank, the row count of
each training forward's input and the input itself, a digest of the model's parameters (this rank's local part, bytes as
they are) at each training forward, and, at the first one, the local shape of each parameter (a
DTensor's local shard). The torch.distributed collectives are wrapped to count calls by dtype. At
the end of each run it writes <dir>/rank<RANK>.json (one run) or <dir>/<k>/rank<RANK>.json (the k-th of several
runs, separated by "---" as tests/runs.py's are, each its script's main() in this process):
    {"rank", "world_size", "train_rows": [rows per training forward], "eval_rows": [...], "train_x": [token ids],
     "digests": [sha256 per training forward], "params": {name: local shape},
     "collectives": {"all_reduce:torch.float32": calls, ..., "batch_isend_irecv:torch.float32": ops}}
"""
import collections
import hashlib
import importlib
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from common.distributed import BEFORE_2_13, teardown, torch_name  # noqa: E402
from common.model import GPT  # noqa: E402
from runs import fresh_run_state, split_runs  # noqa: E402

record = dict(rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
              train_rows=[], eval_rows=[], train_x=[], digests=[], params=None, collectives=collections.Counter())


def local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def digest(module):
    h = hashlib.sha256()
    for p in map(local, module.parameters()):
        if p.is_meta or p.untyped_storage().nbytes() < p.numel() * p.element_size():
            continue  # not held by this rank now (ZeRO-3 frees what it does not own)
        h.update(p.detach().clone().view(-1).view(torch.uint8).cpu().numpy().tobytes())  # a copy: numpy pins storage
    return h.hexdigest()


def hook(module, inputs):
    if not isinstance(module, GPT):
        return
    (record["train_rows"] if module.training else record["eval_rows"]).append(inputs[0].shape[0])
    if module.training:
        record["digests"].append(digest(module))
        record["train_x"].append(inputs[0].tolist())
    if module.training and record["params"] is None:
        record["params"] = {n: list(local(p).shape) for n, p in module.named_parameters()}


def counted(name, collective):
    def call(*args, **kwargs):  # counted by the dtype of the first tensor (the output, for a gather)
        tensor = (args or list(kwargs.values()))[0]
        record["collectives"][f"{name}:{tensor.dtype}"] += 1
        return collective(*args, **kwargs)
    return call


def write(folder):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)
    record.update(train_rows=[], eval_rows=[], train_x=[], digests=[], params=None, collectives=collections.Counter())


torch.nn.modules.module.register_module_forward_pre_hook(hook)
# Not isend/irecv: P2POp accepts only torch's own functions.
for name in ("all_reduce", "broadcast", "reduce", "send", "recv", "all_to_all_single"):
    setattr(torch.distributed, name, counted(name, getattr(torch.distributed, name)))
# Counted by torch 2.13's names, on any torch: older torch has only the old names (common.distributed calls
# those there, and torch's own FSDP2 too).
for name in BEFORE_2_13:
    setattr(torch.distributed, torch_name(name), counted(name, getattr(torch.distributed, torch_name(name))))
_batch_isend_irecv = torch.distributed.batch_isend_irecv


def batch_isend_irecv(ops):  # one count per send or receive in the batch
    record["collectives"].update(f"batch_isend_irecv:{op.tensor.dtype}" for op in ops)
    return _batch_isend_irecv(ops)


torch.distributed.batch_isend_irecv = batch_isend_irecv
runs = split_runs(sys.argv[1:])
scripts = {script: importlib.import_module(script) for script, _ in runs}  # before any group (tests/runs.py)
for k, (script, argv) in enumerate(runs):
    fresh_run_state()  # what an earlier run set, as a fresh process has it (tests/runs.py)
    sys.argv = [f"{script}.py", *argv]  # as in a run of its own (tests/runs.py)
    scripts[script].main(argv)
    write(os.environ["PROBE_OUT"] if len(runs) == 1 else os.path.join(os.environ["PROBE_OUT"], str(k)))
teardown()
