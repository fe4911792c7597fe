"""pp_train.py's measurement of its schedule: the stage plan (estimated FLOPs per stage and rank),
the live micro-batches and activation bytes a schedule holds, and --print_schedule's timeline and
bubble. None of it changes what the pipeline computes."""
import itertools
import statistics

import torch
import torch.distributed as dist

from common.distributed import autocast
from common.metrics import SavedActivations, timers


def stage_plan(config, args, pp_size, rank_of):
    """Each stage's pieces and estimated forward + backward FLOPs a step (B*T tokens; backward = 2 x
    forward, a multiply-add = 2 FLOPs): a block 24C^2 + 4TC a token (its matmuls; attention's scores
    and weighted sum), the embedding C (the add of wte and wpe), the head 2*vocab*C and the loss
    4*vocab (max, subtract, exp, sum), on the last stage or, with --vocab_parallel, 1/p of both on
    every rank. rank_of(stage): the rank that holds it (the pipeline's layout). Returns the plan,
    one indented line a stage and the GFLOP per rank, each line starting with a newline."""
    C, T, vocab = config.n_embd, config.block_size, config.vocab_size
    n_stages = pp_size * args.virtual_stages
    gflop = 3 * args.batch_size * T / 1e9  # GFLOP a step for 1 FLOP a token's forward
    first_block = list(itertools.accumulate(args.stage_layers, initial=0))
    per_rank = [0.0] * pp_size
    plan = []
    head = (2 * vocab * C + 4 * vocab) * gflop
    for s in range(n_stages):
        a, b = first_block[s], first_block[s + 1]
        own_head = s == n_stages - 1 and not args.vocab_parallel
        cost = (b - a) * (24 * C * C + 4 * T * C) * gflop
        rank = rank_of(s)
        line = f"stage {s} (rank {rank}): "
        if s == 0:
            cost += C * gflop
            line += "wte, wpe, "
        line += f"blocks {a}-{b - 1}"
        if s == n_stages - 1:
            line += ", ln_f"
        if own_head:
            cost += head
            line += ", lm_head"
        per_rank[rank] += cost
        plan.append(f"{line}: {cost:.2f}")
    if args.vocab_parallel:
        rows = vocab // pp_size
        plan.append(f"vocabulary pass, every rank: lm_head rows r*{rows} to (r+1)*{rows}-1 "
                    f"and their part of the loss: {head / pp_size:.2f}")
        per_rank = [g + head / pp_size for g in per_rank]
    plan.append(f"per rank: {[round(g, 2) for g in per_rank]}")
    return "".join(f"\n  {line}" for line in plan)


def peak_live(actions, sizes=None):
    """The most a schedule holds between forwards and their backwards (the max over its prefixes):
    live micro-batches, or bytes with sizes[chunk] = what one micro-batch's forward through that
    chunk saves. A vocabulary pass (L) holds nothing after it (its forward and backward are one
    action). With W actions (zb1p) a micro-batch is live until its W: the linears' inputs stay
    for their weight gradients."""
    live = 0
    peak = 0
    release = "W" if any(op == "W" for op, _, _ in actions) else "B"
    for op, _, chunk in actions:
        held = 1 if sizes is None else sizes[chunk]
        if op == "F":
            live += held
        elif op == release:
            live -= held
        peak = max(peak, live)
    return peak


def activation_bytes(model, rows, T):
    """Bytes autograd saves (parameters left out) for one micro-batch's forward through each chunk
    of this rank, measured on a zero batch: token ids on the first stage, else an activation."""
    ids = torch.zeros(rows, T, dtype=torch.long, device=model.device)
    sizes = []
    for index, chunk in enumerate(model.chunks):
        if index == 0 and model.rank == 0:
            inp = ids
        else:
            inp = torch.zeros(rows, T, model.config.n_embd, device=model.device, requires_grad=True)
        with SavedActivations() as meter, autocast(model.args, model.device):
            chunk(inp, ids.clone())  # targets: their own storage, as in training
        sizes.append(meter.bytes)
    return sizes


def zero_bubble_times(steps):
    """The median seconds of one F, B and W action over every rank and step, or None when the
    schedule has no W."""
    spans = [(label[0], t1 - t0) for step in steps for rank_spans in step
             for label, t0, t1 in rank_spans]
    if not any(op == "W" for op, _ in spans):
        return None
    return [statistics.median(t for o, t in spans if o == op) for op in "FBW"]


class ScheduleReport:
    """--print_schedule: every step starts on all ranks at once (a barrier) and its F and B spans
    (timers("compute")) are gathered from all ranks (with --vocab_parallel also the vocabulary
    passes, 'L3', timed from after their broadcast, where a rank waits for the others); at the end
    rank 0 prints the last step's timeline, the bubble and the stage plan. The summary gets each
    rank's peak live micro-batches and activation bytes (custom only: PyTorch's schedules are its
    own)."""

    def __init__(self, args, model):
        self.args = args
        self.model = model
        self.steps = []  # per step, every rank's spans
        timers.keep_spans = args.print_schedule

    def start_step(self):
        if self.args.print_schedule:
            dist.barrier()
            timers.start_step()  # the spans' clock starts here, together on every rank

    def end_step(self):
        if self.args.print_schedule:
            self.steps.append([None] * dist.get_world_size())
            dist.all_gather_object(self.steps[-1], timers.last_spans)

    def summary(self):
        args, model = self.args, self.model
        extra = {}
        if args.implementation == "custom":
            rows = args.batch_size // args.grad_accum_steps // model.M
            sizes = activation_bytes(model, rows, args.block_size)
            extra["peak_live_microbatches"] = peak_live(model.actions)
            extra["peak_activation_bytes"] = peak_live(model.actions, sizes)
        if not self.steps or not all(self.steps[-1]):  # no --print_schedule, or PyTorch's schedule
            return extra
        p, M, n_chunks = model.pp_size, model.M, args.virtual_stages
        ends = []  # per step: when its last span ended, on any rank
        busy = []  # per step, per rank: seconds computing
        for step in self.steps:
            rank_ends = []
            rank_busy = []
            for spans in step:
                rank_ends.append(max(t1 for _, _, t1 in spans))
                rank_busy.append(sum(t1 - t0 for _, t0, t1 in spans))
            ends.append(max(rank_ends))
            busy.append(rank_busy)
        idle = [1 - statistics.mean(step_busy) / end for step_busy, end in zip(busy, ends)]
        bubble = statistics.median(idle)  # each step's idle share: the mean over ranks
        compute_ms = []  # per rank: F+B ms a step, the median over steps
        for r in range(p):
            compute_ms.append(1000 * statistics.median([step_busy[r] for step_busy in busy]))
        theory = (p - 1) / (n_chunks * M + p - 1)  # for equal stages
        split = zero_bubble_times(self.steps)  # zb1p: T_F, T_B, T_W measured
        if split is not None:  # Qi et al.: 1F1B idles (p-1)(T_F+T_B+T_W), ZB-H1 (p-1)(T_F+T_B-T_W)
            t_f, t_b, t_w = split
            idle = (p - 1) * (t_f + t_b - t_w) if args.schedule == "zb1p" else 0.0  # ZB-V: about 0
            theory = idle / (M * (t_f + t_b + t_w) + idle)
        # For the measured stage times: the slowest stage computes throughout, every other adds
        # one micro-batch's (chunk's) share to fill and drain the pipeline.
        slowest = max(compute_ms)
        pipeline = slowest + (sum(compute_ms) - slowest) / (M * n_chunks)
        staged = 1 - sum(compute_ms) / (p * pipeline)
        if model.rank == 0:
            self.print_timeline(ends[-1])
            v_times = "V*" if n_chunks > 1 else ""
            v_equals = f", V={n_chunks}" if n_chunks > 1 else ""
            formula = f"(p-1)/({v_times}m+p-1) with p={p}, m={M}{v_equals}"
            if split is not None:
                zb = "(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W))" if idle else "about 0 (ZB-V)"
                formula = (f"{zb} with p={p}, m={M} and the measured F, B, W "
                           f"{[round(1000 * t, 2) for t in split]} ms (1F1B's, (p-1)/(m+p-1): "
                           f"{(p - 1) / (M + p - 1):.1%})")
            print(f"bubble: measured {bubble:.1%} (median of {len(ends)} steps, mean over ranks), "
                  f"theory {theory:.1%} = {formula}")
            print(f"  the theory assumes equal stages; measured F+B ms per step and rank: "
                  f"{[round(ms) for ms in compute_ms]}, for which the same model of the schedule "
                  f"gives {staged:.1%}")
            plan = stage_plan(model.config, args, p, model.rank_of)
            print("the stage plan, estimated GFLOP a step:" + plan)
        run = dict(bubble_measured=bubble, bubble_theory=theory, bubble_for_stage_times=staged)
        return dict(extra, run=run)

    def print_timeline(self, end, width=96):
        """One row per rank: 'F3' = forward of micro-batch 3 (of chunk a, b, .. when there are
        several), '.' = idle."""
        several = self.args.virtual_stages > 1
        print(f"timeline of the last step ({end * 1000:.1f} ms, {width} columns):")
        for rank, spans in enumerate(self.steps[-1]):
            line = ["."] * width
            for (op, mb, chunk), t0, t1 in spans:
                first = min(int(t0 / end * width), width - 1)
                stop = max(first + 1, int(t1 / end * width))
                label = f"{op}{mb}" + ("abcdefghij"[chunk] if several else "")
                line[first:stop] = (label + "-" * width)[:stop - first]
            print(f"  rank {rank} |{''.join(line)}|")
