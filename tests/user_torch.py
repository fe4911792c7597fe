"""Runs a strategy script's real main() the way torch behaves on our users' machines, not on this CPU:

    USER_TORCH_OUT=<dir> [USER_TORCH_ADAMW=foreach|fused] [USER_TORCH_BEFORE_2_13=1] \\
        python tests/user_torch.py <script> <flags...>              (or as a torchrun/launch() worker)

USER_TORCH_ADAMW: every torch.optim.AdamW (the scripts' own, ShardedAdamW, OwnedAdamW's, the one inside
ZeroRedundancyOptimizer, every peer's) is built with fused=True, the scripts' own path (common.model.FUSED_ADAMW),
or foreach=True, the path AdamW takes by default on CUDA. Both are multi-tensor kernels (aten._fused_adamw_,
aten._foreach_*), which refuse a mix of DTensor and Tensor.
The multi-tensor function is wrapped, to count that it really ran.

USER_TORCH_BEFORE_2_13: the project's own code (the script and common/) sees torch.distributed as torch
< 2.13 shows it: without all_gather_single and reduce_scatter_single, the names 2.13 introduced. torch
itself still sees them (its FSDP2 calls them on 2.13), so only an import made from a file of this
checkout outside tests/ gets the narrowed module.

At exit each rank writes <dir>/rank<RANK>.json: {"rank", "adamw_multi_tensor_steps": calls of the
foreach or fused function, "per_run": those calls in each run}. Flags separated by `---` are several runs
of the script's main() in this process, as tests/runs.py runs them (one launch for several parity rows).
"""
import atexit
import builtins
import importlib
import json
import os
import runpy
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.optim  # noqa: E402

record = {"rank": int(os.environ.get("RANK", 0)), "adamw_multi_tensor_steps": 0, "per_run": []}
ADAMW = os.environ.get("USER_TORCH_ADAMW")
HIDDEN = ("all_gather_single", "reduce_scatter_single") if os.environ.get("USER_TORCH_BEFORE_2_13") else ()


def force_adamw_path(path):
    """AdamW(..., foreach=True) or (..., fused=True) wherever it is built; counts the multi-tensor steps."""
    init = torch.optim.AdamW.__init__

    def __init__(self, params, *args, **kwargs):
        kwargs.update(foreach=path == "foreach", fused=path == "fused")
        init(self, params, *args, **kwargs)
    torch.optim.AdamW.__init__ = __init__
    # AdamW's step looks its implementation up in the module at each call: torch >= 2.6 runs Adam's with
    # decoupled weight decay (torch.optim.adam), older torch its own (torch.optim.adamw).
    kind = "multi_tensor" if path == "foreach" else "fused"
    for module, name in (("torch.optim.adam", f"_{kind}_adam"), ("torch.optim.adamw", f"_{kind}_adamw")):
        module = importlib.import_module(module)
        if hasattr(module, name):
            setattr(module, name, counted(getattr(module, name)))


def counted(function):
    def call(*args, **kwargs):
        record["adamw_multi_tensor_steps"] += 1
        return function(*args, **kwargs)
    return call


class Narrowed(types.ModuleType):
    """A view of a module without some names; every other attribute is the module's own, looked up at use."""

    def __init__(self, module, replaced):
        super().__init__(module.__name__)
        self._module, self._replaced = module, replaced

    def __getattr__(self, name):
        if name in self._replaced:
            value = self._replaced[name]
            if value is None:
                raise AttributeError(f"module 'torch.distributed' has no attribute '{name}' (before torch 2.13)")
            return value
        return getattr(self._module, name)


def hide_new_names_from_the_project():
    narrowed_dist = Narrowed(dist, dict.fromkeys(HIDDEN))
    narrowed_torch = Narrowed(torch, {"distributed": narrowed_dist})
    real_import = builtins.__import__

    def project_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        path = (globals or {}).get("__file__") or ""
        if level or not path.startswith(REPO + os.sep) or path.startswith(os.path.join(REPO, "tests") + os.sep):
            return module
        if name == "torch.distributed" and fromlist:  # from torch.distributed import ...
            return narrowed_dist
        if (name == "torch" or name.startswith("torch.")) and not fromlist:  # import torch(.x.y)( as z)
            return narrowed_torch
        return module
    builtins.__import__ = project_import


def write():
    os.makedirs(os.environ["USER_TORCH_OUT"], exist_ok=True)
    with open(os.path.join(os.environ["USER_TORCH_OUT"], f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)


if ADAMW:
    force_adamw_path(ADAMW)
if HIDDEN:
    hide_new_names_from_the_project()
atexit.register(write)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = REPO
if "---" not in sys.argv:
    runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    record["per_run"].append(record["adamw_multi_tensor_steps"])
else:  # several runs, as tests/runs.py's (a run may start with another script's name): each script imported
    # from this checkout (so the narrowed imports apply), all before the first run (tests/runs.py says why)
    runs = [[]]
    for arg in sys.argv:
        if arg == "---":
            runs.append([])
        else:
            runs[-1].append(arg)
    scripts = []
    for argv in runs:
        if argv[0].endswith("_train.py"):
            script, argv[:] = argv[0], argv[1:]
        scripts.append(importlib.import_module(os.path.basename(script)[:-3]))
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # tests/, after the scripts' narrowed imports
    from runs import fresh_run_state
    for module, argv in zip(scripts, runs):
        fresh_run_state()  # what an earlier run set, as a fresh process has it (tests/runs.py)
        before = record["adamw_multi_tensor_steps"]
        sys.argv = [f"{module.__name__}.py", *argv]  # as in a run of its own (tests/runs.py)
        module.main(argv)
        record["per_run"].append(record["adamw_multi_tensor_steps"] - before)
    from common.distributed import teardown
    teardown()
