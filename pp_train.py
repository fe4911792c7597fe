"""PP: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B), written by hand with send/recv.

The n_layer blocks are cut into n_stages = pp_size * V stages, V ("virtual stages", chunks) per rank: rank r runs
stages r, r + pp_size, ...; equal ones, or --stage_layers 3,1 (blocks per stage); the first also holds wte/wpe, the
last ln_f and lm_head. Every rank sees every row (no data parallelism): each micro-step's `micro` rows are cut into
M micro-batches.
  memory per rank:  about 16P/pp_size (fp32 params + grads + AdamW), plus a copy of the tied wte (lm_head) on
                    the last rank; activations of the micro-batches between their F and B.
  communication:    each micro-batch's activation (micro/M x T x C fp32) goes to the next stage and its gradient
                    comes back: 2*M*(n_stages-1) messages a micro-step; plus one all-reduce of the tied
                    wte/lm_head gradient (4*vocab*C bytes) between the first and the last rank a step.
The schedule orders each rank's forwards (F) and backwards (B). With equal stages a rank idles (the "bubble")
(pp_size-1)/(M+pp_size-1) of a step; --print_schedule measures it and draws a timeline per rank.
  gpipe        all M forwards, then all M backwards: M micro-batches' activations live at once.
  1f1b         pp_size-r-1 warm-up forwards, then one F one B: at most pp_size micro-batches live, whatever M is.
  interleaved  1F1B over V chunks per rank (Megatron): a bubble of (pp_size-1)/(V*M+pp_size-1), for V times more
               messages.
The head and loss (2*vocab*C FLOPs a token) make the last stage the slowest unless n_layer >= vocab/(12C) blocks
can balance them. --vocab_parallel (Yeung et al. 2024, "Balancing Pipeline Parallelism with Vocabulary
Parallelism") splits them over all p ranks instead: rank r holds lm_head rows [r*vocab/p, (r+1)*vocab/p), a copy of
wte's rows (wte stays on the first stage; 16*vocab*C/p bytes with AdamW), and every micro-batch gets one more
action on every rank, its vocabulary pass V: the last stage's ln_f output is broadcast (4*micro/M*T*C bytes), each
rank computes its logits and its part of the softmax, two all-reduces (micro/M*T numbers: the max; 2x that: the
sum of exp and the target's logit) give every rank the loss, and the ranks' parts of its gradient d(loss)/dh are
reduced onto the last rank (4*micro/M*T*C bytes), whose B goes on from there: per micro-batch one broadcast, two
all-reduces and one reduce; the tied gradient is summed by rank 0 with each rank's rows (4*vocab*C/p bytes each).
In 1f1b a rank d stages before the last warms up 2d forwards (so 2d+1 micro-batches live) and then runs V(k),
F(k+d), B(k-d) in the time the last runs F(k), V(k), B(k): no rank waits for the vocabulary passes' collectives.

Run:
  python pp_train.py                                   # single process: one stage, the reference
  torchrun --standalone --nproc_per_node=2 pp_train.py # 2 stages (2 GPUs, or 2 CPU processes)
  torchrun --standalone --nproc_per_node=2 pp_train.py --schedule interleaved --virtual_stages 2 --print_schedule
  torchrun --nnodes=2 --nproc_per_node=4 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 pp_train.py --n_layer 8  # 8 stages on 2 nodes (node_rank=1 on the other)
  torchrun --standalone --nproc_per_node=2 pp_train.py --implementation pytorch  # torch.distributed.pipelining
"""
import itertools
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge

from common.checkpoint import checkpoint, resume, set_adamw_state
from common.config import add_bool, check_batch_split, check_torch, die, get_lr, gpt_config, parse_args
from common.data import get_batch
from common.distributed import autocast, clip_grad_norm_, setup, setup_data, teardown
from common.metrics import Metrics, Profiler, SavedActivations, model_state_bytes, timers
from common.model import GPT, configure_optimizer, init_tensor

WTE = "transformer.wte.weight"  # lm_head.weight is tied to it: the last stage holds a copy


# ---- the strategy: stages, schedules, and the executor that runs them with send/recv ---------

class Stage(nn.Module):
    """Global stage `index` of `n_stages`: its blocks (named as in GPT, e.g. transformer.h.2, so checkpoints and
    optimizer state keep GPT's names), plus wte/wpe on the first stage and ln_f on the last. `head`: the rows of the
    tied wte this stage's lm_head holds (a copy unless the stage also holds wte): all of them on the last stage, or,
    with --vocab_parallel, V/pp_size rows on the first chunk of every rank, and then the last stage ends at ln_f.
    Only these tensors get storage, from the full checkpoint `state` or GPT's init."""

    def __init__(self, config, index, n_stages, blocks, head, vocab_parallel, state, seed, device):
        super().__init__()
        full = GPT(config, device="meta").transformer  # the whole model without storage: we borrow its pieces
        self.first, self.last, self.vocab_parallel = index == 0, index == n_stages - 1, vocab_parallel
        self.transformer = nn.ModuleDict(dict(
            h=nn.ModuleDict({str(i): full.h[i] for i in blocks}),
            **(dict(wte=full.wte, wpe=full.wpe, drop=full.drop) if self.first else {}),
            **(dict(ln_f=full.ln_f) if self.last else {})))
        if head is not None:  # its own Parameter: a copy of wte's rows unless this stage holds wte and all rows
            self.lm_head = nn.Linear(config.n_embd, head.stop - head.start, bias=False, device="meta")
        self.to_empty(device=device)
        if self.first and self.last and not vocab_parallel:
            self.lm_head.weight = self.transformer.wte.weight  # one stage: the tie is the same tensor
        with torch.no_grad():
            for name, p in self.named_parameters():
                rows = head if name == "lm_head.weight" else slice(None)  # the copy of wte starts from wte's rows
                name = WTE if name == "lm_head.weight" else name
                shape = (config.vocab_size, config.n_embd) if name == WTE else p.shape
                p.copy_((state[name] if state is not None else init_tensor(name, shape, config, seed))[rows])

    def forward(self, x, targets=None):  # token ids on the first stage, else the previous stage's activation
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(pos))
        for block in self.transformer.h.values():
            x = block(x)
        if not self.last:
            return x
        x = self.transformer.ln_f(x)
        if self.vocab_parallel:  # every rank's vocabulary pass computes the logits and the loss from x
            return x
        logits = self.lm_head(x)  # the last stage: logits, or their mean loss
        return logits if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def schedule_actions(schedule, rank, stages, microbatches, virtual=1, vocab_parallel=False):
    """The ordered actions of `rank` for one batch: (op, microbatch, chunk) with op "F" or "B", and with
    --vocab_parallel ("V", microbatch, 0): the micro-batch's vocabulary pass, forward and backward, on every rank;
    chunk c of rank r is global stage c*stages + r. A pure function, so tests can check orders. Every schedule is:
    warm-up forwards, then one forward one backward, then the remaining backwards; they differ in the warm-up."""
    # The k-th forward of a rank is micro-batch (k // pV) * p + k % p of chunk (k // p) % V: p micro-batches go
    # through chunk 0, then the same p through chunk 1, ... (V = 1: micro-batch k). Backwards: chunks in reverse.
    p, V, total, d = stages, virtual, microbatches * virtual, stages - rank - 1

    def forward(k):
        return ("F", k // (p * V) * p + k % p, k // p % V)

    def backward(k):
        return ("B", k // (p * V) * p + k % p, V - 1 - k // p % V)
    if vocab_parallel and schedule != "1f1b":
        # V(k) on every rank in the step after the one in which the last stage ran F(k) (in the timetable of the
        # plain schedule): the same order everywhere, and no rank reaches it much before the others.
        table, actions = timetable([schedule_actions(schedule, r, p, microbatches, V) for r in range(p)], p * V), []
        for mine, last in zip(table[rank], table[-1]):
            actions += [mine] if mine else []
            actions += [("V", last[1], 0)] if last and last[0] == "F" and last[2] == V - 1 else []
        return actions
    # gpipe: every forward first. 1f1b: rank r runs p-r-1 forwards before its first backward can arrive, so at
    # most p-r micro-batches are between their forward and backward. interleaved (Megatron): 2(p-r-1) + (V-1)p.
    # 1f1b with vocabulary passes: 2(p-r-1), see below.
    warmup = min({"gpipe": total, "1f1b": d * (1 + vocab_parallel)}.get(schedule, 2 * d + (V - 1) * p), total)
    steady = [a for k in range(total - warmup) for a in (forward(warmup + k), backward(k))]
    actions = [forward(k) for k in range(warmup)] + steady + [backward(k) for k in range(total - warmup, total)]
    # 1f1b: the last rank runs F(k), V(k), B(k); rank r = p-1-d, once full, runs V(k), F(k+d), B(k-d) in the time
    # of one such cycle: its F(k+d) is the input of the stage after it in the next cycle, its B(k-d) the gradient
    # the stage after it sent the cycle before. So V(k) goes before F(k+d), or B(k-d) once the forwards are done.
    for k in range(microbatches if vocab_parallel else 0):
        before = forward(k + d) if 0 < d and k + d < microbatches else backward(max(k - d, 0))
        actions.insert(actions.index(before), ("V", k, 0))
    return actions


def messages(action, rank, pp_size, n_stages):
    """What `action` on `rank` receives and sends, each (peer rank, name), None at the ends of the pipeline. A message
    is named (op, micro-batch, sending stage): F sends its output to the next stage, B its input's gradient back. A
    vocabulary pass (V) exchanges none: its collectives run on every rank in the same step (see timetable)."""
    op, mb, c = action
    s, d = c * pp_size + rank, 1 if op == "F" else -1
    recv = ((s - d) % pp_size, (op, mb, s - d)) if op != "V" and 0 <= s - d < n_stages else None
    send = ((s + d) % pp_size, (op, mb, s)) if op != "V" and 0 <= s + d < n_stages else None
    return recv, send


def timetable(actions, n_stages):
    """Every rank's actions (actions[r]: rank r's, in order) on one clock of equal steps, as PyTorch's pipelining
    lays out its multi-stage schedules: a rank runs its next action at the first step after the one that sent the
    message it needs, and idles (None) until then; a vocabulary pass V(k) runs in the first step at which it is the
    next action of every rank. Returns table[rank][step]."""
    p, todo, sent = len(actions), [list(a) for a in actions], set()
    table = [[] for _ in actions]
    while any(todo):
        need = [q and messages(q[0], r, p, n_stages)[0] for r, q in enumerate(todo)]
        ready = [q and (n is None or n[1] in sent) and (q[0][0] != "V" or all(o and o[0] == q[0] for o in todo))
                 for q, n in zip(todo, need)]
        step = [q.pop(0) if go else None for q, go in zip(todo, ready)]
        assert any(step), "the schedule waits for itself"
        for r, action in enumerate(step):
            table[r].append(action)
            send = action and messages(action, r, p, n_stages)[1]
            sent |= {send[1]} if send else set()
    return table


def p2p_program(table, rank, n_stages):
    """This rank's program, one entry per step of the timetable: (its action or None, the messages exchanged after
    it, as (peer, is_send, name)): what its action sends, and what the neighbours' actions of the same step send to it.
    Under NCCL a send may complete only when its receive is posted, and messages between two ranks are matched in
    order; so each step's sends and receives are posted together (one batch_isend_irecv) and waited before the next
    step, as torch.distributed.pipelining does: every message is received in the step it is sent, in the same order on
    both sides, and no rank waits in a send for a peer that waits in a send itself (when interleaved, activations
    flow both ways between ranks 0 and pp_size-1)."""
    p, program = len(table), []
    for t, action in enumerate(table[rank]):
        ops = []
        for q in range(p):
            send = table[q][t] and messages(table[q][t], q, p, n_stages)[1]
            if send and q == rank:
                ops.append((send[0], True, send[1]))
            elif send and send[0] == rank:
                ops.append((q, False, send[1]))
        program.append((action, ops))
    return program


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from (N, V/p) logit slices, one per rank of `group` (as tp_train.py's, written out
    again). loss = log(sum_v exp(z_v - m)) - (z_t - m) with m the global max: one all-reduce (MAX) of N numbers, then
    one (SUM) of 2N: each slice's sum of exp and the target's logit, which lives in one slice only. Backward needs no
    communication: d loss / d z = softmax - onehot(t), the slice of it for my rows."""
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # N numbers: the global max, for stability
        exp = (logits - m.unsqueeze(-1)).exp()
        local = targets - vocab_start
        mine = (local >= 0) & (local < logits.size(-1))  # targets whose logit this rank owns
        local = local.clamp(0, logits.size(-1) - 1)
        target_logit = torch.where(mine, logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) - m, 0.0)
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        dist.all_reduce(sums, group=group)  # 2N numbers: sum of exp over the whole vocabulary, target logits
        ctx.save_for_backward(exp / sums[0].unsqueeze(-1), local, mine)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -mine.float().unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_pass(h, targets, head, vocab_start, last, group, scale, cast):
    """One micro-batch's output layer and loss, split by vocabulary over the p ranks of `group`; forward and, with
    grad, backward at once: the loss needs nothing from the stages before, so its backward can start right away.
    h: the last stage's ln_f output (rows x T x C fp32), already broadcast to every rank. Returns the mean loss (known
    to every rank) and, with grad, on rank `last`, d(scale * loss)/dh for the last stage's backward;
    d(scale * loss)/d(my rows) accumulates in head.weight.grad, which never moves."""
    h.requires_grad_(torch.is_grad_enabled())
    with cast:
        logits = head(h)  # rows x T x V/p: my rows' logits
    loss = VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), vocab_start, group).mean()
    if not torch.is_grad_enabled():
        return loss, None
    (loss * scale).backward()
    # 4*rows*T*C bytes: each rank's part of dh (its rows' dz @ W), summed onto the last rank
    dist.reduce(h.grad, dst=last, group=group)
    return loss.detach(), h.grad if dist.get_rank() == last else None


def sum_tied_gradient(chunks, rank, pp_size, tied_groups, head_rows):
    """wte (rank 0) and its copies, lm_head on the last rank (or, with --vocab_parallel, its rows head_rows(r) on
    every rank r), each got one part of the tied gradient, the lookup's and the head's. Rank 0 and each rank r sum the
    rows of r (4*rows*C fp32 bytes each way; rank 0's own rows: locally): after the sum both hold those rows' full
    tied gradient, take identical AdamW steps and stay equal without ever sending the weight."""
    head = next((chunk.lm_head.weight for chunk in chunks if hasattr(chunk, "lm_head")), None)
    if pp_size == 1:  # one rank: the tie is one tensor already
        return
    if rank == 0:
        wte = chunks[0].transformer.wte.weight.grad
        if head is not None:
            wte[head_rows(0)] += head.grad
            head.grad.copy_(wte[head_rows(0)])
        for r, group in tied_groups.items():
            dist.all_reduce(wte[head_rows(r)], group=group)
    elif rank in tied_groups:
        dist.all_reduce(head.grad, group=tied_groups[rank])


class Pipeline:
    """The strategy behind the loop's few methods: this rank's chunks (Stages) and its schedule's actions."""

    def __init__(self, config, args, device, state=None):
        self.config, self.args, self.device, self.M = config, args, device, args.n_microbatches
        self.rank, self.pp_size, V = dist.get_rank(), dist.get_world_size(), args.virtual_stages
        vp = args.vocab_parallel
        self.n_stages, first_block = self.pp_size * V, list(itertools.accumulate(args.stage_layers, initial=0))
        self.chunks = nn.ModuleList(Stage(config, s, self.n_stages, range(first_block[s], first_block[s + 1]),
                                          self.head_rows(self.rank) if (c == 0 if vp else s == self.n_stages - 1)
                                          else None, vp, state, args.seed, device)
                                    for c, s in enumerate(range(self.rank, self.n_stages, self.pp_size)))
        # Made by every rank, in the same order. p2p_group: the pipeline's messages, apart from the loop's
        # collectives; vocab_group: the vocabulary passes' collectives; tied_groups[r]: rank 0 (wte) and rank r,
        # which holds a copy of some of its rows.
        self.p2p_group, self.vocab_group = dist.new_group(), dist.new_group() if vp else None
        self.tied_groups = {r: dist.new_group([0, r]) for r in range(1, self.pp_size) if vp or r == self.pp_size - 1}
        every = [schedule_actions(args.schedule, r, self.pp_size, self.M, V, vp) for r in range(self.pp_size)]
        self.actions = every[self.rank]
        self.program = p2p_program(timetable(every, self.n_stages), self.rank, self.n_stages)
        self.eval_program = p2p_program(timetable([[a for a in actions if a[0] != "B"] for actions in every],
                                                  self.n_stages), self.rank, self.n_stages)

    def head_rows(self, rank):
        """The rows of the tied wte that `rank`'s lm_head holds: V/p of them each with --vocab_parallel, else all."""
        if not self.args.vocab_parallel:
            return slice(0, self.config.vocab_size)
        n = self.config.vocab_size // self.pp_size
        return slice(rank * n, (rank + 1) * n)

    def named_parameters(self):
        return [(n, q) for chunk in self.chunks for n, q in chunk.named_parameters()]

    def configure_optimizer(self, args, state=None):
        named = self.named_parameters()
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, (args.beta1, args.beta2))
        for n, q in named if state else ():  # the copy of wte's rows takes their state: they get the same gradient
            rows = self.head_rows(self.rank) if n == "lm_head.weight" else slice(None)
            set_adamw_state(optimizer, q, state[WTE if n == "lm_head.weight" else n],
                            lambda t: t[rows].to(self.device, copy=True))
        return optimizer

    def forward_backward(self, x, y, sync):
        """One micro-step as M micro-batches through this rank's actions: its loss on the last rank, else 0."""
        loss = self.run(self.program, x.chunk(self.M), y.chunk(self.M))
        if sync:  # else the tied gradient waits for the last micro-step (gradient accumulation)
            sum_tied_gradient(self.chunks, self.rank, self.pp_size, self.tied_groups, self.head_rows)
        return loss

    def run(self, program, xs, ys):
        """Runs `program` (see p2p_program) over the micro-batches xs[i], ys[i]; returns the mean of their losses on
        the last stage, 0 elsewhere. Without grad (evaluation): a program of forwards only."""
        r, p, last, A = self.rank, self.pp_size, self.n_stages - 1, self.args.grad_accum_steps
        vp = self.args.vocab_parallel
        shape = (*xs[0].shape, self.config.n_embd)  # fixed, never exchanged; fp32 under bf16 autocast too
        stash, inbox, loss_sum = {}, {}, torch.zeros((), device=self.device)  # inbox: received, by message name
        for action, exchange in program:
            if action is not None:
                op, mb, c = action
                s = c * p + r  # this chunk's global stage
                if op == "F":  # the input: token ids on stage 0, else the previous stage's output
                    inp = xs[mb] if s == 0 else inbox.pop(("F", mb, s - 1)).requires_grad_(torch.is_grad_enabled())
                    with timers("compute", label=action), autocast(self.args, self.device):
                        out = self.chunks[c](inp, ys[mb])  # on the last stage: the micro-batch's mean loss
                    if s == last and not vp:
                        loss_sum += out.detach() / len(xs)
                        out = out / (len(xs) * A)  # a micro-batch is 1/(M*A) of the step
                    if torch.is_grad_enabled():
                        # Keep the input (its gradient goes back) and only the output's autograd edge: the output
                        # itself is freed once sent (the ops after it saved their own inputs).
                        stash[(mb, c)] = (inp, get_gradient_edge(out))
                    result = out.detach()
                    if s == last and vp:  # for this rank's vocabulary pass, as if sent to a stage after the last
                        inbox[("F", mb, s)] = result
                elif op == "V":  # on every rank: the logits of my vocabulary rows, the loss, d(loss)/dh
                    h = inbox.pop(("F", mb, last)) if r == p - 1 else torch.empty(shape, device=self.device)
                    # 4*rows*T*C bytes from the last stage to every rank; outside the compute time: a rank waits
                    # here until all have come (the vocabulary pass is a rendezvous of all ranks)
                    dist.broadcast(h, src=p - 1, group=self.vocab_group)
                    with timers("compute", label=action):
                        loss, dh = vocab_pass(h, ys[mb], self.chunks[0].lm_head, self.head_rows(r).start, p - 1,
                                              self.vocab_group, 1 / (len(xs) * A), autocast(self.args, self.device))
                    loss_sum += loss / len(xs) if r == p - 1 else 0
                    if r == p - 1:  # d(loss)/dh, for the last stage's backward, as if sent by a stage after it
                        inbox[("B", mb, last + 1)] = dh
                else:  # d(loss)/d(our output) came from the next stage (the last stage starts from its loss)
                    inp, edge = stash.pop((mb, c))
                    with timers("compute", label=action):
                        torch.autograd.backward(edge, None if s == last and not vp else inbox.pop(("B", mb, s + 1)))
                    result = inp.grad  # d(loss)/d(our input), for the previous stage
                    del inp, edge
            # This step's messages, 4*rows*T*C bytes each: our result to rank r+1 (F) or r-1 (B), and what those
            # ranks sent us in the same step, as one batch, waited before the next step (see p2p_program).
            ops = []
            for peer, is_send, name in exchange:
                if not is_send:
                    inbox[name] = torch.empty(shape, device=self.device)
                ops.append(dist.P2POp(dist.isend if is_send else dist.irecv, result if is_send else inbox[name], peer,
                                      self.p2p_group))
            for work in dist.batch_isend_irecv(ops) if ops else ():
                work.wait()
        return loss_sum

    @torch.no_grad()
    def eval_loss(self, x, y):
        """Forwards only through the pipeline: the loss on the last rank, 0 elsewhere."""
        self.chunks.eval()
        loss = self.run(self.eval_program, x.chunk(self.M), y.chunk(self.M))
        self.chunks.train()
        return loss

    def clip_grad_norm_(self, max_norm):
        # Each rank holds its own stages' gradients: their squares are summed over all ranks (4 bytes). The
        # copy of wte (lm_head on the last rank) is left out so the tied weight counts once, but clipped.
        named = self.named_parameters()
        norm = clip_grad_norm_([q.grad for n, q in named if n != "lm_head.weight"], [], 0)  # 0: only measure
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_([q for _, q in named], max_norm, norm)
        return norm

    def full_state(self, optimizer):
        """Every rank sends its tensors and AdamW state, by GPT name, to rank 0 (gather_object: the whole model
        once over the wire). The copy of wte stays: lm_head.weight is written from wte, as in a tied GPT."""
        named = [(n, q) for n, q in self.named_parameters() if n != "lm_head.weight"]
        mine = ({n: q.detach().cpu() for n, q in named},
                {n: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in optimizer.state[q].items()}
                 for n, q in named if q in optimizer.state})
        gathered = [None] * self.pp_size if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if self.rank != 0:
            return None, None
        params = {n: t for g in gathered for n, t in g[0].items()}
        model = {k: params[WTE if k == "lm_head.weight" else k] for k in GPT(self.config, device="meta").state_dict()}
        return model, {n: s for g in gathered for n, s in g[1].items()}

    def describe(self):
        return (f"{self.args.schedule} schedule, {self.M} micro-batches a micro-step; estimated GFLOP a step "
                f"(forward + backward):" + stage_plan(self.config, self.args, self.pp_size))


def stage_plan(config, args, pp_size):
    """Each stage's pieces and estimated forward + backward FLOPs a step (B*T tokens; backward = 2 x forward, a
    multiply-add = 2 FLOPs): a block 24C^2 + 4TC a token (its matmuls; attention's scores and weighted sum), the
    embedding C (the add of wte and wpe), the head 2VC and the loss 4V (max, subtract, exp, sum), on the last stage or,
    with --vocab_parallel, 1/p of both on every rank. Returns the plan, one indented line a stage and the GFLOP per
    rank, each line starting with a newline."""
    C, T, V, n = config.n_embd, config.block_size, config.vocab_size, pp_size * args.virtual_stages
    gflop = 3 * args.batch_size * T / 1e9
    first_block, per_rank, plan = list(itertools.accumulate(args.stage_layers, initial=0)), [0.0] * pp_size, []
    head = (2 * V * C + 4 * V) * gflop
    for s in range(n):
        a, b, own_head = first_block[s], first_block[s + 1], s == n - 1 and not args.vocab_parallel
        cost = (b - a) * (24 * C * C + 4 * T * C) * gflop + (s == 0) * C * gflop + own_head * head
        per_rank[s % pp_size] += cost
        plan.append(f"stage {s} (rank {s % pp_size}): " + ("wte, wpe, " if s == 0 else "") + f"blocks {a}-{b - 1}"
                    + (", ln_f" if s == n - 1 else "") + (", lm_head" if own_head else "") + f": {cost:.2f}")
    if args.vocab_parallel:
        plan.append(f"vocabulary pass, every rank: lm_head rows r*{V // pp_size} to (r+1)*{V // pp_size}-1 and their "
                    f"part of the loss: {head / pp_size:.2f}")
        per_rank = [g + head / pp_size for g in per_rank]
    plan.append(f"per rank: {[round(g, 2) for g in per_rank]}")
    return "".join(f"\n  {line}" for line in plan)


def add_pp_flags(group):
    group.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    group.add_argument("--n_microbatches", type=int, default=4, help="micro-batches per micro-step")
    group.add_argument("--virtual_stages", type=int, default=None, help="chunks per rank, interleaved only (default 2)")
    group.add_argument("--stage_layers", default=None,
                       help="blocks per stage, e.g. 3,1: one entry per stage (ranks x virtual stages); default even")
    add_bool(group, "--vocab_parallel", False, "custom only: lm_head and the loss split by vocabulary over all ranks")
    add_bool(group, "--print_schedule", False,
             "custom only: time every step; print the last one's timeline and the bubble")


def check_pp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns the DP size: 1."""
    pp_size = world_size  # one stage (V chunks) per rank; every rank runs every row: no data parallelism
    if args.virtual_stages is not None and args.schedule != "interleaved":
        die(f"--virtual_stages: only with --schedule interleaved (got --schedule {args.schedule})")
    if args.print_schedule and args.implementation != "custom":  # torch's schedules keep no timeline to print
        die("--print_schedule: true is only supported by --implementation custom")
    V = args.virtual_stages = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
    if V <= 0 or args.n_microbatches <= 0:
        die(f"--{'virtual_stages' if V <= 0 else 'n_microbatches'}: must be > 0")
    if pp_size == 1 and args.schedule == "interleaved":  # chunk 0 would send to chunk 1 on its own rank
        die("--schedule: interleaved needs at least 2 ranks (run under torchrun --nproc_per_node >= 2)")
    n_stages = pp_size * V
    if args.stage_layers is None:
        if args.n_layer % n_stages:
            die(f"--n_layer: {args.n_layer} layers must be divisible by stages ({pp_size} ranks) x --virtual_stages "
                f"({V}), or give --stage_layers")
        args.stage_layers = [args.n_layer // n_stages] * n_stages
    else:
        try:
            args.stage_layers = [int(n) for n in args.stage_layers.split(",")]
        except ValueError:
            die(f"--stage_layers: a comma-separated list of integers, got {args.stage_layers!r}")
        if len(args.stage_layers) != n_stages:
            die(f"--stage_layers: {len(args.stage_layers)} entries for {n_stages} stages ({pp_size} ranks x "
                f"--virtual_stages {V})")
        if min(args.stage_layers) < 1 or sum(args.stage_layers) != args.n_layer:
            die(f"--stage_layers: every stage needs >= 1 block and they must sum to --n_layer ({args.n_layer}), got "
                f"{args.stage_layers}")
    if args.vocab_parallel and (args.implementation != "custom" or pp_size == 1):
        die("--vocab_parallel: true needs --implementation custom and at least 2 ranks")
    if args.vocab_parallel and args.vocab_size % pp_size:
        die(f"--vocab_parallel: --vocab_size ({args.vocab_size}) must be divisible by the number of ranks ({pp_size})")
    check_batch_split(args, 1)
    if (args.batch_size // args.grad_accum_steps) % args.n_microbatches:
        die(f"--n_microbatches: {args.batch_size // args.grad_accum_steps} rows per micro-step (--batch_size / "
            f"--grad_accum_steps) must be divisible by --n_microbatches ({args.n_microbatches})")
    if args.schedule == "interleaved" and args.n_microbatches % pp_size:
        die(f"--n_microbatches: must be a multiple of the number of ranks ({pp_size}) for --schedule interleaved")
    if args.implementation == "pytorch":  # what torch's schedules need beyond the floor, seen on gloo
        check_torch("2.10", "--implementation: pytorch (torch.distributed.pipelining)",
                    "on 2.9 its first step's shape inference fails: received data size doesn't match")
        if args.dtype == "bfloat16":
            check_torch("2.11", "--dtype: bfloat16 with --implementation pytorch",
                        "on 2.10 no gradient reaches the last stage's lm_head under autocast")
    return 1


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("pp", add_pp_flags, argv)
    D = check_pp_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank, rows, micro = rank * D // world_size, B // D, B // D // A  # rows per DP rank; per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    model = (Pipeline if args.implementation == "custom" else TorchPipeline)(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start)
    if rank == 0:
        print(f"pp ({args.implementation}): {world_size} rank(s) on {device}; global batch {B} x {T} tokens, "
              f"{A} micro-step(s) of {micro} rows; {model.describe()}", flush=True)

    @torch.no_grad()
    def evaluate():
        """Mean loss over eval_iters fixed batches per split, forwards only through the pipeline: the
        last stage computes it and broadcasts it to every rank."""
        out = {}
        for split in ("train", "val"):
            total = torch.zeros((), device=device)
            for k in range(args.eval_iters):
                x, y = get_batch(split, k, B, T, args.seed + 1, args.dataset)
                total += model.eval_loss(x[mine].to(device), y[mine].to(device))
            dist.broadcast(total, src=world_size - 1)  # 4 bytes from the last stage to every rank
            out[split] = total.item() / args.eval_iters
        return out

    # ---- training loop -------------------------------------------------------------------
    profiler, schedule_report = Profiler(args, rank), ScheduleReport(args, model)
    for step in range(start, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            metrics.eval(step, evaluate())
        schedule_report.start_step()
        t0 = time.perf_counter()
        lr = get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch("train", step, B, T, args.seed, args.dataset)
        x, y = x[mine].to(device), y[mine].to(device)
        loss_sum = torch.zeros((), device=device)
        for j in range(A):  # gradients are synchronised on the last micro-step only
            loss_sum += model.forward_backward(x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro], j == A - 1)
        # Logged loss: the mean over all B*T tokens of the global batch (equal chunks: mean of means),
        # computed by the last stage: 4 bytes from it to every rank.
        loss_sum /= A
        dist.broadcast(loss_sum, src=world_size - 1)
        norm = model.clip_grad_norm_(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # zero in place: gradients that are views stay views
        if device.type == "cuda":
            torch.cuda.synchronize()
        metrics.step(step, loss_sum.item(), lr, norm.item(), B * T, time.perf_counter() - t0, device, args.log_interval)
        profiler.step()
        schedule_report.end_step()
        if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0:
            checkpoint(step + 1, model, optimizer, config, args)
    profiler.stop()

    if args.eval_interval:
        metrics.eval(args.max_iters, evaluate())
    checkpoint(args.max_iters, model, optimizer, config, args)
    metrics.summary(model_state_bytes(optimizer), device, **schedule_report.summary())
    metrics.close()


# ---- measurement: the schedule's timeline, bubble and live activations ---------------------

def peak_live(actions, size=lambda chunk: 1):
    """The most a schedule holds between forwards and their backwards (max over its prefixes): live
    micro-batches, or bytes with size(chunk) = what one micro-batch's forward through that chunk saves. A vocabulary
    pass holds nothing after it (its forward and backward are one action)."""
    return max(itertools.accumulate({"F": size(c), "B": -size(c), "V": 0}[op] for op, _, c in actions))


def activation_bytes(model, rows, T):
    """Bytes autograd saves (parameters left out) for one micro-batch's forward through each chunk of this rank,
    measured on a zero batch: token ids on the first stage, else an activation."""
    ids, sizes = torch.zeros(rows, T, dtype=torch.long, device=model.device), []
    for c in range(len(model.chunks)):
        act = torch.zeros(rows, T, model.config.n_embd, device=model.device, requires_grad=True)
        with SavedActivations() as meter, autocast(model.args, model.device):  # targets: own storage, as in training
            model.chunks[c](ids if c == 0 and model.rank == 0 else act, ids.clone())
        sizes.append(meter.bytes)
    return sizes


class ScheduleReport:
    """--print_schedule: every step starts on all ranks at once (a barrier) and its F and B spans (timers("compute"))
    are gathered from all ranks (with --vocab_parallel also the vocabulary passes, 'V3', timed from after their
    broadcast, where a rank waits for the others); at the end rank 0 prints the last step's timeline, the bubble and
    the stage plan. The summary gets each rank's peak live micro-batches and activation bytes (custom only: PyTorch's
    schedules are its own)."""

    def __init__(self, args, model):
        self.args, self.model, self.steps = args, model, []  # steps: per step, every rank's spans
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
        args, model, extra = self.args, self.model, {}
        if args.implementation == "custom":
            size = activation_bytes(model, args.batch_size // args.grad_accum_steps // model.M, args.block_size)
            extra = dict(peak_live_microbatches=peak_live(model.actions),
                         peak_activation_bytes=peak_live(model.actions, lambda c: size[c]))
        if not self.steps or not all(self.steps[-1]):  # no --print_schedule, or PyTorch's (untimed) schedule
            return extra
        p, M, V = model.pp_size, model.M, args.virtual_stages
        ends = [max(t1 for spans in step for _, _, t1 in spans) for step in self.steps]
        busy = [[sum(t1 - t0 for _, t0, t1 in spans) for spans in step] for step in self.steps]  # per step, rank
        bubble = statistics.median(1 - statistics.mean(b) / end for b, end in zip(busy, ends))  # mean over ranks
        S = [1000 * statistics.median(b[r] for b in busy) for r in range(p)]  # F+B ms per step, per rank
        theory = (p - 1) / (V * M + p - 1)  # for equal stages. For the measured S: the slowest stage computes
        # throughout, every other adds one micro-batch's (chunk's) share to fill and drain the pipeline.
        staged = 1 - sum(S) / (p * (max(S) + (sum(S) - max(S)) / (M * V)))
        if model.rank == 0:  # one row per rank; 'F3' = forward of micro-batch 3 (chunk a, b, .. when V > 1)
            width, end = 96, ends[-1]
            print(f"timeline of the last step ({end * 1000:.1f} ms, {width} columns):")
            for rank, spans in enumerate(self.steps[-1]):
                line = ["."] * width  # '.' = idle
                for (op, mb, c), t0, t1 in spans:
                    a = min(int(t0 / end * width), width - 1)
                    b = max(a + 1, int(t1 / end * width))
                    line[a:b] = (f"{op}{mb}{'abcdefghij'[c] if V > 1 else ''}" + "-" * width)[:b - a]
                print(f"  rank {rank} |{''.join(line)}|")
            print(f"bubble: measured {bubble:.1%} (median of {len(ends)} steps, mean over ranks), theory {theory:.1%} "
                  f"= (p-1)/({'V*' if V > 1 else ''}m+p-1) with p={p}, m={M}{f', V={V}' if V > 1 else ''}\n"
                  f"  the theory assumes equal stages; measured F+B ms per step and rank: {[round(s) for s in S]}, "
                  f"for which the same model of the schedule gives {staged:.1%}\nthe stage plan, estimated GFLOP a "
                  f"step:" + stage_plan(model.config, args, p))
        return dict(extra, run=dict(bubble_measured=bubble, bubble_theory=theory, bubble_for_stage_times=staged))


# ---- PyTorch's own pipeline, behind the same methods ---------------------------------------

class TorchPipeline(Pipeline):
    """torch.distributed.pipelining: a PipelineStage around each of the same chunks (its own send/recv) and its
    GPipe / 1F1B / interleaved 1F1B schedule; evaluation, tied gradient, clipping, checkpoints are Pipeline's."""

    def __init__(self, config, args, device, state=None):
        super().__init__(config, args, device, state)
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
        stages = [PipelineStage(chunk, c * self.pp_size + self.rank, self.n_stages, device)
                  for c, chunk in enumerate(self.chunks)]
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[args.schedule]
        scale = 1.0 / (args.grad_accum_steps * self.M)
        # the loss pre-scaled like ours: its scale_grads would also divide the .grad of earlier micro-steps
        self.schedule = schedule(stages if args.schedule == "interleaved" else stages[0], self.M, scale_grads=False,
                                 loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten()) * scale)

    def forward_backward(self, x, y, sync):
        last, losses = self.rank == self.pp_size - 1, []
        with autocast(self.args, self.device):
            self.schedule.step(*([x] if self.rank == 0 else []), **(dict(target=y, losses=losses) if last else {}))
        if sync:
            sum_tied_gradient(self.chunks, self.rank, self.pp_size, self.tied_groups, self.head_rows)
        if not last:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum().detach() * self.args.grad_accum_steps  # losses were scaled by 1/(A*M)


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
