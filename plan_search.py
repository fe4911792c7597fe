"""plan_search.py: `python plan.py --search`, every script and layout a cluster allows, ranked by
the step's predicted time.

    python plan.py --search --nnodes 2 --nproc_per_node 8 --gpu h100 \\
        --global_batch_tokens 524288 --preset gpt2

A layout is a script (tier 1 and tier 2, --implementation custom) with its parallel sizes and
modes: ZeRO's stage, FSDP's reshard, TP's sequence parallelism, CP's attention, the pipeline's
schedule. Each goes through the script's own parser and checks; a refusal drops it, counted by
its reason. A layout's variants are its micro-batch (accumulation steps, or a pipeline's
micro-batches) and --activation_checkpointing. plan.py gives each variant's memory at its peak
and plan_report.py its step time; the fastest variant that fits the GPU's memory stands for
the layout. The best ten layouts are printed with their torchrun commands.
"""
import contextlib
import copy
import functools
import io
import itertools
import math
import time

import plan
import plan_report
from common.config import parse_args

MODEL_FLAGS = ("--preset", "--n_layer", "--n_head", "--n_embd", "--block_size", "--vocab_size",
               "--dropout", "--bias", "--n_experts", "--top_k", "--expert_hidden",
               "--aux_loss_coef", "--init_from")
MODES = ("none", "selective", "full")  # --activation_checkpointing, the cheapest first
PIPELINES = {"pp_train.py": ["gpipe", "1f1b", "interleaved"], "pp_zb_train.py": ["zb1p", "zbv"],
             "pp_vocab_train.py": ["1f1b"]}


@functools.lru_cache
def divisors(n):
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def grids(world, n):
    """Every way to write world as a product of n sizes, in order."""
    if n == 1:
        return [(world,)]
    return [(d, *rest) for d in divisors(world) for rest in grids(world // d, n - 1)]


def layouts(world, config):
    """(script, its layout's flags, its pipeline's stages, the replicas that split the batch) for
    every script and size on `world` ranks; hybrid's flags only where each size divides what it
    splits, else None (its checks would refuse them: counted as not dividing, and not parsed, so
    that 100,000 ranks stay quick). Not DiLoCo: another optimizer, so not the same loss a step."""
    flag = lambda *pairs: [str(x).lower() for pair in pairs for x in pair]  # noqa: E731
    yield "ddp_train.py", [], 1, world
    for reshard in (True, False):
        yield "fsdp_train.py", flag(("--reshard_after_forward", reshard)), 1, world
        for replicas in divisors(world)[1:-1]:  # HSDP (R = 1: fsdp_train.py; R = world: DDP)
            sizes = flag(("--replicate_size", replicas), ("--reshard_after_forward", reshard))
            yield "fsdp_hsdp_train.py", sizes, 1, world
    for stage in (1, 2, 3):
        yield "zero3_train.py", flag(("--stage", stage)), 1, world
    yield "zero3_tuning_train.py", [], 1, world  # stage 3, with DeepSpeed's reuse and buckets
    for tp, sp in itertools.product(divisors(world)[1:], (False, True)):
        for script in ("tp_train.py", "tp_overlap_train.py"):
            sizes = flag(("--tensor_parallel_size", tp), ("--sequence_parallel", sp))
            yield script, sizes, 1, world // tp
    for cp, mode in itertools.product(divisors(world)[1:], ("ring", "allgather", "ulysses")):
        sizes = flag(("--context_parallel_size", cp), ("--cp_mode", mode))
        yield "cp_train.py", sizes, 1, world // cp
    for script, schedules in PIPELINES.items():
        for schedule in schedules:
            yield script, flag(("--schedule", schedule)), world, 1
    for dp in divisors(world) if config.n_experts else []:
        yield "ep_train.py", flag(("--data_parallel_size", dp)), 1, world
    for dp, pp, cp, tp in grids(world, 4):
        divide = (config.n_layer % pp, config.n_head % tp, config.block_size % cp) == (0, 0, 0)
        for sp in (False, True) if tp > 1 else (False,):
            sizes = flag(("--data_parallel_size", dp), ("--pipeline_parallel_size", pp),
                         ("--context_parallel_size", cp), ("--tensor_parallel_size", tp),
                         ("--sequence_parallel", sp))
            yield "hybrid_train.py", sizes if divide else None, pp, dp


def variants(rows, stages):
    """(flag, value) of the micro-batch, in the order that finds a layout's best first:
    accumulation steps A from 1 up, or (a pipeline, and hybrid with pp > 1, A = 1) micro-batches
    M from the most down; powers of two, or all of them, that divide a replica's rows. M stops
    at 8 a stage: the bubble is then under 1/9 of the step, and the planner does not model what
    smaller micro-batches cost (their smaller matmuls' efficiency)."""
    counts = [n for n in divisors(rows) if n & (n - 1) == 0 or n == rows] if rows else []
    if stages > 1:
        return [("--n_microbatches", n) for n in reversed(counts) if n <= 8 * stages]
    return [("--grad_accum_steps", n) for n in counts]


@functools.lru_cache(maxsize=1024)
def parsed(script, argv):
    """The script's own parser on a layout's flags: once a layout (a variant's values are read by
    the script's checks only)."""
    name, add_flags, _ = plan_report.script_flags(script)
    return parse_args(name, add_flags, list(argv))


def parse(script, argv, variant, world):
    """The script's own args for a layout's flags and a variant's values (their checks: the
    script's), or its one refusal line, printed by the checks and caught here."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            args = copy.copy(parsed(script, tuple(argv)))
            vars(args).update(variant)
            plan_report.script_flags(script)[2](args, world)
            return args, None
        except SystemExit:
            return None, err.getvalue().strip().splitlines()[-1:] or ["refused"]


def best_variant(script, flags, stages, rows, ours, base, world):
    """The layout's fastest variant that fits, as ((seconds, its place in variants(), the mode's in
    MODES), memory, argv, estimate): on equal times, the fewest accumulation steps (or most
    micro-batches), then the least recomputation; or None and why ('memory', 'divide',
    'unsupported'); and how many variants were planned. In each mode the first variant that fits
    is its best: a smaller micro-batch adds accumulation steps, fewer micro-batches add bubble and
    hold no less. A mode that fits at its first variant ends the search (the next modes recompute
    more of the same), as does one the script refuses in every variant (no check reads the
    mode)."""
    reason, planned, best = None, 0, None
    for m, mode in enumerate(MODES):
        accepted, at_first = 0, False
        for i, (flag, n) in enumerate(variants(rows, stages) or [("--grad_accum_steps", 1)]):
            args, refusal = parse(script, base + flags, {flag[2:]: n,
                                                         "activation_checkpointing": mode}, world)
            if args is None:
                reason = reason or ("divide" if "divisible" in refusal[0] else "unsupported")
                continue
            accepted, planned = accepted + 1, planned + 1
            ranks = plan.plan(script, world, None, ours.nproc_per_node, args=args)
            estimate = plan_report.estimate_step(script, args, ranks, ours.gpu, ours.efficiency,
                                                 world)
            if estimate["fits"]:
                argv = base + flags + [flag, str(n), "--activation_checkpointing", mode]
                row = ((estimate["step_s"], i, m), estimate["memory"], argv, estimate)
                best, at_first = min(best or row, row, key=lambda row: row[0]), accepted == 1
                break
            reason = "memory"
            if stages > 1:  # fewer micro-batches hold no less
                break
        if at_first or not accepted:
            break
    return best, reason or "unsupported", planned


def main(p, ours, model):
    """plan_report.main's parser p, and what it parsed: plan.py's flags, then the model's."""
    if ours.gpu is None or ours.global_batch_tokens is None:
        p.error("--search: needs --gpu (the time it ranks by) and --global_batch_tokens")
    start, world = time.perf_counter(), ours.nproc_per_node * ours.nnodes
    unknown = [arg.split("=")[0] for arg in model if arg.startswith("--")]
    unknown = [flag for flag in unknown if flag not in MODEL_FLAGS]
    if unknown:
        raise SystemExit(f"error: {unknown[0]}: not a model flag; the search chooses the others")
    checked, refusal = parse("ep_train.py" if "--n_experts" in model else "ddp_train.py", model,
                             {}, 1)
    if checked is None:  # the model's own flags, checked once
        raise SystemExit(refusal[0])
    if ours.global_batch_tokens % checked.block_size:
        raise SystemExit(f"error: --global_batch_tokens: {ours.global_batch_tokens} must be "
                         f"divisible by --block_size ({checked.block_size})")
    batch = ours.global_batch_tokens // checked.block_size
    base = model + ["--dtype", "bfloat16", "--batch_size", str(batch)]
    config = plan.gpt_config(checked)
    kept, dropped, planned, total = [], {"divide": 0, "unsupported": 0, "memory": 0}, 0, 0
    for script, flags, stages, replicas in layouts(world, config):
        total += 1
        if flags is None:  # hybrid's sizes that do not divide the model
            dropped["divide"] += 1
            continue
        best, reason, n = best_variant(script, flags, stages, batch // replicas, ours, base, world)
        planned += n
        if best is None:
            dropped[reason] += 1
        else:
            kept.append((best[0][0], best[1], script, best[2], best[3]))
    kept.sort(key=lambda row: row[:2])
    print(report(ours, world, kept[:ours.top]))
    print(f"{total:,} layouts, {planned:,} variants planned in {time.perf_counter() - start:.1f} "
          f"s: {len(kept):,} fit; dropped {dropped['memory']:,} that fit in no variant "
          f"(memory), {dropped['divide']:,} that do not divide, {dropped['unsupported']:,} "
          f"that the scripts refuse")
    return 0


def report(ours, world, rows):
    torchrun = f"torchrun --nnodes {ours.nnodes} --nproc_per_node {ours.nproc_per_node}"
    lines = [f"{world} x {ours.gpu} at {ours.efficiency:.0%} of peak: the fastest layouts that fit",
             f"{'':3}{'ms a step':>10}{'tokens/s':>13}{'MFU':>7}{'memory':>11}"]
    for i, (seconds, memory, script, argv, estimate) in enumerate(rows, 1):
        lines.append(f"{i:>2} {seconds * 1e3:>10,.1f}{estimate['tokens_per_sec']:>13,.0f}"
                     f"{estimate['mfu']:>7.1%}{plan_report.human(memory):>11}")
        lines.append(f"   {torchrun} {script} {' '.join(argv)}")
    return "\n".join(lines)
