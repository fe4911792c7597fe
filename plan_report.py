"""plan_report.py: plan.py's command line, and where its ranks sit: which bytes cross nodes, and the
step's time on a GPU.

    python plan.py --nproc_per_node 8 --nnodes 2 --gpu h100 fsdp_train.py --preset gpt2
"""
import argparse
import importlib
import json
import math
import sys
from dataclasses import asdict

import numpy as np

import plan
from common.config import parse_args


def script_flags(script):
    """The script's strategy name, add_<name>_flags and check_<name>_args (zero3_tuning's are
    zero3's)."""
    name, module = script.split("_")[0], importlib.import_module(script[:-3])
    return name, getattr(module, f"add_{name}_flags"), getattr(module, f"check_{name}_args")


def script_args(script, argv, world_size):
    """The script's own parser and checks: its defaults, and its one line on bad input."""
    name, add_flags, check = script_flags(script)
    args = parse_args(name, add_flags, argv)
    check(args, world_size)
    return args


def grid_axes(script, args, world_size):
    """The script's rank grid, outermost axis first, the last axis's ranks consecutive."""
    name = script.split("_")[0]
    if name == "hybrid":
        return [("dp", args.data_parallel_size), ("pp", args.pipeline_parallel_size),
                ("cp", args.context_parallel_size), ("tp", args.tensor_parallel_size)]
    if script == "fsdp_hsdp_train.py":  # (-1, S): a shard group's ranks consecutive
        return [("replicate", args.replicate_size), ("shard", world_size // args.replicate_size)]
    if name in ("tp", "cp", "ep"):  # its grid, (-1, size) (ep: (replicas, -1))
        inner = world_size // args.data_parallel_size if name == "ep" else getattr(
            args, {"tp": "tensor_parallel_size", "cp": "context_parallel_size"}[name])
        return [("replica" if name == "ep" else "dp", world_size // inner), (name, inner)]
    return [("pp" if name == "pp" else "world", world_size)]


def between_nodes(rank, axes, nproc_per_node):
    """{collective@group: bytes of it that cross nodes}, the most of the class's ranks; sets
    rank.sizes, each group's ranks. Each group's share is computed once for a class of ranks (a
    search plans a layout's classes again for each variant), a class known by its size, ends and
    sum: each of plan.py's (all ranks, one, a hybrid stage's, ZeRO's owners of world groups)."""
    worst, rank.sizes, members, r = {}, {}, rank.ranks, None
    known = (tuple(axes), nproc_per_node, len(members), members[0], members[-1], sum(members))
    for key, nbytes in rank.comm.items():
        if (known, key) not in CROSSING:
            r = np.array(members) if r is None else r
            CROSSING[known, key] = crossing(axes, nproc_per_node, *key.split("@"), r)
        rank.sizes[key], share = CROSSING[known, key]
        worst[key] = int(share * nbytes)
    return worst


CROSSING = {}  # (class, collective@group): crossing()'s


def crossing(axes, nproc_per_node, collective, group, r):
    """(the group's size, the most of its bytes that cross nodes from any of the ranks r). A group
    (axes joined by 'x'; 'world'; 'tied': the same place at the first and last pp stage) crosses
    when its lowest and highest ranks are on two nodes (torchrun: consecutive ranks a node), and
    then all its bytes do; a send's, the share of its neighbours along the axis (a ring's two, a
    pipeline's one or two) on another node."""
    names, sizes = zip(*axes)
    stride = {a: math.prod(sizes[i + 1:]) for i, a in enumerate(names)}
    size = dict(axes)
    free = names if group in ("world", "vocab") else ["pp"] if group == "tied" else \
        group.split("x")
    coord = {a: r // stride[a] % size[a] for a in free}  # each rank's place on the group's axes
    node = lambda x: x // nproc_per_node  # noqa: E731
    group_size = 2 if group == "tied" else math.prod(size[a] for a in free)
    if collective == "send":  # along the group's first axis: a ring wraps, a pipeline ends
        a = free[0]
        near = [(coord[a] + step) % size[a] for step in (-1, 1)]
        real = [(coord[a] + step == n) | (group != "pp") for step, n in zip((-1, 1), near)]
        cross = sum(ok & (node(r + (n - coord[a]) * stride[a]) != node(r))
                    for ok, n in zip(real, near))
        return group_size, float((cross / sum(real)).max())
    low = r - sum(coord[a] * stride[a] for a in free)
    high = low + sum((size[a] - 1) * stride[a] for a in free)
    return group_size, float((node(low) != node(high)).max())


# ---- time on a GPU ------------------------------------------------------------------------------

# name: (peak dense bf16 FLOP/s, memory bytes, NVLink bytes/s a GPU each way within a node, network
# bytes/s a GPU each way between nodes). NVIDIA's datasheets: A100 SXM4 80GB 312 TFLOP/s, NVLink
# 600 GB/s (both ways); H100 SXM5 989 TFLOP/s, 80 GB, NVLink 900 GB/s; H200 SXM 989 TFLOP/s, 141 GB
# (143,771 MiB as torch reports it), NVLink 900 GB/s. The network: DGX A100's one 200 Gb/s HDR
# InfiniBand port a GPU, DGX H100's (and H200's) one 400 Gb/s NDR port a GPU.
GPUS = {"a100": (312e12, 80 * 2**30, 300e9, 25e9), "h100": (989e12, 80 * 2**30, 450e9, 50e9),
        "h200": (989e12, 143771 * 2**20, 450e9, 50e9)}

# What each script runs behind its compute (its docstring): DDP's buckets during backward, FSDP's
# prefetched gathers and its reduce-scatters (HSDP: and the replicas' all-reduce), ZeRO's async
# reduces (stage 3: its prefetched broadcasts), the ring's K, V hops under the attention,
# tp_overlap's pieces under the matmuls. DiLoCo's outer all-reduce blocks: none hidden.
HIDDEN = {"ddp": ["all_reduce@world"], "fsdp": ["all_gather@world", "reduce_scatter@world",
                                                "all_gather@shard", "reduce_scatter@shard",
                                                "all_reduce@replicate"],  # HSDP's too
          "zero3": ["reduce@world"], "cp": ["send@cp"], "ep": ["all_reduce@world"],
          "hybrid": ["send@cp"]}

# Seconds a byte handed to a collective of n ranks takes at a link's bandwidth (ring algorithms):
# an all-reduce sends and receives 2(n-1)/n of its tensor, a reduce-scatter (n-1)/n, an
# all-gather receives the n-1 other shards, an all-to-all (n-1)/n of its rows.
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_gather": lambda n: n - 1, "all_to_all": lambda n: (n - 1) / n}


def hidden_behind_compute(script, args):
    """HIDDEN's collectives of the script, with ZeRO-3's prefetched broadcasts (--stage 3) and
    tp_overlap's f and g (--tp_overlap)."""
    name = script.split("_")[0]
    hidden = list(HIDDEN.get(name, [])) if script != "ddp_diloco_train.py" else []
    if name == "zero3" and args.stage == 3:
        hidden.append("broadcast@world")
    if getattr(args, "tp_overlap", False):
        hidden += ["send@tp", "all_reduce@tp", "all_gather@tp", "reduce_scatter@tp"]
    return hidden


def step_time(script, args, rank, gpu, efficiency):
    """A rank's step in seconds: its hardware FLOPs at `efficiency` of the GPU's peak, plus the
    communication it does not hide (the hidden only where it outlasts the compute), stretched by
    the pipeline's idle share. Each collective's bytes at NVLink's bandwidth, those that cross
    nodes at the network's."""
    peak, _, nvlink, network = GPUS[gpu]
    compute = rank.flops[1] / (peak * efficiency)
    hidden = hidden_behind_compute(script, args)
    exposed = behind = 0.0
    for key, nbytes in rank.comm.items():
        ring = RING.get(key.split("@")[0], lambda n: 1)(rank.sizes[key])
        seconds = ring * ((nbytes - rank.between[key]) / nvlink + rank.between[key] / network)
        if key in hidden:
            behind += seconds
        else:
            exposed += seconds
    busy = compute + exposed + max(0.0, behind - compute)
    return busy / (1 - (rank.bubble or 0.0))


def human(nbytes):
    unit = min(int(math.log(max(nbytes, 1), 1024)), 3)
    return f"{nbytes:,} B" if unit == 0 else f"{nbytes / 1024**unit:,.1f} {'KMG'[unit - 1]}iB"


def per_rank(ranks, world_size, key):  # one figure of plan.plan's, every rank's, in rank order
    by_rank = {r: getattr(rank, key) for rank in ranks for r in rank.ranks}
    return [by_rank.get(r) for r in range(world_size)]


def peak_measured(script, args):
    """Whether plan.Rank.memory is measured for this run (tests/test_plan.py): every custom
    script's, and the peers built on torch DDP, which keep the custom's buffers; FSDP2, DTensor's
    TP and torch's pipelines keep their own, which the plan does not model."""
    return args.implementation == "custom" or script in ("ddp_train.py", "ep_train.py") or (
        script == "zero3_train.py" and args.stage < 3)


def activations_measured(script, args):
    """Whether plan.Rank.activations is checked against this run's log (tests/runs.py): every custom
    script's, and the peers' but under torch's selective checkpointing (SAC caches out of the
    meter's sight, and keeps more than ours), torch's pipelines', the hybrid peer's (its meter
    spans all micro-batches) and cp's (CUDA only): for those the plan prints the custom script's."""
    return args.implementation == "custom" or (
        args.activation_checkpointing != "selective" and script.split("_")[0] in DENSE_PEERS)


DENSE_PEERS = ("ddp", "fsdp", "zero3", "tp", "ep")  # their peers' activations: measured as ours


def describe(script, ranks, nproc_per_node, nnodes, measured=True, acts_measured=True):
    lines = [f"{script} on {nnodes} x {nproc_per_node} ranks"]
    for rank in ranks:
        r = rank.ranks
        shown = r if len(r) <= 4 else f"{r[0]}..{r[-1]}" if len(r) == r[-1] - r[0] + 1 else \
            f"{r[:4]} and {len(r) - 4} more"
        lines.append(f"ranks {shown}:")
        lines.append(f"  model state    {human(rank.model_state)} (params {human(rank.params)}, "
                     f"grads {human(rank.grads)}, AdamW {human(rank.optimizer)})")
        if rank.activations:
            lines.append(f"  activations    {human(rank.activations)} a micro-batch's forward, "
                         f"{human(rank.peak_activations)} at the most in flight"
                         + ("" if acts_measured else " (the custom script's)"))
        for name, nbytes in rank.transients.items():  # held at the peak with the activations
            lines.append(f"  transient      {human(nbytes)}: {name}")
        lines.append(f"  peak           {human(rank.memory)} on the device, in the loss's backward"
                     if rank.memory > rank.floor else f"  peak           {human(rank.memory)} on "
                     "the device, in the embedding's backward (its dense gradient)")
        lines[-1] += "" if measured else " (the custom script's: PyTorch's keeps its own buffers)"
        for key, nbytes in sorted(rank.comm.items()):
            cross = f", {human(rank.between[key])} between nodes" if nnodes > 1 else ""
            lines.append(f"  {key:28s} {human(nbytes)} a step{cross}")
        if rank.bubble is not None:
            lines.append(f"  bubble         {100 * rank.bubble:.1f}% of the step idle")
        model, hardware = rank.flops
        lines.append(f"  FLOPs          {model:.3e} a step (model), {hardware:.3e} (hardware)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python plan.py", usage="python plan.py [flags] SCRIPT "
                                "[its flags], or python plan.py --search [flags] [model flags]",
                                description="What a script costs per rank, or (--search) every "
                                f"script and layout, ranked. SCRIPT: {', '.join(plan.PLANS)}")
    p.add_argument("--nproc_per_node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--json", action="store_true", help="the figures as JSON")
    p.add_argument("--gpu", choices=list(GPUS), help="estimate the step's time on this GPU")
    p.add_argument("--efficiency", type=float, default=0.5,
                   help="the fraction of the GPU's peak FLOP/s its matmuls reach (0.5)")
    p.add_argument("--search", action="store_true", help="every script and layout, ranked by "
                   "--gpu's time (plan_search.py); the model's flags follow")
    p.add_argument("--global_batch_tokens", type=int, help="--search: tokens an optimizer step")
    p.add_argument("--top", type=int, default=10, help="--search: how many layouts to print")
    argv = sys.argv[1:] if argv is None else argv
    if "--search" in argv:  # plan.py's flags, then the model's: plan_search.py
        import plan_search
        return plan_search.main(p, *p.parse_known_args(argv))
    at = next((i for i, arg in enumerate(argv) if arg.endswith("_train.py")), len(argv))
    ours, theirs = p.parse_args(argv[:at]), argv[at + 1:]  # plan.py's flags, then the script's
    ours.script = argv[at] if at < len(argv) else None
    if ours.script not in plan.PLANS:
        p.error(f"SCRIPT: one of {', '.join(plan.PLANS)}, after plan.py's flags (or --search)")
    world_size = ours.nproc_per_node * ours.nnodes
    if ours.gpu and "--dtype" not in theirs:  # the script's default on these GPUs
        theirs = theirs + ["--dtype", "bfloat16"]
    args = script_args(ours.script, theirs, world_size)
    ranks = plan.plan(ours.script, world_size, theirs, ours.nproc_per_node, args=args)
    estimate = ours.gpu and estimate_step(ours.script, args, ranks, ours.gpu, ours.efficiency,
                                          world_size)
    measured, acts = peak_measured(ours.script, args), activations_measured(ours.script, args)
    if ours.json:
        print(json.dumps(dict(ranks=[asdict(r) | {"model_state": r.model_state, "memory": r.memory}
                                     for r in ranks], peak_measured=measured,
                              activations_measured=acts, estimate=estimate or None), indent=1))
    else:
        print(describe(ours.script, ranks, ours.nproc_per_node, ours.nnodes, measured, acts))
    if estimate and not ours.json:
        whose = "" if measured else ", as the custom script's"
        print(f"on {ours.gpu} at {ours.efficiency:.0%} of peak: "
              f"{estimate['step_s'] * 1e3:,.1f} ms a step, {estimate['tokens_per_sec']:,.0f} "
              f"tokens/s, MFU {estimate['mfu']:.1%}; "
              f"memory {human(estimate['memory'])} of {human(GPUS[ours.gpu][1])} a GPU "
              f"(the largest rank's peak{whose})"
              + ("" if estimate["fits"] else ": DOES NOT FIT"))
    return 0


def estimate_step(script, args, ranks, gpu, efficiency, world_size):
    """The job's step: its slowest rank's; tokens/s and MFU from it; the most memory a rank holds
    at its peak (plan.Rank.memory) and whether it fits the GPU's."""
    step = max(step_time(script, args, rank, gpu, efficiency) for rank in ranks)
    model_flops = sum(rank.flops[0] * len(rank.ranks) for rank in ranks)
    memory = max(rank.memory for rank in ranks)
    return dict(step_s=step, tokens_per_sec=args.batch_size * args.block_size / step,
                mfu=model_flops / (step * GPUS[gpu][0] * world_size), memory=memory,
                fits=memory <= GPUS[gpu][1])


if __name__ == "__main__":
    sys.exit(main())
