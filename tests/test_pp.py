"""pp_train.py: schedule orders, the timetable, deadlock freedom of the issued send/recv under NCCL's rendezvous
semantics, the live micro-batches of each schedule, gradients (incl. the tied weight) equal to the reference, live
activations measured around the executor against the script's figure, timeline and bubble, checkpoint, bad input."""
import gc
import hashlib
import json
import re
import statistics
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY, launch, read_metrics, spawn, the_one_error
from common.config import parse_args
from common.data import get_batch
from common.model import GPT, GPTConfig
from pp_train import (Pipeline, ScheduleReport, activation_bytes, add_pp_flags, messages, p2p_program, peak_live,
                      schedule_actions, timetable)


def F(i, c=0):
    return ("F", i, c)


def B(i, c=0):
    return ("B", i, c)


# ---- the schedules as pure functions ------------------------------------------------------

def test_1f1b_order_for_4_stages_and_6_microbatches():
    expected = {
        0: [F(0), F(1), F(2), F(3), B(0), F(4), B(1), F(5), B(2), B(3), B(4), B(5)],  # warm-up 3
        1: [F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2), F(5), B(3), B(4), B(5)],  # warm-up 2
        2: [F(0), F(1), B(0), F(2), B(1), F(3), B(2), F(4), B(3), F(5), B(4), B(5)],  # warm-up 1
        3: [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3), F(4), B(4), F(5), B(5)],  # no warm-up
    }
    for rank, actions in expected.items():
        assert schedule_actions("1f1b", rank, 4, 6) == actions
    # fewer micro-batches than stages: warm-up is cut at m
    assert schedule_actions("1f1b", 0, 4, 2) == [F(0), F(1), B(0), B(1)]


def test_gpipe_and_interleaved_orders():
    assert schedule_actions("gpipe", 1, 2, 3) == [F(0), F(1), F(2), B(0), B(1), B(2)]
    # Megatron's interleaved 1F1B, p=2, m=4, V=2: rank 0 warms up 2(p-1) + (V-1)p = 4 forwards, groups of
    # p micro-batches per chunk; backwards walk the chunks in reverse.
    assert schedule_actions("interleaved", 0, 2, 4, 2) == [
        F(0, 0), F(1, 0), F(0, 1), F(1, 1),
        F(2, 0), B(0, 1), F(3, 0), B(1, 1), F(2, 1), B(0, 0), F(3, 1), B(1, 0),
        B(2, 1), B(3, 1), B(2, 0), B(3, 0)]
    assert schedule_actions("interleaved", 1, 2, 4, 2)[:3] == [F(0, 0), F(1, 0), F(0, 1)]  # warm-up 2


class Deadlock(Exception):
    pass


def simulate(programs):
    """Runs every rank's issued p2p operations under NCCL's semantics and raises Deadlock if they can hang.
    programs[r]: rank r's issues in order, each (stream, ops, wait): ops posted together as one kernel on `stream`
    (one batch_isend_irecv, or one send/recv), each op (communicator, peer, is_send, message name); wait: the rank
    blocks until that kernel completes (a blocking recv, a waited batch) before issuing more; at its end a rank waits
    for all its kernels (e.g. isends never waited before). Rendezvous: a send completes only when its receive is
    posted, and vice versa; a kernel starts when the kernels before it on its stream have completed (NCCL runs one
    communicator's kernels in order) and completes when all its ops have; the k-th send on (sender, receiver,
    communicator) matches the k-th receive on it, which must name the same message."""
    n = len(programs)
    pc, blocked, streams, count, posted = [0] * n, [None] * n, {}, {}, {}
    while True:
        progress = False
        for r in range(n):  # each rank issues until it blocks
            while pc[r] < len(programs[r]) and (blocked[r] is None or blocked[r]["done"]):
                stream, ops, wait = programs[r][pc[r]]
                kernel = dict(ops=[], done=False)
                for comm, peer, is_send, name in ops:
                    channel = (comm, r, peer) if is_send else (comm, peer, r)
                    k = count[channel, is_send] = count.get((channel, is_send), -1) + 1
                    op = posted[channel, k, is_send] = dict(name=name, kernel=kernel, done=False)
                    kernel["ops"].append(op)
                streams.setdefault((r, stream), []).append(kernel)
                blocked[r], pc[r], progress = kernel if wait else blocked[r], pc[r] + 1, True
        started = [queue[0] for queue in streams.values() if queue]
        for (channel, k, is_send), op in posted.items():
            peer = posted.get((channel, k, not is_send))
            if not op["done"] and peer is not None and {id(op["kernel"]), id(peer["kernel"])} <= set(map(id, started)):
                assert op["name"] == peer["name"], f"{channel}: {op['name']} received as {peer['name']}"
                op["done"] = peer["done"] = progress = True
        for queue in streams.values():
            while queue and all(op["done"] for op in queue[0]["ops"]):
                queue.pop(0)["done"] = progress = True
        if all(pc[r] == len(programs[r]) for r in range(n)) and not any(streams.values()):
            return
        if not progress:
            raise Deadlock(f"ranks at issue {pc}, started: {[[op['name'] for op in k['ops']] for k in started]}")


def script_programs(schedule, p, m, V=1, forwards_only=False):
    """What pp_train.py issues: for each step of its timetable one batch_isend_irecv on its p2p group, waited."""
    every = [schedule_actions(schedule, r, p, m, V) for r in range(p)]
    every = [[a for a in actions if a[0] == "F" or not forwards_only] for actions in every]
    table = timetable(every, p * V)
    programs = [p2p_program(table, r, p * V) for r in range(p)]
    for r, program in enumerate(programs):  # the program runs exactly the rank's actions, each after its input came
        assert [a for a, _ in program if a is not None] == every[r]
        received = set()
        for action, exchange in program:
            need, send = messages(action, r, p, p * V) if action else (None, None)
            assert need is None or need[1] in received, (action, "runs before its input arrived")
            assert [(peer, name) for peer, is_send, name in exchange if is_send] == ([send] if send else [])
            received |= {name for _, is_send, name in exchange if not is_send}
    return [[("p2p", [("p2p", *op) for op in exchange], True) for _, exchange in program if exchange]
            for program in programs]


def unpaired_programs(schedule, p, m, V=1):
    """What pp_train.py issued before issue 15: a blocking recv before each action, its result sent with an isend
    waited only at the end, activations and gradients on a communicator each (NCCL: one per rank pair)."""
    programs = []
    for r in range(p):
        program = []
        for action in schedule_actions(schedule, r, p, m, V):
            need, send = messages(action, r, p, p * V)
            comm = "act" if action[0] == "F" else "grad"
            for (peer, name), is_send in [(need, False)] * bool(need) + [(send, True)] * bool(send):
                program.append(((comm, *sorted((r, peer))), [(comm, peer, is_send, name)], not is_send))
        programs.append(program)
    return programs


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_schedules_are_deadlock_free_with_bounded_live_microbatches(p):
    for m in range(1, 9):
        interleaved = [("interleaved", V) for V in (2, 3, 4) if p > 1 and m % p == 0]  # as check_pp_args requires
        for schedule, V in [("gpipe", 1), ("1f1b", 1)] + interleaved:
            lists = [schedule_actions(schedule, r, p, m, V) for r in range(p)]
            for actions in lists:  # every (micro-batch, chunk) once forward, once backward, F before B
                assert sorted(actions) == sorted([(op, i, c) for op in "FB" for i in range(m) for c in range(V)])
                assert all(actions.index(("F", i, c)) < actions.index(("B", i, c)) for _, i, c in actions)
            simulate(script_programs(schedule, p, m, V))  # training
            simulate(script_programs(schedule, p, m, V, forwards_only=True))  # evaluation
            peak = [peak_live(actions) for actions in lists]  # micro-batches between their F and B
            if schedule == "gpipe":
                assert peak == [m] * p
            elif schedule == "1f1b":
                assert peak == [min(p - r, m) for r in range(p)]  # <= p, whatever m is


def test_simulator_finds_the_send_send_deadlock_of_unpaired_p2p():
    # Interleaved at 2 ranks: rank 0 sends F0a, F1a to rank 1 and then waits for F0a's output back; rank 1 receives
    # F0a, computes, sends it back to rank 0. Both second sends are started on the one activation communicator of
    # the pair and each waits for a receive queued behind the other's send.
    with pytest.raises(Deadlock, match=r"\[\('F', 1, 0\)\], \[\('F', 0, 1\)\]"):
        simulate(unpaired_programs("interleaved", 2, 2, 2))
    for m in (2, 4, 8):
        with pytest.raises(Deadlock):
            simulate(unpaired_programs("interleaved", 2, m, 2))
    # ... while the same code was safe where no pair of ranks exchanges one kind of message both ways
    simulate(unpaired_programs("interleaved", 4, 8, 2))
    simulate(unpaired_programs("1f1b", 4, 8))


def test_timetable_lays_out_1f1b_as_the_textbook_figure():
    table = timetable([schedule_actions("1f1b", r, 4, 6) for r in range(4)], 4)
    drawn = [" ".join(f"{a[0]}{a[1]}" if a else ".." for a in row) for row in table]
    assert drawn == ["F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 .. B3 .. B4 .. B5",
                     ".. F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 .. B4 .. B5 ..",
                     ".. .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 .. B5 .. ..",
                     ".. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .. .. .."]


# ---- the executor on real ranks -----------------------------------------------------------

CONFIG = GPTConfig(block_size=16, vocab_size=50304, n_layer=4, n_head=2, n_embd=32)


class LiveSaved:
    """Counts the bytes autograd holds for backward while it holds them (parameters and their views
    excluded, once per storage): each saved tensor is packed into a Held object, which autograd drops
    when it frees it."""

    def __init__(self, params):
        self.params, self.refs, self.live, self.peak = {q.untyped_storage().data_ptr() for q in params}, {}, 0, 0

    def pack(self, t):
        return t if t.untyped_storage().data_ptr() in self.params else Held(self, t)

    def unpack(self, held):
        return held.t if isinstance(held, Held) else held


class Held:
    def __init__(self, meter, t):
        storage = t.untyped_storage()
        self.meter, self.t, self.key, self.nbytes = meter, t, storage.data_ptr(), storage.nbytes()
        if meter.refs.get(self.key, 0) == 0:
            meter.live += self.nbytes
            meter.peak = max(meter.peak, meter.live)
        meter.refs[self.key] = meter.refs.get(self.key, 0) + 1

    def __del__(self):
        self.meter.refs[self.key] -= 1
        if self.meter.refs[self.key] == 0:
            del self.meter.refs[self.key]
            self.meter.live -= self.nbytes


@contextmanager
def recording(issued):
    """Records every batch_isend_irecv call as [(peer, is_send) per op]."""
    real = torch.distributed.batch_isend_irecv

    def record(ops):
        issued.append([(op.peer, op.op is torch.distributed.isend) for op in ops])
        return real(ops)
    torch.distributed.batch_isend_irecv = record
    try:
        yield
    finally:
        torch.distributed.batch_isend_irecv = real


def _pipeline_grads(rank, p, cases):
    """For each (schedule, M, V): one batch through the pipeline on p ranks; returns this rank's
    gradients by name (tied gradient summed), the reference's, the loss, the measured live activations
    and the script's figures."""
    torch.manual_seed(0)
    x, y = get_batch("train", 0, 16, CONFIG.block_size, seed=0)
    reference = GPT(CONFIG, seed=0)
    _, ref_loss = reference(x, y)
    ref_loss.backward()
    ref_grads = {n: q.grad for n, q in reference.named_parameters()}
    out = []
    for schedule, m, V in cases:
        args = SimpleNamespace(schedule=schedule, n_microbatches=m, virtual_stages=V, seed=0, grad_accum_steps=1,
                               dtype="float32")
        model = Pipeline(CONFIG, args, torch.device("cpu"))
        named = model.named_parameters()
        meter, issued = LiveSaved([q for _, q in named]), []
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack), recording(issued):
            loss = model.forward_backward(x, y, sync=True)  # sync: the tied gradient summed
        gc.collect()
        with recording(issued):
            eval_loss = model.eval_loss(x, y)
        # what the executor issued: one batch per step that exchanges messages, exactly the program's
        programs = [[[(peer, is_send) for peer, is_send, _ in exchange] for _, exchange in program if exchange]
                    for program in (model.program, model.eval_program)]
        size = activation_bytes(model, 16 // m, CONFIG.block_size)
        max_diff = max((q.grad - ref_grads["transformer.wte.weight" if n == "lm_head.weight" else n]).abs().max().item()
                       for n, q in named)
        out.append(dict(case=(schedule, m, V), names={n for n, _ in named}, max_diff=max_diff, loss=loss.item(),
                        ref_loss=ref_loss.item(), live=meter.live, measured_peak_bytes=meter.peak,
                        peak=peak_live(model.actions), peak_bytes=peak_live(model.actions, lambda c: size[c]),
                        issued=issued, programs=programs[0] + programs[1], eval_loss=eval_loss.item(),
                        tied=next((hashlib.sha256(q.grad.numpy().tobytes()).hexdigest() for n, q in named
                                   if n in ("transformer.wte.weight", "lm_head.weight")), None)))
    return out


def owner(name, p, V):
    """The rank holding a GPT parameter: block i is in stage i // (layers per stage), wte/wpe in stage 0, ln_f and
    lm_head in the last; stage s is on rank s % p."""
    n_stages = p * V
    if name.startswith("transformer.h."):
        return int(name.split(".")[2]) // (CONFIG.n_layer // n_stages) % p
    return 0 if name.startswith(("transformer.wte", "transformer.wpe")) else (n_stages - 1) % p


def _check(results, p):
    every = [n for n, _ in GPT(CONFIG, device="meta").named_parameters(remove_duplicate=False)]  # lm_head too
    for rank, cases in enumerate(results):
        for r in cases:
            # this rank holds its stages' tensors and no other (the first and last stages' embeddings and head)
            assert r["names"] == {n for n in every if owner(n, p, r["case"][2]) == rank}, r["case"]
            assert r["max_diff"] <= 1e-6, r["case"]  # every gradient, the tied one included, equals the reference's
            assert r["live"] == 0, "every saved activation must be released by its backward"
            # the script's figure (one micro-batch's saved bytes per chunk x the schedule's live micro-batches)
            # against what autograd really held during the run
            assert abs(r["peak_bytes"] - r["measured_peak_bytes"]) <= 0.02 * r["measured_peak_bytes"], r
            assert r["issued"] == r["programs"], r["case"]  # every message goes through the program's batches
            if rank == p - 1:
                assert abs(r["loss"] - r["ref_loss"]) <= 1e-6 and abs(r["eval_loss"] - r["ref_loss"]) <= 1e-6
            schedule, m, V = r["case"]
            if schedule == "gpipe":
                assert r["peak"] == m
            elif schedule == "1f1b":
                assert r["peak"] == min(p - rank, m) <= p
    # the tied gradient: rank 0's wte and rank p-1's lm_head hold the same summed tensor, bit for bit (hashes:
    # a tensor returned through the spawn queue can outlive its sender's shared memory)
    for a, b in zip(results[0], results[p - 1]):
        assert a["tied"] == b["tied"]


def test_two_stages_gradients_tied_weight_and_live_activations():
    cases = [("gpipe", 4, 1), ("gpipe", 8, 1), ("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved", 4, 2)]
    results = spawn(_pipeline_grads, 2, cases)
    _check(results, 2)
    assert "transformer.wte.weight" in results[0][0]["names"] and "lm_head.weight" in results[1][0]["names"]
    assert "lm_head.weight" not in results[0][0]["names"]
    # activation bytes autograd keeps (parameters excluded), measured: 1F1B below GPipe at m=8 on the first stage
    gpipe8, onef8 = results[0][1], results[0][3]
    assert onef8["measured_peak_bytes"] < gpipe8["measured_peak_bytes"] / 2, (onef8, gpipe8)


def test_four_stages_1f1b():
    _check(spawn(_pipeline_grads, 4, [("1f1b", 8, 1), ("gpipe", 4, 1)]), 4)


# ---- the script end to end ----------------------------------------------------------------

SPANS = """import json, sys
sys.path.insert(0, {repo!r})
import pp_train
summary = pp_train.ScheduleReport.summary


def dump(report):  # rank 0 writes the spans of every step, as the report read them
    if report.model.rank == 0:
        json.dump(report.steps, open({path!r}, "w"))
    return summary(report)


pp_train.ScheduleReport.summary = dump
pp_train.main()
pp_train.teardown()
"""


def bubble_of(steps):
    """The measured bubble recomputed from the spans: per step the idle share of p ranks x the step's length (the
    last span's end), the median over steps; and each rank's median compute ms per step."""
    p, idle, busy = len(steps[0]), [], [[sum(t1 - t0 for _, t0, t1 in spans) for spans in step] for step in steps]
    for step, b in zip(steps, busy):
        end = max(t1 for spans in step for _, _, t1 in spans)
        idle.append(sum(end - x for x in b) / (p * end))
    return statistics.median(idle), [1000 * statistics.median(b[r] for b in busy) for r in range(p)]


def for_stage_times(S, m, V=1):
    """The schedule's bubble for stage times S: the slowest stage computes throughout; each other adds one
    micro-batch's (chunk's) share of its time to fill and drain the pipeline."""
    pipeline = max(S) + (sum(S) - max(S)) / (m * V)
    return 1 - sum(S) / len(S) / pipeline


def test_timeline_bubble_and_checkpoint_equal_the_reference(shared_run, tmp_path):
    flags = TINY + ["--max_iters", "3", "--checkpoint_interval", "2", "--schedule", "gpipe", "--print_schedule"]
    script = tmp_path / "pp_spans.py"
    script.write_text(SPANS.format(repo=str(Path(__file__).parent.parent), path=str(tmp_path / "spans.json")))
    result = launch(str(script), 2, flags + ["--out_dir", str(tmp_path / "pp")], torchrun=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "stage 0 (rank 0): wte, wpe, blocks 0-0" in out and "stage 1 (rank 1): blocks 1-1, ln_f, lm_head" in out
    assert re.search(r"rank 0 \|F.*B.*\|", out) and re.search(r"rank 1 \|.*F3.*B3.*\|", out)
    assert re.search(r"bubble: measured \d+\.\d% .* theory 20\.0% = \(p-1\)/\(m\+p-1\) with p=2, m=4\n", out)
    summary = read_metrics(tmp_path / "pp")[-1]
    assert summary["peak_live_microbatches_per_rank"] == [4, 4]
    assert all(b > 0 for b in summary["peak_activation_bytes_per_rank"])
    steps = json.load(open(tmp_path / "spans.json"))
    assert len(steps) == 3  # every step timed, and each rank's spans are its schedule's actions in order
    for step in steps:
        assert [[tuple(label) for label, _, _ in spans] for spans in step] == [
            schedule_actions("gpipe", r, 2, 4) for r in range(2)]
    bubble, S = bubble_of(steps)
    assert summary["bubble_measured"] == pytest.approx(bubble, rel=1e-12, abs=1e-15)
    assert summary["compute_ms_per_rank"] == pytest.approx(S, abs=0.0005)  # the summary keeps 3 decimals of ms
    assert summary["bubble_theory"] == 1 / 5  # (p-1)/(m+p-1)
    assert summary["bubble_for_stage_times"] == pytest.approx(for_stage_times(S, 4), rel=1e-12)

    ckpt = torch.load(tmp_path / "pp" / "ckpt.pt", weights_only=False)
    ref = torch.load(shared_run("ddp_train.py", None, TINY + ["--max_iters", "3"])[0] / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 3 and ckpt["config"] == ref["config"]
    assert list(ckpt["model"]) == list(ref["model"])  # GPT's keys, both tied ones, in order
    for k, v in ref["model"].items():
        assert torch.allclose(ckpt["model"][k], v, atol=1e-5), k
    assert set(ckpt["optimizer"]) == set(ref["optimizer"])
    for k, s in ref["optimizer"].items():
        assert ckpt["optimizer"][k]["step"] == s["step"]
        assert torch.allclose(ckpt["optimizer"][k]["exp_avg"], s["exp_avg"], atol=1e-6), k
    # round trip: both load strictly into a plain GPT, tied, and compute the same loss on a batch
    x, y = get_batch("val", 0, 8, ckpt["config"]["block_size"], seed=0)
    losses = []
    for state in (ckpt["model"], ref["model"]):
        model = GPT(GPTConfig(**ckpt["config"]), device="meta")
        model.load_state_dict(state, assign=True)
        model.tie_weights()
        assert model.lm_head.weight is model.transformer.wte.weight
        losses.append(model(x, y)[1].item())
    assert abs(losses[0] - losses[1]) <= 1e-5, losses  # the parity tolerance


def test_bubble_theory_and_report_for_interleaved(capsys):
    # 2 ranks, V=2, m=4; one step of 10 s in which rank 0 computed 8 s and rank 1 6 s: idle (2 + 4) / (2 * 10)
    args = SimpleNamespace(print_schedule=False, implementation="pytorch", virtual_stages=2)
    report = ScheduleReport(args, SimpleNamespace(pp_size=2, M=4, rank=0))
    report.steps = [[[(F(0), 0.0, 8.0)], [(F(0), 1.0, 4.0), (B(0), 7.0, 10.0)]]]
    run = report.summary()["run"]
    assert run["bubble_theory"] == 1 / 9  # (p-1)/(V*m+p-1) = 1/(2*4+1), not (p-1)/(m+p-1)/V = 1/10
    assert "theory 11.1% = (p-1)/(V*m+p-1) with p=2, m=4, V=2" in capsys.readouterr().out
    assert run["bubble_measured"] == pytest.approx(0.3, rel=1e-12)
    assert run["bubble_for_stage_times"] == pytest.approx(for_stage_times([8000, 6000], 4, 2), rel=1e-12)
    assert for_stage_times([8000, 6000], 4, 2) == pytest.approx(1 - 7 / 8.75)  # S: 8 s + 6 s / (m*V)
    assert for_stage_times([5, 5], 4, 2) == pytest.approx(1 / 9)  # equal stages: the theory


def test_print_schedule_is_a_bool_flag():
    def parsed(*flags):
        return parse_args("pp", add_pp_flags, list(flags)).print_schedule
    assert (parsed(), parsed("--print_schedule"), parsed("--print_schedule=true"),
            parsed("--print_schedule=false")) == (False, True, True, False)


BAD_INPUT = [
    (2, ["--n_layer", "3"], "--n_layer"),
    (2, ["--schedule", "interleaved"], "--n_layer"),  # 2 layers, 2 stages x 2 virtual stages
    (2, ["--n_microbatches", "3"], "--n_microbatches"),  # 8 rows
    (None, ["--virtual_stages", "2"], "--virtual_stages"),
    (None, ["--schedule", "bogus"], "--schedule"),
    (None, ["--print_schedule", "--implementation", "pytorch"], "--print_schedule: true is only supported by"),
]


@pytest.mark.parametrize("nproc,flags,named", BAD_INPUT, ids=[" ".join(f) + f"-{n or 1}r" for n, f, _ in BAD_INPUT])
def test_bad_input(nproc, flags, named, tmp_path):
    error = the_one_error("pp_train.py", nproc, TINY + ["--max_iters", "2", "--out_dir", str(tmp_path)] + flags)
    assert error.startswith(f"error: {named}") or f"argument {named}" in error, error
