"""PP: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B), written by hand with send/recv.

The n_layer blocks are cut into p*V equal stages, V ("virtual stages") per rank; rank r runs stages
r, r+p, r+2p, ... . The first stage also holds wte/wpe, the last ln_f and lm_head. Memory per rank:
about 16P/p (fp32 params + grads + AdamW) plus, on the last rank, a copy of the tied wte (lm_head).
Each global batch (or gradient-accumulation chunk) is cut into M micro-batches. A micro-batch's
activation (rows x T x C fp32 values) is sent to the next stage after its forward, and the gradient
of that activation is sent back after the next stage's backward: per step 2*M*(p*V-1) messages of
4*rows*T*C bytes, plus one all-reduce of the tied wte/lm_head gradient (4*vocab*C bytes) between
the first and last rank. Nothing else moves: every rank holds only its own layers.

The schedule decides the order of forwards (F) and backwards (B) on each rank:
  gpipe        all M forwards, then all M backwards: M micro-batches' activations live at once.
  1f1b         p-r-1 warm-up forwards, then one forward one backward, then the rest of the backwards:
               at most p micro-batches live, whatever M is.
  interleaved  1F1B over V chunks per rank (Megatron): the idle "bubble" shrinks by V, for V times
               more messages.
Idle fraction with equal stages, (p-1)/(M+p-1) (divided by V when interleaved): --print_schedule
prints the measured one next to it, with a timeline per rank, and the same formula for the measured
stage times (the small model's last stage, with its 50304-wide head and loss, computes ~7x longer).

Run:
  python pp_train.py                                   # single process: one stage, the reference
  torchrun --standalone --nproc_per_node=2 pp_train.py # 2 stages (2 GPUs, or 2 CPU processes)
  torchrun --standalone --nproc_per_node=2 pp_train.py --schedule interleaved --virtual_stages 2 --print_schedule
  torchrun --nnodes=2 --nproc_per_node=4 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 pp_train.py --n_layer 8  # 8 stages on 2 nodes (node_rank=1 on the other)
  torchrun --standalone --nproc_per_node=2 pp_train.py --implementation pytorch  # torch.distributed.pipelining
"""
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks

from common.checkpoint import resume, save_checkpoint, set_adamw_state
from common.config import check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import get_batch
from common.distributed import autocast, setup, setup_data, teardown
from common.metrics import Metrics, optimizer_state_bytes, peak_mem_bytes, tensor_bytes
from common.model import GPT, configure_optimizer, init_tensor


# ---- the strategy: stages, schedules, and the executor that runs them with send/recv ---------

class Stage(nn.Module):
    """Global stage `index` of `n_stages`: its blocks (named as in GPT, e.g. transformer.h.2, so
    checkpoints and optimizer state keep GPT's names), plus wte/wpe on the first stage and
    ln_f/lm_head on the last. Only these tensors get storage, each from value_of(GPT name, shape)."""

    def __init__(self, config, index, n_stages, value_of, device):
        super().__init__()
        full = GPT(config, device="meta")  # the whole model without storage: we only borrow its pieces
        per = config.n_layer // n_stages
        self.first, self.last = index == 0, index == n_stages - 1
        self.blocks = range(index * per, (index + 1) * per)
        parts = {"h": nn.ModuleDict({str(i): full.transformer.h[i] for i in self.blocks})}
        if self.first:
            parts.update(wte=full.transformer.wte, wpe=full.transformer.wpe, drop=full.transformer.drop)
        if self.last:
            parts["ln_f"] = full.transformer.ln_f
        self.transformer = nn.ModuleDict(parts)
        if self.last:  # its own Parameter: a copy of wte unless this stage also holds wte
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False, device="meta")
        self.to_empty(device=device)
        if self.first and self.last:
            self.lm_head.weight = self.transformer.wte.weight  # one stage: the tie is the same tensor
        with torch.no_grad():
            for name, p in self.named_parameters():  # the copy of wte starts from wte's values
                p.copy_(value_of("transformer.wte.weight" if name == "lm_head.weight" else name, p.shape))

    def forward(self, x):  # token ids on the first stage, else the previous stage's activation
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(pos))
        for block in self.transformer.h.values():
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x)) if self.last else x  # logits on the last stage


def schedule_actions(schedule, rank, stages, microbatches, virtual=1):
    """The ordered actions of `rank` for one batch: (op, microbatch, chunk) with op "F" or "B";
    chunk c of rank r is global stage c*stages + r. A pure function, so tests can check orders."""
    p, m = stages, microbatches
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        # Warm-up: rank r runs p-r-1 forwards before its first backward can arrive, then alternates,
        # so at most p-r micro-batches are between their forward and backward on rank r.
        warmup = min(p - rank - 1, m)
        steady = [a for i in range(m - warmup) for a in (("F", warmup + i, 0), ("B", i, 0))]
        return [("F", i, 0) for i in range(warmup)] + steady + [("B", i, 0) for i in range(m - warmup, m)]
    # interleaved (Megatron): the k-th forward of every rank is micro-batch (k // pV) * p + k % p of
    # chunk (k // p) % V: p micro-batches go through chunk 0, then the same p through chunk 1, ...
    # The k-th backward walks the chunks in reverse. Warm-up is longer: 2(p-r-1) + (V-1)p forwards.
    V, total = virtual, m * virtual

    def forward(k):
        return ("F", k // (p * V) * p + k % p, k // p % V)

    def backward(k):
        return ("B", k // (p * V) * p + k % p, V - 1 - k // p % V)
    warmup = min(2 * (p - rank - 1) + (V - 1) * p, total)
    steady = [a for k in range(total - warmup) for a in (forward(warmup + k), backward(k))]
    return [forward(k) for k in range(warmup)] + steady + [backward(k) for k in range(total - warmup, total)]


def run_pipeline(chunks, actions, rank, p, x, y, loss_scale, stats, act_group, grad_group, args, device, t0=None):
    """Run one rank's actions over the micro-batches x[i], y[i]. Returns the sum of this rank's
    scaled micro-batch losses (non-zero on the last rank only) and, given t0, each action's measured
    (op, microbatch, chunk, start, end). Without grad: forwards only. `stats` counts live activations.

    Activations travel on act_group, their gradients on grad_group: two communicators, so a message
    is matched only with its own kind (between ranks 0 and p-1 both kinds flow the same way when
    interleaved), and in the same order as the sender sent it (schedules keep that order per kind).
    Receives block (the data is needed now); sends are asynchronous, so no rank waits on a peer that
    is itself waiting in a send. Shapes are fixed (rows x T x C), so no shape is ever exchanged."""
    last, shape = p * len(chunks) - 1, (x[0].size(0), x[0].size(1), args.n_embd)
    stash, sends, events = {}, [], []  # stash: (microbatch, chunk) -> (input, gradient edge of output)
    total_loss = torch.zeros((), device=device)
    for op, mb, c in actions:
        s = c * p + rank  # this chunk's global stage
        sends = [(w, t) for w, t in sends if not w.is_completed()]  # a delivered activation is freed here
        if op == "F":
            if s == 0:
                inp = x[mb]
            else:  # the previous stage's output for this micro-batch: 4*rows*T*C bytes from rank-1
                inp = torch.empty(shape, device=device)
                dist.recv(inp, src=(rank - 1) % p, group=act_group)
                inp.requires_grad_(torch.is_grad_enabled())
            start, saved = time.perf_counter(), {}  # storage -> bytes of the tensors autograd saves for B

            def pack(t):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t
            with saved_tensors_hooks(pack, lambda t: t):
                with autocast(args, device):
                    out = chunks[c](inp)
                if s == last:
                    out = F.cross_entropy(out.flatten(0, 1).float(), y[mb].flatten()) * loss_scale
                    total_loss += out.detach()
            if s != last:  # to the next stage: rank+1 (rank 0 again when the last rank's chunk c < V-1)
                sends.append((dist.isend(out.detach(), dst=(rank + 1) % p, group=act_group), out.detach()))
            if torch.is_grad_enabled():
                # Keep the input (its gradient goes back) and only the output's autograd edge: the output
                # tensor itself is freed once its send completes (the ops after it saved their own inputs).
                stash[(mb, c)] = (inp, get_gradient_edge(out), sum(v for k, v in saved.items() if k not in stats["param_ptrs"]))
                stats["live"] += stash[(mb, c)][2]
                stats["peak_live_bytes"] = max(stats["peak_live_bytes"], stats["live"])
                stats["peak_live_microbatches"] = max(stats["peak_live_microbatches"], len(stash))
        else:
            inp, edge, nbytes = stash.pop((mb, c))
            grad = None
            if s != last:  # d(loss)/d(our output) from the next stage: 4*rows*T*C bytes
                grad = torch.empty(shape, device=device)
                dist.recv(grad, src=(rank + 1) % p, group=grad_group)
            start = time.perf_counter()
            torch.autograd.backward(edge, grad)
            if s != 0:  # d(loss)/d(our input) to the previous stage
                sends.append((dist.isend(inp.grad, dst=(rank - 1) % p, group=grad_group), inp.grad))
            stats["live"] -= nbytes
            del inp, edge
        if t0 is not None:
            events.append((op, mb, c, start - t0, time.perf_counter() - t0))
    for work, _ in sends:
        work.wait()
    return total_loss, events


def sum_tied_gradient(chunks, rank, p, tied_group):
    """wte (rank 0) and its copy lm_head (rank p-1) each got one part of the tied gradient: the
    lookup's and the head's. Both ranks send their vocab x C fp32 gradient (4*vocab*C bytes) and
    receive the other's: after the sum both hold the full tied gradient, take identical AdamW steps
    and stay equal without ever sending the weight. One rank: the tie is one tensor already."""
    if p > 1 and rank in (0, p - 1):
        tied = chunks[0].transformer.wte.weight if rank == 0 else chunks[-1].lm_head.weight
        dist.all_reduce(tied.grad, group=tied_group)


def print_timeline(events, p, m, V, schedule, width=96):
    """ASCII timeline of one measured step: one row per rank, each action drawn over its measured
    time ('F3' = forward of micro-batch 3; chunk letter a, b, .. when interleaved), '.' = idle."""
    end = max(e[4] for rank_events in events for e in rank_events)
    print(f"timeline of the last step ({end * 1000:.1f} ms, {width} columns):")
    for rank, rank_events in enumerate(events):
        line = ["."] * width
        for op, mb, c, t0, t1 in rank_events:
            a = min(int(t0 / end * width), width - 1)
            b = max(a + 1, int(t1 / end * width))
            label = f"{op}{mb}{'abcdefghij'[c] if V > 1 else ''}" + "-" * width
            line[a:b] = label[:b - a]
        print(f"  rank {rank} |{''.join(line[:width])}|")


def bubble_fraction(events):
    """Mean over ranks of the idle fraction of the step (the time not spent in an F or B)."""
    end = max(e[4] for rank_events in events for e in rank_events)
    return statistics.mean(1 - sum(t1 - t0 for *_, t0, t1 in rank_events) / end for rank_events in events)


def pytorch_schedule(chunks, rank, p, args, device, loss_scale, group):
    """torch.distributed.pipelining's version of the same stages and schedule. Its loss_fn sees one
    micro-batch's logits; scale_grads=False because it would divide the accumulated .grad of earlier
    gradient-accumulation chunks too: the loss is pre-scaled like ours instead."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    stages = [PipelineStage(chunk, c * p + rank, p * len(chunks), device, group=group) for c, chunk in enumerate(chunks)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) * loss_scale
    if args.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, args.n_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    return schedule(stages[0], args.n_microbatches, loss_fn=loss_fn, scale_grads=False)


def add_pp_flags(group):
    group.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    group.add_argument("--n_microbatches", type=int, default=4, help="micro-batches per batch (per accumulation chunk)")
    group.add_argument("--virtual_stages", type=int, default=None, help="chunks per rank, interleaved only (default 2)")
    group.add_argument("--print_schedule", action="store_true", help="custom only: time every step; print the last one's timeline and the bubble")


# ---- setup -------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("pp", add_pp_flags, argv)
    p = int(os.environ.get("WORLD_SIZE", 1))  # one stage per rank: no data parallelism here
    if args.virtual_stages is not None and args.schedule != "interleaved":
        die(f"--virtual_stages: only with --schedule interleaved (got --schedule {args.schedule})")
    V = args.virtual_stages = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
    if V <= 0 or args.n_microbatches <= 0:
        die(f"--{'virtual_stages' if V <= 0 else 'n_microbatches'}: must be > 0")
    if p == 1 and args.schedule == "interleaved":  # chunk 0 would send to chunk 1 on its own rank
        die("--schedule: interleaved needs at least 2 ranks (run under torchrun --nproc_per_node >= 2)")
    if args.n_layer % (p * V):
        die(f"--n_layer: {args.n_layer} layers must be divisible by stages ({p} ranks) x --virtual_stages ({V})")
    check_batch_split(args, 1)
    if (args.batch_size // args.grad_accum_steps) % args.n_microbatches:
        die(f"--n_microbatches: {args.batch_size // args.grad_accum_steps} rows per accumulation chunk (--batch_size / "
            f"--grad_accum_steps) must be divisible by --n_microbatches ({args.n_microbatches})")
    if args.schedule == "interleaved" and args.n_microbatches % p:
        die(f"--n_microbatches: must be a multiple of the number of stages ({p}) for --schedule interleaved")
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A, M = args.batch_size, args.block_size, args.grad_accum_steps, args.n_microbatches
    micro, rows = B // A, B // A // M  # rows per accumulation chunk; rows per micro-batch

    def value_of(name, shape):  # this rank's tensors, by GPT name: from the full checkpoint, or GPT's init
        return ckpt["model"][name] if ckpt else init_tensor(name, shape, config, args.seed)
    chunks = [Stage(config, c * p + rank, p * V, value_of, device) for c in range(V)]
    # Groups are made by every rank, in the same order. tied_group: the ranks holding wte and its copy.
    act_group, grad_group = dist.new_group(list(range(p))), dist.new_group(list(range(p)))
    tied_group = dist.new_group([0, p - 1]) if p > 1 else None
    named = [(n, q) for chunk in chunks for n, q in chunk.named_parameters()]
    optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, (args.beta1, args.beta2))
    start = ckpt["step"] if ckpt else 0
    if ckpt:  # the copy of wte (lm_head) takes wte's AdamW state: the two get the same summed gradient
        for n, q in named:
            set_adamw_state(optimizer, q, ckpt["optimizer"]["transformer.wte.weight" if n == "lm_head.weight" else n],
                            lambda t: t.to(device, copy=True))
    loss_scale = 1.0 / (A * M)  # each micro-batch's mean loss counts 1/(A*M) of the batch mean
    schedule = pytorch_schedule(chunks, rank, p, args, device, loss_scale, None) if args.implementation == "pytorch" else None
    actions = schedule_actions(args.schedule, rank, p, M, V)
    stats = dict(live=0, peak_live_bytes=0, peak_live_microbatches=0,
                 param_ptrs={q.untyped_storage().data_ptr() for _, q in named})
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start)
    plans = [None] * world_size
    dist.all_gather_object(plans, [f"stage {c * p + rank} (rank {rank}): " + ", ".join(
        (["wte", "wpe"] if ch.first else []) + [f"blocks {ch.blocks[0]}-{ch.blocks[-1]}"] + (["ln_f", "lm_head"] if ch.last else []))
        for c, ch in enumerate(chunks)])
    if rank == 0:
        print(f"pp ({args.implementation}, {args.schedule}): {p} rank(s) x {V} chunk(s) on {device}, global batch "
              f"{B} x {T} tokens, {A} accumulation chunk(s) of {M} micro-batches of {rows} rows", flush=True)
        for line in sorted((s for plan in plans for s in plan), key=lambda s: int(s.split()[1])):
            print("  " + line, flush=True)

    @torch.no_grad()
    def evaluate():
        """Mean loss over eval_iters fixed batches per split, forwards only through the pipeline
        (both implementations); the last rank's loss is broadcast to all."""
        for chunk in chunks:
            chunk.eval()
        out = {}
        forwards = [a for a in actions if a[0] == "F"]
        for split in ("train", "val"):
            total = torch.zeros((), device=device)
            for k in range(args.eval_iters):
                x, y = get_batch(split, k, B, T, args.seed + 1, args.dataset)
                loss, _ = run_pipeline(chunks, forwards, rank, p, x.to(device).chunk(M), y.to(device).chunk(M),
                                       1.0 / M, stats, act_group, grad_group, args, device)
                total += loss
            dist.broadcast(total, src=p - 1)  # 4 bytes from the last stage, which computed the loss
            out[split] = total.item() / args.eval_iters
        for chunk in chunks:
            chunk.train()
        return out

    # ---- training loop -------------------------------------------------------------------
    bubbles, busy, events = [], [], None  # busy: per step, each rank's ms in F and B
    for step in range(start, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            metrics.eval(step, evaluate())
        if args.print_schedule:
            dist.barrier()  # every rank starts the step's clock together
        t0 = time.perf_counter()
        lr = get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch("train", step, B, T, args.seed, args.dataset)  # every stage knows the shapes
        x, y = x.to(device), y.to(device)
        loss_sum, events = torch.zeros((), device=device), []
        for j in range(A):
            xj, yj = x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro]
            if schedule is None:
                loss, ev = run_pipeline(chunks, actions, rank, p, xj.chunk(M), yj.chunk(M), loss_scale, stats,
                                        act_group, grad_group, args, device, t0 if args.print_schedule else None)
                loss_sum += loss
                events += ev
            else:
                losses = []
                with autocast(args, device):
                    schedule.step(*([xj] if rank == 0 else []), **(dict(target=yj, losses=losses) if rank == p - 1 else {}))
                if losses:
                    loss_sum += torch.stack(losses).sum().detach()
        # The logged loss: the last stage's sum of the A*M pre-scaled micro-batch means (4 bytes to all).
        dist.broadcast(loss_sum, src=p - 1)
        sum_tied_gradient(chunks, rank, p, tied_group)
        # The pinned global norm: each rank's sum of squares (the copy of wte left out, so the tied
        # weight counts once), summed over all ranks (4 bytes each).
        grads = [q.grad for n, q in named if n != "lm_head.weight"]
        norm = torch.stack([(g.float() * g.float()).sum() for g in grads]).sum()
        dist.all_reduce(norm)
        norm = norm.sqrt()
        if args.grad_clip > 0:
            clip = (args.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            for _, q in named:
                q.grad.mul_(clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        metrics.step(step, loss_sum.item(), lr, norm.item(), B * T, time.perf_counter() - t0, device, args.log_interval)
        if args.print_schedule and schedule is None:
            all_events = [None] * world_size
            dist.all_gather_object(all_events, events)
            bubbles.append(bubble_fraction(all_events))
            busy.append([1000 * sum(t1 - t0 for *_, t0, t1 in rank_events) for rank_events in all_events])
            events = all_events
        if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0:
            checkpoint(chunks, optimizer, step + 1, config, args, rank)

    if args.eval_interval:
        metrics.eval(args.max_iters, evaluate())
    checkpoint(chunks, optimizer, args.max_iters, config, args, rank)
    theory = (p - 1) / (M + p - 1) / V
    busy = [statistics.median(ms) for ms in zip(*busy)]  # per rank: ms of F and B per step
    # The theory assumes equal stages. With the measured ones: the slowest stage computes throughout and
    # every other stage adds one micro-batch's (chunk's) share to fill and drain the pipeline, so a step
    # takes max(S) + (sum(S) - max(S)) / (m V) (equal stages: (p-1)/(mV+p-1), the theory for V = 1).
    staged = 1 - sum(busy) / (p * (max(busy) + (sum(busy) - max(busy)) / (M * V))) if busy else None
    if rank == 0 and bubbles:
        print_timeline(events, p, M, V, args.schedule)
        print(f"bubble: measured {statistics.median(bubbles):.1%} (median of {len(bubbles)} steps, mean over ranks), "
              f"theory {theory:.1%} = (p-1)/(m+p-1){'/V' if V > 1 else ''} with p={p}, m={M}" + (f", V={V}" if V > 1 else ""))
        print(f"  the theory assumes equal stages; measured F+B ms per step and rank: {[round(b) for b in busy]}, "
              f"for which the same model of the schedule gives {staged:.1%}")
    state_bytes = tensor_bytes(q for _, q in named) + tensor_bytes(q.grad for _, q in named) + optimizer_state_bytes(optimizer)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, (state_bytes, peak_mem_bytes(device), stats["peak_live_microbatches"], stats["peak_live_bytes"]))
    extra = dict(peak_live_microbatches_per_rank=[r[2] for r in per_rank], peak_activation_bytes_per_rank=[r[3] for r in per_rank])
    if bubbles:
        extra.update(bubble_measured=statistics.median(bubbles), bubble_theory=theory, bubble_for_stage_times=staged,
                     compute_ms_per_rank=[round(b, 1) for b in busy])
    metrics.summary([r[0] for r in per_rank], [r[1] for r in per_rank], **extra)
    metrics.close()


def checkpoint(chunks, optimizer, step, config, args, rank):
    """Every rank sends its tensors and their AdamW state, by GPT name, to rank 0 (gather_object:
    the whole model once over the wire), which assembles the full format; save_checkpoint writes it
    (collective: it also gathers every rank's RNG state). The copy of wte is skipped: lm_head.weight
    is written from wte, as in a tied GPT's state_dict."""
    named = [(n, q) for chunk in chunks for n, q in chunk.named_parameters() if n != "lm_head.weight"]
    mine = ({n: q.detach().cpu() for n, q in named},
            {n: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in optimizer.state[q].items()}
             for n, q in named if q in optimizer.state})
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    model = state = None
    if rank == 0:
        params = {n: t for g in gathered for n, t in g[0].items()}
        model = {k: params["transformer.wte.weight" if k == "lm_head.weight" else k] for k in GPT(config, device="meta").state_dict()}
        state = {n: s for g in gathered for n, s in g[1].items()}
    save_checkpoint(model, state, step, config, args)


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
