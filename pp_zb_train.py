"""PP with zero bubble: pp_train.py's pipeline plus ZB-H1 and ZB-V, by hand with send/recv.

The n_layer blocks are cut into n_stages = pp_size * V stages, V = --virtual_stages chunks per rank
(n_chunks): rank r runs stages r, r + pp_size, ...; equal ones, or --stage_layers 3,1 (blocks per
stage); the first also holds wte/wpe, the last ln_f and lm_head. Every rank sees every row (no data
parallelism): each micro-step's `micro` rows are cut into M micro-batches.
  memory per rank:  about 16P/pp_size (fp32 params + grads + AdamW), plus a copy of the tied wte
                    (lm_head) on the last rank; activations of the micro-batches between F and B.
  communication:    each micro-batch's activation (micro/M x T x C fp32) goes to the next stage
                    and its gradient comes back: 2*M*(n_stages-1) messages a micro-step; plus a
                    step's all-reduce of the tied wte/lm_head gradient (4*vocab*C bytes), 2 ranks.
The schedule orders each rank's forwards (F) and backwards (B). With equal stages a rank idles (the
"bubble") (pp_size-1)/(M+pp_size-1) of a step; --print_schedule measures it and draws a timeline.
  gpipe        all M forwards, then all M backwards: M micro-batches' activations live at once.
  1f1b         pp_size-r-1 warm-up forwards, then one F one B: at most pp_size micro-batches
               live, whatever M is.
  interleaved  1F1B over V chunks per rank (Megatron): a bubble of (pp_size-1)/(V*M+pp_size-1),
               for V times more messages.
  zb1p         ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): B computes only the
               input's gradient, which the stage before waits for; each linear's weight gradient
               (the blocks' and the head's) waits for a W action (DeferredWeightGrads), which fills
               the cool-down's waits.
               With T_F = T_B = T_W the idle time falls from (pp_size-1)(T_F+T_B+T_W) to
               (pp_size-1)(T_F+T_B-T_W); at most pp_size micro-batches live, as 1F1B's first rank.
  zbv          ZB-V: two chunks a rank in a V (rank r: stages r and 2*pp_size-1-r, so the first and
               the last stage, and the tied wte and lm_head, share rank 0), B and W split as in
               zb1p, ordered by zero_bubble_v: a rank idles at most about pp_size chunk steps (half
               a stage's T each), with 1F1B's activation memory.
The head split by vocabulary (--vocab_parallel) is in pp_vocab_train.py: its passes are a
rendezvous of every rank each micro-batch, where the zero-bubble orders have ranks at different
micro-batches.
Run:
  python pp_zb_train.py  # single process: one stage, ZB-H1 (--schedule zb1p, the default)
  torchrun --standalone --nproc_per_node=2 pp_zb_train.py  # ZB-H1, 2 stages (GPUs or CPU processes)
  torchrun --standalone --nproc_per_node=2 pp_zb_train.py --print_schedule
  torchrun --standalone --nproc_per_node=2 pp_zb_train.py --schedule zbv --n_layer 4
  torchrun --standalone --nproc_per_node=2 pp_zb_train.py --implementation pytorch  # torch's ZB-H1
The derivations and measured bubbles: docs/pp.md.
"""
import itertools
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from common.checkpoint import checkpoint, gather_to_rank0, resume, set_adamw_state
from common.config import add_bool, check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import Batches, get_batch
from common.distributed import autocast, clip_grad_norm_, setup, setup_data, teardown
from common.metrics import MFU, Metrics, Profiler, model_state_bytes, timers
from common.model import BLOCK_LINEARS, GPT, compile_forward, configure_optimizer
from common.model import cross_entropy, init_tensor
from common.recompute import checkpoint_blocks
from common.schedule_report import ScheduleReport
import peers.torch_pp

ZERO_BUBBLE = ("zb1p", "zbv")  # the schedules whose backward is split into B and W

WTE_NAME = "transformer.wte.weight"  # lm_head.weight is tied to it: the last stage holds a copy


# ---- the strategy: the schedules, as data ----------------------------------------------------
#
# Each rank's order of forwards (F2: micro-batch 2's) and backwards, with pp_size = 2 ranks and
# M = 4 micro-batches, on a clock of equal steps ('.': idle), as schedule_actions lists them and
# timetable lays them out (--print_schedule prints a run's own at its start; tests/test_pp.py
# checks this one against the code):
#   gpipe   rank 0 | F0 F1 F2 F3 .  .  B0 B1 B2 B3
#           rank 1 | .  F0 F1 F2 F3 B0 B1 B2 B3 .
#   1f1b    rank 0 | F0 F1 .  B0 F2 B1 F3 B2 .  B3
#           rank 1 | .  F0 B0 F1 B1 F2 B2 F3 B3 .
# Both take 10 steps, 2 of them idle on each rank (the bubble); but GPipe's rank 0 holds 4
# micro-batches' activations at once (F done, B not yet), 1F1B's at most 2 (pp_size - rank),
# whatever M is: one warm-up forward, then one F one B.

def schedule_actions(schedule, rank, pp_size, M, n_chunks=1):
    """The ordered actions of `rank` for one batch: (op, microbatch, chunk) with op "F" or "B" (or
    W, zb1p and zbv); chunk c of rank r is global stage c*pp_size + r. A pure function, so tests
    can check orders. Every schedule but zb1p and zbv is the loop at its end: warm-up forwards,
    then one forward one backward, then the remaining backwards; they differ in the warm-up."""
    total = M * n_chunks
    to_last = pp_size - rank - 1  # d: how many ranks come after this one

    def microbatch(k):  # of the k-th forward: pp_size micro-batches through chunk 0, the same
        return k // (pp_size * n_chunks) * pp_size + k % pp_size  # through chunk 1, ...

    def forward(k):
        return ("F", microbatch(k), k // pp_size % n_chunks)

    def backward(k):  # the chunks in reverse
        return ("B", microbatch(k), n_chunks - 1 - k // pp_size % n_chunks)

    if schedule == "zb1p":
        return zero_bubble_h1(pp_size, M, rank)
    if schedule == "zbv":
        return zero_bubble_v(pp_size, M)[rank]
    # The warm-up: the forwards before the first backward.
    if schedule == "gpipe":  # all of them
        warmup = total
    elif schedule == "1f1b":  # those before the first backward can arrive: <= pp_size-rank live
        warmup = to_last
    else:  # interleaved (Megatron)
        warmup = 2 * to_last + (n_chunks - 1) * pp_size
    warmup = min(warmup, total)
    actions = []
    for k in range(warmup):  # warm-up: forwards only
        actions.append(forward(k))
    for k in range(total - warmup):  # steady state: one forward, one backward
        actions.append(forward(warmup + k))
        actions.append(backward(k))
    for k in range(total - warmup, total):  # cool-down: the backwards left
        actions.append(backward(k))
    return actions


def zero_bubble_h1(pp_size, M, rank):
    """ZB-H1's actions for `rank` (chunk 0): 1F1B with each backward split into B and W, and W held
    back. With p ranks and m micro-batches, rank r warms up with p-r forwards (one more than
    1F1B), then runs B(k), W(k-r) and the next F, and at the end the r W's it held back. On a clock
    of equal F, B and W steps the first rank never waits after its warm-up, and with m >= p the
    step takes 3m + p - 1 steps, 1F1B's 3m + 3(p-1) less 2(p-1) (tests/test_pp.py). Live
    micro-batches (F done, W not yet): at most p on every rank."""
    warmup = min(pp_size - rank, M)
    actions = [("F", k, 0) for k in range(warmup)]
    for k in range(M):
        actions.append(("B", k, 0))
        if k >= rank:  # rank r's W lags r micro-batches: it fills r waits of the cool-down
            actions.append(("W", k - rank, 0))
        if warmup + k < M:
            actions.append(("F", warmup + k, 0))
    actions += [("W", k, 0) for k in range(max(M - rank, 0), M)]
    return actions


def zero_bubble_v(pp_size, M):
    """ZB-V's actions for every rank, by list scheduling on a clock of equal F, B and W steps (each
    a chunk's: half a stage of ZB-H1's): in each step every rank runs the first that can run of a B
    (its output's gradient has come; the later chunk first), an F (its input has come, and fewer
    than 2*pp_size chunk micro-batches await their W: 1F1B's peak of pp_size whole stages) or its
    oldest waiting W, else it idles. What a step sends arrives for the next step."""
    n_stages = 2 * pp_size
    done = {}  # (op, micro-batch, stage) -> the step it ran in
    next_f = [[0, 0] for _ in range(pp_size)]  # per rank and chunk: the next micro-batch's F
    next_b = [[0, 0] for _ in range(pp_size)]
    waiting_w = [[] for _ in range(pp_size)]  # (micro-batch, chunk) of each B whose W has not run
    live = [0] * pp_size
    orders = [[] for _ in range(pp_size)]
    step = 0

    def came(op, mb, stage):  # stage's op(mb) ran in an earlier step; stage None: no input needed
        return stage is None or done.get((op, mb, stage), step) < step
    while any(len(order) < 6 * M for order in orders):
        chosen = []
        for rank in range(pp_size):
            pick = None
            for chunk in (1, 0):
                stage = stage_index(rank, chunk, pp_size, True)
                k = next_b[rank][chunk]
                after = stage + 1 if stage < n_stages - 1 else None
                if (pick is None and k < next_f[rank][chunk] and came("F", k, stage)
                        and came("B", k, after)):
                    pick = ("B", k, chunk)
            for chunk in (1, 0):
                stage = stage_index(rank, chunk, pp_size, True)
                k = next_f[rank][chunk]
                before = stage - 1 if stage > 0 else None
                if (pick is None and k < M and live[rank] < 2 * pp_size
                        and came("F", k, before)):
                    pick = ("F", k, chunk)
            if pick is None and waiting_w[rank]:
                pick = ("W", *waiting_w[rank][0])
            chosen.append(pick)
        for rank, action in enumerate(chosen):
            if action is None:
                continue
            op, k, chunk = action
            done[(op, k, stage_index(rank, chunk, pp_size, True))] = step
            orders[rank].append(action)
            if op == "F":
                next_f[rank][chunk] += 1
                live[rank] += 1
            elif op == "B":
                next_b[rank][chunk] += 1
                waiting_w[rank].append((k, chunk))
            else:
                waiting_w[rank].pop(0)
                live[rank] -= 1
        step += 1
    return orders


def stage_index(rank, chunk, pp_size, v_shape=False):
    """The global stage of `rank`'s chunk: chunk*pp_size + rank; in a V (zbv): rank, then
    2*pp_size-1-rank."""
    if v_shape and chunk:
        return 2 * pp_size - 1 - rank
    return chunk * pp_size + rank


def stage_rank(stage, pp_size, v_shape=False):
    """The rank that holds global stage `stage` (the inverse of stage_index)."""
    if v_shape and stage >= pp_size:
        return 2 * pp_size - 1 - stage
    return stage % pp_size


def messages(action, rank, pp_size, n_stages, v_shape=False):
    """What `action` on `rank` receives and sends, each (peer rank, name), None at the ends of the
    pipeline. A message is named (op, micro-batch, sending stage): F sends its output to the next
    stage, B its input's gradient back."""
    op, mb, chunk = action
    if op == "W":  # a weight gradient, on this rank's own tensors
        return None, None
    stage = stage_index(rank, chunk, pp_size, v_shape)  # the global stage
    direction = 1 if op == "F" else -1
    source = stage - direction
    target = stage + direction
    recv = send = None
    if 0 <= source < n_stages:
        recv = (stage_rank(source, pp_size, v_shape), (op, mb, source))
    if 0 <= target < n_stages:
        send = (stage_rank(target, pp_size, v_shape), (op, mb, stage))
    return recv, send


def timetable(actions, n_stages, v_shape=False):
    """Every rank's actions (actions[rank]: its own, in order) on one clock of equal steps, as
    PyTorch's pipelining lays out its multi-stage schedules: a rank runs its next action at the
    first step after the one that sent the message it needs, and idles (None) until then.
    Returns table[rank][step]."""
    pp_size = len(actions)
    todo = [list(rank_actions) for rank_actions in actions]
    sent = set()
    table = [[] for _ in actions]
    while any(todo):
        ready = [False] * pp_size
        for rank, queue in enumerate(todo):
            if not queue:
                continue
            need = messages(queue[0], rank, pp_size, n_stages, v_shape)[0]
            ready[rank] = need is None or need[1] in sent
        step = [queue.pop(0) if go else None for queue, go in zip(todo, ready)]
        assert any(step), "the schedule waits for itself"
        for rank, action in enumerate(step):
            table[rank].append(action)
            send = action and messages(action, rank, pp_size, n_stages, v_shape)[1]
            if send:
                sent.add(send[1])
    return table


def draw(table):
    """The timetable as text, a line a rank, as in the picture above: 'F2' is micro-batch 2's
    forward (of chunk a, b, ... when a rank has several), '.' an idle step."""
    several = any(action and action[2] for row in table for action in row)
    labels = []
    for row in table:
        labels.append([])
        for action in row:
            op, mb, chunk = action or (".", "", 0)
            labels[-1].append(f"{op}{mb}" + ("abcdefghij"[chunk] if several and action else ""))
    width = max(len(label) for row in labels for label in row)
    lines = [" ".join(label.ljust(width) for label in row).rstrip() for row in labels]
    return "\n".join(f"rank {rank} | {line}" for rank, line in enumerate(lines))


def p2p_program(table, rank, n_stages, v_shape=False):
    """This rank's program, one entry per step of the timetable: (its action or None, the messages
    exchanged after it, as (peer, is_send, name)): what its action sends, and what the neighbours'
    actions of the same step send to it. Under NCCL a send may complete only when its receive is
    posted, and messages between two ranks are matched in order; so each step's sends and receives
    are posted together (one batch_isend_irecv) and waited before the next step, as
    torch.distributed.pipelining does: every message is received in the step it is sent, in the
    same order on both sides, and no rank waits in a send for a peer that waits in a send itself
    (when interleaved, activations flow both ways between ranks 0 and pp_size-1). In a V (zbv)
    stage pp_size-1 sends to stage pp_size on its own rank: no message, the executor keeps it."""
    pp_size = len(table)
    program = []
    for tick, action in enumerate(table[rank]):
        ops = []
        for other in range(pp_size):
            theirs = table[other][tick]
            send = theirs and messages(theirs, other, pp_size, n_stages, v_shape)[1]
            if send and send[0] == other:  # to its own next chunk
                continue
            if send and other == rank:  # what my action sends
                ops.append((send[0], True, send[1]))
            elif send and send[0] == rank:  # what a neighbour's action sends me
                ops.append((other, False, send[1]))
        program.append((action, ops))
    return program


# ---- the strategy: the backward split in two, for the zero-bubble schedules ------------------

class DeferredWeightGrads:
    """B and W of the zero-bubble schedules (zb1p, zbv). Each linear of a stage (DeferredLinear:
    the blocks' and the head's) runs its backward in two parts: at B the input's gradient
    dX = dY W, which the stage before waits for; its weight's, dW = dY^T X, and bias's, sum(dY),
    are queued under the micro-batch and chunk (DeepSeek's WeightGradStore) and run at its W,
    which waits for nothing. X is what forward saved, dY what B computed: both stay until W.
    LayerNorms and the embeddings (the little rest) keep autograd's own backward, in B."""

    def __init__(self):
        self.key = None  # the (micro-batch, chunk) whose B is running
        self.queues = {}

    def defer(self, weight_grad):
        self.queues.setdefault(self.key, []).append(weight_grad)

    @torch.no_grad()  # outside autograd's backward: no graph of the gradients
    def run(self, key):
        for weight_grad in self.queues.pop(key, []):
            weight_grad()


def accumulate_grad_(param, grad):
    """param.grad += grad, as autograd accumulates it (across micro-batches and micro-steps)."""
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class DeferredLinear(torch.autograd.Function):
    """y = x W^T + b whose backward returns dX only and queues dW and db on `store`."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.store, ctx.x_dtype, ctx.params = store, x.dtype, (weight, bias)
        if torch.is_autocast_enabled(x.device.type):  # backward runs outside autocast: cast now
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.to(weight.dtype)
        weight_param, bias_param = ctx.params

        def weight_grad():  # at W: (out, in) = dY^T X, summed over the micro-batch's tokens
            accumulate_grad_(weight_param, dy.flatten(0, -2).t() @ x.flatten(0, -2))
            if bias_param is not None:
                accumulate_grad_(bias_param, dy.flatten(0, -2).sum(0))
        ctx.store.defer(weight_grad)
        return (dy @ weight).to(ctx.x_dtype), None, None, None


def defer_weight_grads(chunk, store):
    """Every nn.Linear of `chunk` (its blocks', and the head's on the last stage) computes through
    DeferredLinear, its parameters unchanged."""
    for module in chunk.modules():
        if isinstance(module, nn.Linear):
            module.forward = lambda x, m=module: DeferredLinear.apply(x, m.weight, m.bias, store)


# ---- the strategy: the stages, and the executor that runs a schedule with send/recv --------

class Stage(nn.Module):
    """Global stage `index` of `n_stages`: its blocks (named as in GPT, e.g. transformer.h.2, so
    checkpoints and optimizer state keep GPT's names), plus wte/wpe on the first stage and ln_f on
    the last. `head`: the rows of the tied wte this stage's lm_head holds (a copy unless the stage
    also holds wte): all of them on the last stage, else None. Only these tensors get storage, from
    the full checkpoint `state` or GPT's init."""

    def __init__(self, config, index, n_stages, blocks, head, state, seed, device):
        super().__init__()
        full = GPT(config, device="meta").transformer  # the whole model without storage
        self.first = index == 0
        self.last = index == n_stages - 1
        pieces = dict(h=nn.ModuleDict({str(i): full.h[i] for i in blocks}))
        if self.first:
            pieces.update(wte=full.wte, wpe=full.wpe, drop=full.drop)
        if self.last:
            pieces.update(ln_f=full.ln_f)
        self.transformer = nn.ModuleDict(pieces)
        if head is not None:  # its own Parameter: a copy of wte's rows (unless tied below)
            n_rows = head.stop - head.start
            self.lm_head = nn.Linear(config.n_embd, n_rows, bias=False, device="meta")
        self.to_empty(device=device)
        if self.first and self.last:
            self.lm_head.weight = self.transformer.wte.weight  # one stage: the tie is one tensor
        with torch.no_grad():
            for name, param in self.named_parameters():
                rows = slice(None)
                if name == "lm_head.weight":  # the copy of wte starts from wte's rows
                    name, rows = WTE_NAME, head
                if state is not None:
                    value = state[name]
                else:
                    shape = (config.vocab_size, config.n_embd) if name == WTE_NAME else param.shape
                    value = init_tensor(name, shape, config, seed)
                param.copy_(value[rows])

    def forward(self, x, targets=None):  # token ids on the first stage, else an activation
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(pos))
        for block in self.transformer.h.values():
            x = block(x)
        if not self.last:
            return x
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # the last stage: logits, or their mean loss
        if targets is None:
            return logits
        return cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B*T, vocab)


class Pipeline:
    """The strategy behind the loop's few methods: this rank's chunks (Stages) and its schedule's
    actions."""
    checkpoint_blocks = staticmethod(checkpoint_blocks)  # --activation_checkpointing's, by hand
    defer_weight_grads = staticmethod(defer_weight_grads)  # zb1p, zbv: B and W split by hand

    def __init__(self, config, args, device, state=None):
        self.config, self.args, self.device = config, args, device
        self.M = args.n_microbatches
        self.rank = dist.get_rank()
        self.pp_size = dist.get_world_size()
        n_chunks = args.virtual_stages
        self.n_stages = self.pp_size * n_chunks
        self.v_shape = args.schedule == "zbv"  # chunk 1 of rank r: stage 2*pp_size-1-r
        # the rank of the last stage: its loss, and the head
        self.loss_rank = self.rank_of(self.n_stages - 1)
        first_block = list(itertools.accumulate(args.stage_layers, initial=0))
        self.chunks = nn.ModuleList()
        self.deferred = DeferredWeightGrads()  # zb1p, zbv: the W actions' weight gradients
        defers = args.schedule in ZERO_BUBBLE
        for chunk in range(n_chunks):
            stage = self.stage_of(chunk)  # its global stage
            head = slice(0, config.vocab_size) if stage == self.n_stages - 1 else None  # lm_head
            blocks = range(first_block[stage], first_block[stage + 1])
            self.chunks.append(Stage(config, stage, self.n_stages, blocks, head, state, args.seed,
                                     device))
            if defers:
                self.defer_weight_grads(self.chunks[-1], self.deferred)
            # --compile: each block's forward (the p2p messages pass between chunks); with
            # DeferredLinear its linears stay eager, their weight gradients queued for W
            compile_forward(self.chunks[-1].transformer.h.values(), args.compile,
                            BLOCK_LINEARS if defers else ())
            # full: a chunk's forward runs again at its B action, inside its backward, so it keeps
            # only each block's input from F to B (the schedule's live activations shrink)
            self.checkpoint_blocks(self.chunks[-1].transformer.h.values(),
                                   args.activation_checkpointing)
        # Made by every rank, in the same order. p2p_group: the pipeline's messages, apart from the
        # loop's collectives; tied_group: rank 0 (wte) and the last stage's rank (its copy,
        # lm_head), none in a V (zbv: both on rank 0).
        # nccl: p2p_group connects here, every rank joining (new_group inherits setup's device_id),
        # so its first batch_isend_irecv may be ranks 0 and 1 alone (more than 2 stages);
        # a lazily connected group would need every rank in that first call.
        self.p2p_group = dist.new_group()
        self.tied_group = dist.new_group([0, self.loss_rank]) if self.loss_rank > 0 else None
        every = []  # every rank's actions: the timetable needs them all
        for other in range(self.pp_size):
            every.append(schedule_actions(args.schedule, other, self.pp_size, self.M, n_chunks))
        self.actions = every[self.rank]
        n_stages, v_shape = self.n_stages, self.v_shape
        table = timetable(every, n_stages, v_shape)
        if args.print_schedule and self.rank == 0:  # the order, as in the picture at the top
            print(f"{args.schedule} on a clock of equal steps:\n{draw(table)}", flush=True)
        self.program = p2p_program(table, self.rank, n_stages, v_shape)
        forwards = []  # evaluation: the same actions without the backwards
        for actions in every:
            forwards.append([action for action in actions if action[0] not in ("B", "W")])
        forward_table = timetable(forwards, n_stages, v_shape)
        self.eval_program = p2p_program(forward_table, self.rank, n_stages, v_shape)

    def stage_of(self, chunk):
        return stage_index(self.rank, chunk, self.pp_size, self.v_shape)

    def rank_of(self, stage):
        return stage_rank(stage, self.pp_size, self.v_shape)

    def named_parameters(self):
        named = []
        for chunk in self.chunks:
            named += chunk.named_parameters()
        return named

    def configure_optimizer(self, args, state=None):
        named = self.named_parameters()
        betas = (args.beta1, args.beta2)
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        if state:  # a checkpoint's AdamW state, keyed by GPT name
            for name, param in named:
                if name == "lm_head.weight":  # the copy of wte: its state, the same gradient
                    name = WTE_NAME
                set_adamw_state(optimizer, param, state[name],
                                lambda full: full.to(self.device, copy=True))
        return optimizer

    def forward_backward(self, x, y, sync):
        """One micro-step as M micro-batches through this rank's actions: its loss on the last
        rank, else 0."""
        loss = self.run(self.program, x.chunk(self.M), y.chunk(self.M))
        if sync:  # else the tied gradient waits for the last micro-step (gradient accumulation)
            self.sum_tied_gradient()
        return loss

    def run(self, program, xs, ys):
        """Runs `program` (see p2p_program) over the micro-batches xs[i], ys[i]; returns the mean of
        their losses on the last stage, 0 elsewhere. Without grad (evaluation): a program of
        forwards only."""
        rank, last = self.rank, self.n_stages - 1
        A = self.args.grad_accum_steps
        shape = (*xs[0].shape, self.config.n_embd)  # never exchanged; fp32 under bf16 autocast too
        stash = {}  # (micro-batch, chunk): the input and the output's autograd edge, until B
        inbox = {}  # received tensors, by message name
        loss_sum = torch.zeros((), device=self.device)
        for action, exchange in program:
            if action is not None:
                op, mb, chunk = action
                stage = self.stage_of(chunk)  # this chunk's global stage
                if op == "F":  # the input: token ids on stage 0, else the previous stage's output
                    if stage == 0:
                        inp = xs[mb]
                    else:
                        inp = inbox.pop(("F", mb, stage - 1))
                        inp.requires_grad_(torch.is_grad_enabled())
                    with timers("compute", label=action), autocast(self.args, self.device):
                        out = self.chunks[chunk](inp, ys[mb])  # the last stage: the mean loss
                    if stage == last:
                        loss_sum += out.detach() / len(xs)
                        out = out / (len(xs) * A)  # a micro-batch is 1/(M*A) of the step
                    if torch.is_grad_enabled():
                        # Keep the input (its gradient goes back) and the output's autograd edge
                        # only: the output is freed once sent (the ops after it saved their inputs).
                        stash[(mb, chunk)] = (inp, get_gradient_edge(out))
                    result = out.detach()
                elif op == "W":  # zb1p, zbv: the linears' weight gradients that B queued
                    with timers("compute", label=action):
                        self.deferred.run((mb, chunk))
                else:  # B: from the gradient of our output (none on the last stage: its loss)
                    inp, edge = stash.pop((mb, chunk))
                    grad_out = None
                    if stage != last:
                        grad_out = inbox.pop(("B", mb, stage + 1))  # sent by the next stage
                    self.deferred.key = (mb, chunk)  # zb1p, zbv: where B's weight gradients wait
                    with timers("compute", label=action):
                        torch.autograd.backward(edge, grad_out)
                    result = inp.grad  # d(loss)/d(our input), for the previous stage
                    del inp, edge, grad_out
                send = messages(action, rank, self.pp_size, self.n_stages, self.v_shape)[1]
                if send and send[0] == rank:  # zbv: to this rank's other chunk, kept, not sent
                    inbox[send[1]] = result
            # This step's messages, 4*rows*T*C bytes each: our result to the next rank (F) or the
            # previous (B), and what they sent us in this step, as one batch, waited here (see
            # p2p_program).
            ops = []
            for peer, is_send, name in exchange:
                if is_send:
                    ops.append(dist.P2POp(dist.isend, result, peer, self.p2p_group))
                else:
                    inbox[name] = torch.empty(shape, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, inbox[name], peer, self.p2p_group))
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        return loss_sum

    @torch.no_grad()
    def eval_loss(self, x, y):
        """Forwards only through the pipeline: the loss on the last rank, 0 elsewhere."""
        self.chunks.eval()
        loss = self.run(self.eval_program, x.chunk(self.M), y.chunk(self.M))
        self.chunks.train()
        return loss

    def sum_tied_gradient(self):
        """wte (rank 0) and its copy, lm_head on the last stage's rank, each got one part of the
        tied gradient, the lookup's and the head's. The two ranks sum them (4*vocab*C fp32 bytes
        each way; in a V, rank 0 holds both: locally): after the sum both hold the full tied
        gradient, take identical AdamW steps and stay equal without ever sending the weight."""
        if len(self.chunks) == 1 == self.pp_size:  # one rank, one chunk: the tie is one tensor
            return
        if self.rank == 0 and self.loss_rank == 0:  # zbv: wte on chunk 0, lm_head on chunk 1
            wte, head = self.chunks[0].transformer.wte.weight, self.chunks[-1].lm_head.weight
            wte.grad += head.grad
            head.grad.copy_(wte.grad)
        elif self.rank == 0:
            dist.all_reduce(self.chunks[0].transformer.wte.weight.grad, group=self.tied_group)
        elif self.rank == self.loss_rank:
            dist.all_reduce(self.chunks[-1].lm_head.weight.grad, group=self.tied_group)

    def clip_grad_norm_(self, max_norm):
        # Each rank holds its own stages' gradients: their squares are summed over all ranks (4
        # bytes). The copy of wte (lm_head) is left out so the tied weight counts once, but clipped.
        named = self.named_parameters()
        grads = [q.grad for n, q in named if n != "lm_head.weight"]
        norm = clip_grad_norm_(grads, [], 0)  # 0: only measure
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_([q for _, q in named], max_norm, norm)
        return norm

    def full_state(self, optimizer):
        return gather_full_state(self, optimizer)  # checkpoint plumbing: after main()

    def describe(self):  # the stage plan (estimated FLOPs a stage): --print_schedule's report
        return f"{self.args.schedule} schedule, {self.M} micro-batches a micro-step"


class TorchPipeline(peers.torch_pp.TorchPipeline, Pipeline):
    """--implementation pytorch: torch.distributed.pipelining's stages and schedules in place of the
    send/recv executor (peers/torch_pp.py); the other methods are Pipeline's."""


def add_pp_flags(group):
    group.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", *ZERO_BUBBLE],
                       default="zb1p")
    group.add_argument("--n_microbatches", type=int, default=4, help="micro-batches per micro-step")
    group.add_argument("--virtual_stages", type=int, default=None,
                       help="chunks per rank, interleaved only (default 2)")
    group.add_argument("--stage_layers", default=None,
                       help="blocks per stage, e.g. 3,1: one entry per stage (ranks x virtual "
                            "stages); default even")
    group.add_argument("--vocab_parallel", nargs="?", const=True, metavar="true|false",
                       help="in pp_vocab_train.py")
    add_bool(group, "--print_schedule", False,
             "custom only: time every step; print the last one's timeline and the bubble")


def check_pp_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns the DP size: 1."""
    pp_size = world_size  # n_chunks stages per rank; every rank runs every row: no data parallelism
    if args.vocab_parallel is not None:
        die("--vocab_parallel: the vocabulary-parallel head is in pp_vocab_train.py")
    if args.virtual_stages is not None and args.schedule != "interleaved":
        die(f"--virtual_stages: only with --schedule interleaved (got --schedule {args.schedule})")
    if args.print_schedule and args.implementation != "custom":  # torch's schedules: no timeline
        die("--print_schedule: true is only supported by --implementation custom")
    if args.virtual_stages is None:  # zbv: two chunks a rank, in a V
        args.virtual_stages = 2 if args.schedule in ("interleaved", "zbv") else 1
    n_chunks = args.virtual_stages
    if n_chunks <= 0:
        die("--virtual_stages: must be > 0")
    if args.n_microbatches <= 0:
        die("--n_microbatches: must be > 0")
    if pp_size == 1 and args.schedule == "interleaved":  # chunk 0 would send to its own chunk 1
        die("--schedule: interleaved needs at least 2 ranks "
            "(run under torchrun --nproc_per_node >= 2)")
    n_stages = pp_size * n_chunks
    if args.stage_layers is None:
        if args.n_layer % n_stages:
            die(f"--n_layer: {args.n_layer} layers must be divisible by stages ({pp_size} ranks) x "
                f"--virtual_stages ({n_chunks}), or give --stage_layers")
        args.stage_layers = [args.n_layer // n_stages] * n_stages
    else:
        try:
            args.stage_layers = [int(blocks) for blocks in args.stage_layers.split(",")]
        except ValueError:
            die(f"--stage_layers: a comma-separated list of integers, got {args.stage_layers!r}")
        if len(args.stage_layers) != n_stages:
            die(f"--stage_layers: {len(args.stage_layers)} entries for {n_stages} stages "
                f"({pp_size} ranks x --virtual_stages {n_chunks})")
        if min(args.stage_layers) < 1 or sum(args.stage_layers) != args.n_layer:
            die(f"--stage_layers: every stage needs >= 1 block and they must sum to --n_layer "
                f"({args.n_layer}), got {args.stage_layers}")
    check_batch_split(args, 1)
    rows = args.batch_size // args.grad_accum_steps  # per micro-step
    if rows % args.n_microbatches:
        die(f"--n_microbatches: {rows} rows per micro-step (--batch_size / --grad_accum_steps) "
            f"must be divisible by --n_microbatches ({args.n_microbatches})")
    if args.schedule == "interleaved" and args.n_microbatches % pp_size:
        die(f"--n_microbatches: must be a multiple of the number of ranks ({pp_size}) for "
            "--schedule interleaved")
    peers.torch_pp.check_args(args)  # what torch's pipelining needs: its torch versions
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
    dp_rank = rank * D // world_size
    rows = B // D  # rows per data-parallel rank
    micro = rows // A  # rows per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    Strategy = Pipeline if args.implementation == "custom" else TorchPipeline
    model = Strategy(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    mfu = MFU(config, args, device, world_size)  # model FLOPs utilisation, per log line
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start, mfu=mfu)
    if rank == 0:
        print(f"pp ({args.implementation}): {world_size} rank(s) on {device} in {args.dtype}, "
              f"{model.describe()}; global batch {B} x {T} tokens, "
              f"{A} micro-step(s) of {micro} rows per data-parallel rank", flush=True)

    @torch.no_grad()
    def evaluate():
        """Mean loss over eval_iters fixed batches per split: each data-parallel rank evaluates
        its rows of each batch (here all ranks together); the last stage broadcasts the mean."""
        out = {}
        for split in ("train", "val"):
            total = torch.zeros((), device=device)
            for i in range(args.eval_iters):
                x, y = get_batch(split, i, B, T, args.seed + 1, args.dataset)
                x, y = x[mine].to(device), y[mine].to(device)
                total += model.eval_loss(x, y)
            dist.broadcast(total, src=model.loss_rank)  # 4 bytes from the last stage to every rank
            out[split] = total.item() / args.eval_iters
        return out

    # ---- training loop -------------------------------------------------------------------
    profiler = Profiler(args, rank)
    schedule_report = ScheduleReport(args, model)  # --print_schedule's timeline; live activations
    batches = Batches(args, mine, device)  # the training batches, one step ahead
    for step in range(start, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            metrics.eval(step, evaluate())
        schedule_report.start_step()
        t0 = time.perf_counter()
        lr = get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batches.get(step)  # this rank's rows, on the device
        loss_sum = torch.zeros((), device=device)
        for j in range(A):  # gradients are synchronised on the last micro-step only
            part = slice(j * micro, (j + 1) * micro)
            loss_sum += model.forward_backward(x[part], y[part], sync=j == A - 1)
        batches.prefetch(step + 1)  # built and copied while the device runs this step
        # Logged loss: the mean over all B*T tokens of the global batch (equal chunks: mean of
        # means).
        loss_sum /= A
        dist.broadcast(loss_sum, src=model.loss_rank)  # the last stage's: 4 bytes to every rank
        norm = model.clip_grad_norm_(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # zero in place: gradients that are views stay views
        loss, norm = torch.stack([loss_sum, norm]).tolist()  # the step's one host sync
        dt = time.perf_counter() - t0  # the step's kernels have run
        metrics.step(step, loss, lr, norm, B * T, dt, device, args.log_interval)
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


# ---- checkpoint: the stages' tensors gathered into one full checkpoint ---------------------

def gather_full_state(pipe, optimizer):
    """The full checkpoint's dicts, by GPT name, in rank 0's CPU memory (None elsewhere): every rank
    sends its parameters and their AdamW state to rank 0, one message a tensor (gather_to_rank0).
    The copy of wte (lm_head) stays: lm_head.weight is written from wte, as in a tied GPT."""
    entries = []
    for name, q in pipe.named_parameters():
        if name == "lm_head.weight":
            continue
        values = {"param": q.detach(), **optimizer.state.get(q, {})}  # step: a CPU tensor
        for key, value in values.items():
            value = value.to(pipe.device)
            entries.append((name, key, value.shape, value.dtype, lambda value=value: value))
    return gather_to_rank0(entries, True, pipe.config, pipe.device)


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
