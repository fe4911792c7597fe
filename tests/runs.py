"""Runs a strategy script's main() several times in one process per rank, so that one torchrun launch
serves several short runs (a launch costs seconds of start-up, a tiny run a fraction of one).

    torchrun --standalone --nproc_per_node=N tests/runs.py <script> <flags...> [--- [<script>] <flags...>]...

Each group of flags after the script is one run, in order; the process group is set up by the first. A group
that starts with a script's name runs that script, and so do the groups after it (split_runs).
Each run starts from what a fresh process has (fresh_run_state: dynamo's caches and counters, so that a run compiles
as a fresh process would, with no earlier run's graphs, recompile limit or counts; deterministic mode; ...) and, when
it has an --out_dir, leaves there
dynamo_rank<RANK>.json, this rank's torch._dynamo.utils.counters after its first training step and at its end:
    {"after_first_step": {"frames": {...}, "stats": {...}, "graph_break": {...}}, "end": {...}}
comm_steps_rank<RANK>.json, the bytes this rank handed to each collective in each training step from the second on
(the first's include setup's polls), by process group, as plan.py counts them (an all-reduce's tensor, an
all-gather's input, a reduce-scatter's input; the AVG all-reduces of the logged loss and of evaluations left out, as
plan.py leaves them), in step order:
    [{"all_reduce@0,2": bytes, "reduce_scatter@0,1": bytes, ...}, ...]  (the group's ranks, in order)
and attend_rank<RANK>.json, how often this rank's attention cores ran (every class's `attend`, the function
--activation_checkpointing selective recomputes and full recomputes inside its block), outside compiled code:
    {"forward": calls with autograd recording, outside backward, "backward": calls inside backward (a recompute)}
"""
import functools
import importlib
import inspect
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch._dynamo  # noqa: E402
import torch.utils.deterministic  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from common.distributed import teardown  # noqa: E402
from common.metrics import Metrics, timers  # noqa: E402
import plan  # noqa: E402
import plan_report  # noqa: E402

COUNTED = ("frames", "stats", "graph_break")  # what dynamo traced, compiled, and where it broke
after_first_step = []  # this run's counters after its first training step, once taken
MEMORY = "@memory"  # in a run's flags: the run goes under conftest.DeviceMemory (measured below)
memory = dict(meter=None, steps=0, step_peak=None)  # the run's meter, its steps, its second's peak


def counted():
    return {key: dict(counters[key]) for key in COUNTED}


def step_counted(step):
    def call(self, *args, **kwargs):
        step(self, *args, **kwargs)
        if not after_first_step:
            after_first_step.append(counted())
        comm["steps"] += 1
        if comm["steps"] >= 2:  # from the previous step's end to this one's (the first's holds setup's polls)
            comm["per_step"].append(dict(comm["bytes"]))
        comm["bytes"].clear()
        if memory["meter"] is not None:  # from the first step's end to the second's: a step's peak
            meter, memory["steps"] = memory["meter"], memory["steps"] + 1
            if memory["steps"] == 2:
                memory["step_peak"] = meter.peak
            meter.peak = meter.alive
    return call


attends = dict(forward=0, backward=0)
comm = dict(bytes={}, steps=0, per_step=[], members={})  # bytes by collective@group: so far, each step's from the 2nd
COUNTED_COLLECTIVES = {"all_reduce": (0, 2), "all_gather_single": (1, 2), "all_gather_into_tensor": (1, 2),
                       "reduce_scatter_single": (1, 3), "reduce_scatter_tensor": (1, 3)}  # (input's, group's) place


def count_collectives():
    """Wraps torch.distributed's collectives that plan.py counts: each call adds its input's bytes to
    comm["bytes"] under collective@group (the scripts look them up on torch.distributed at each call)."""
    import torch.distributed as dist
    members = comm["members"]  # id(group) -> its ranks as the key names them, once a group and run

    def counting(name, place, group_place, collective):
        short = "_".join(name.split("_")[:2])  # all_gather_single, all_gather_into_tensor: all_gather

        def call(*args, **kwargs):
            group = kwargs.get("group", args[group_place] if len(args) > group_place else None)
            op = kwargs.get("op", args[1] if name == "all_reduce" and len(args) > 1 else None)
            if op != dist.ReduceOp.AVG:
                tensor = args[place] if len(args) > place else kwargs["tensor" if place == 0 else "input"]
                group = group or dist.group.WORLD  # by id: holding the group would outlive teardown
                if id(group) not in members:
                    members[id(group)] = ",".join(map(str, dist.get_process_group_ranks(group)))
                ranks = members[id(group)]
                key = f"{short}@{ranks}"
                comm["bytes"][key] = comm["bytes"].get(key, 0) + tensor.numel() * tensor.element_size()
            return collective(*args, **kwargs)
        return functools.wraps(collective)(call)
    for name, places in COUNTED_COLLECTIVES.items():
        if hasattr(dist, name):
            setattr(dist, name, counting(name, *places, getattr(dist, name)))


def fresh_run_state():
    """Puts back, before each run of a launch (this file's, tests/probe.py's, tests/user_torch.py's), what a run of a
    script's main() may leave set in its process, as a fresh process has it: so a batched run is the run alone
    (tests/test_parity.py's test_a_batched_run_equals_the_same_run_alone):
    - dynamo's caches and counters (an earlier run's graphs, recompile limit and counts);
    - --deterministic's mode, its NaN fill of torch.empty, and on CUDA the SDPA kernels it turns off;
    - inductor's fallback_random (--compile, common.model.compile_forward);
    - the timers' spans (--print_schedule).
    Kept, as they need not be reset: the default process group, which setup() reuses (it holds no number, only the
    order of collectives, which every rank advances alike); DTensor's sharding-propagation caches and
    torch.distributed's lru_caches (pure memoisation: a hit returns what a miss computes; warm, a later run starts
    seconds sooner);
    gc.freeze (once a process, it moves the imports out of the collector's walks and changes no value); the seeds,
    threads, TF32 and the meters, which setup() sets anew."""
    torch._dynamo.reset()
    counters.clear()
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True  # its default, read only in deterministic mode
    for backend in ("flash", "mem_efficient", "cudnn", "math"):
        getattr(torch.backends.cuda, f"enable_{backend}_sdp")(True)
    if "torch._inductor.config" in sys.modules:
        sys.modules["torch._inductor.config"].fallback_random = False
    timers.keep_spans = False


def count_attends(modules):
    """Wraps the `attend` of every class defined in `modules` to count its calls into `attends`: under a backward
    (autograd is running a node: only a recompute calls it there) or in a forward that autograd records. Compiled
    code calls it uncounted (dynamo traces the original), so no compiled graph changes."""
    classes = {c for m in modules for _, c in inspect.getmembers(m, inspect.isclass) if "attend" in vars(c)}
    for cls in classes:
        def counted_attend(self, *args, _attend=vars(cls)["attend"]):
            if not torch.compiler.is_compiling():
                if torch._C._current_autograd_node() is not None:
                    attends["backward"] += 1
                elif torch.is_grad_enabled():
                    attends["forward"] += 1
            return _attend(self, *args)
        cls.attend = functools.wraps(vars(cls)["attend"])(counted_attend)


def check_plan(script, argv, out_dir):
    """plan.py's figures for this run, rank by rank, against what the run logged, for every run the
    suite makes through this file: the model state exactly; a custom pipeline's activations at its
    peak exactly; the saved activations (one micro-batch's forward) within 5%, a custom script's and
    a peer's where plan_report.activations_measured says the plan models them."""
    path = os.path.join(out_dir, "metrics.jsonl")
    summary = [json.loads(line) for line in open(path) if '"summary"' in line] if os.path.exists(path) else []
    if script not in plan.PLANS or not summary or not summary[-1]["tokens_per_sec"]:
        return  # a run that took no step (--max_iters 0, a resume at its end) has no gradients: the plan is a step's
    logged = summary[-1]["model_state_bytes_per_rank"]
    args = plan_report.script_args(script, argv, len(logged))  # the script's own parser, once
    ranks = plan.plan(script, len(logged), argv, args=args)
    predicted = plan_report.per_rank(ranks, len(logged), "model_state")
    if predicted != logged:
        raise AssertionError(f"plan.py {script} {' '.join(argv)}: model state per rank {predicted}, the run "
                             f"logged {logged}")
    if not plan_report.activations_measured(script, args):
        return  # torch's schedules' and policies': the plan prints the custom script's, and says so
    peak = summary[-1].get("peak_activation_bytes_per_rank")  # a pipeline's: the schedule's most held
    planned = plan_report.per_rank(ranks, len(logged), "peak_activations")
    if peak and peak != planned:
        raise AssertionError(f"plan.py {script} {' '.join(argv)}: activations at the peak per rank {planned}, "
                             f"the run logged {peak}")
    saved = summary[-1].get("saved_activation_bytes_per_rank") or []  # one micro-batch's forward
    for predicted, measured in zip(plan_report.per_rank(ranks, len(logged), "activations"), saved):
        if measured is not None and abs(predicted - measured) > 0.05 * measured:
            raise AssertionError(f"plan.py {script} {' '.join(argv)}: activations {predicted}, the run "
                                 f"logged {measured}: more than 5% apart")


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
    project = [m for name, m in sys.modules.items() if name.startswith(("common.", "peers."))]
    count_attends([*scripts.values(), *project])
    count_collectives()
    for script, argv in runs:
        fresh_run_state()
        after_first_step.clear()
        attends.update(forward=0, backward=0)
        comm.update(bytes={}, steps=0, per_step=[])
        comm["members"].clear()  # a group's id may be another's in a later run
        measured = MEMORY in argv
        argv = [arg for arg in argv if arg != MEMORY]
        sys.argv = [f"{script}.py", *argv]  # as in a run of its own (a checkpoint names the script that wrote it)
        if measured:
            from conftest import DeviceMemory  # the test environment's model of a GPU's memory
            import common.model  # and CUDA's loss path, which plan.loss_backward counts
            memory.update(meter=DeviceMemory(whole_run=True), steps=0, step_peak=None)
            common.model.RECOMPUTE_LOG_SOFTMAX, cpu_loss = True, common.model.RECOMPUTE_LOG_SOFTMAX
            with memory["meter"]:
                scripts[script].main(argv)
            memory["meter"], common.model.RECOMPUTE_LOG_SOFTMAX = None, cpu_loss
        else:
            scripts[script].main(argv)
        if "--out_dir" not in argv:
            continue
        out_dir, rank = argv[argv.index("--out_dir") + 1], os.environ.get("RANK", "0")
        if rank == "0":
            check_plan(f"{script}.py", argv, out_dir)
        if measured:
            with open(os.path.join(out_dir, f"memory_rank{rank}.json"), "w") as f:
                json.dump(dict(step_peak=memory["step_peak"]), f)
        with open(os.path.join(out_dir, f"attend_rank{rank}.json"), "w") as f:
            json.dump(attends, f)
        if comm["per_step"]:
            with open(os.path.join(out_dir, f"comm_steps_rank{rank}.json"), "w") as f:
                json.dump(comm["per_step"], f)
        if after_first_step:
            with open(os.path.join(out_dir, f"dynamo_rank{rank}.json"), "w") as f:
                json.dump(dict(after_first_step=after_first_step[0], end=counted()), f)
    teardown()
