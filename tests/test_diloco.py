"""ddp_diloco_train.py (DiLoCo): one replica with outer lr 1 and momentum 0 is plain training; at 2 and 4 ranks the run
equals a one-process simulation written here (each replica's rows of the same global batch in turn, each with its
own AdamW, the outer Nesterov step by hand): losses, grad norms, evaluations of θ_outer mid-window, and the final
checkpoint's θ_outer, momentum and every replica's AdamW state; H times fewer bytes than ddp's, counted step by step;
24 bytes a parameter of model state; bad flags, and a resume at another world size.
No launch of its own: the 2- and 4-rank runs ride tests/test_parity.py's launches (launch_group: diloco_runs), the
one-replica run its one-process launch, and the simulations run in that launch's shadow (one_process_references).
The 2-rank run is also the uninterrupted run of tests/test_reliability.py's resume sweep (conftest.CUT_FLAGS), which
resumes its cut at step 6 bit for bit and has ddp_train.py resume θ_outer from it."""
import functools
import json
import math
import os

import pytest
import torch
import torch.distributed as dist

from conftest import (CUT_FLAGS, PARITY, PARITY_EVAL_ITERS, PARITY_STEPS, TINY, cut_run_dir, paired, read_metrics,
                      refusal, run_record, worst)
from common.data import get_batch
from common.model import GPT, GPTConfig

SCRIPT = "ddp_diloco_train.py"
STEPS = PARITY_STEPS
FLAGS = PARITY + ["--max_iters", str(STEPS)]  # test_parity.py's FLAGS: its one-process reference's
TOL, NORM_TOL = 1e-5, 1e-6  # the parity tolerances (tests/test_parity.py)
# The final θ_outer, the outer momentum and each replica's AdamW moments against the simulation's, relative to
# each tensor's largest value: the same arithmetic, the grad norm summed in another order. AdamW turns a gradient
# that is only rounding (the attention's key bias: softmax ignores a shift of every key) into steps of +-lr whatever
# its bits, so a few such elements differ by up to 2.3e-4 (2 ranks) and 2.7e-4 (4 ranks) of their tensor's largest;
# the moments by at most 6e-7. Another replica's AdamW state in a replica's place differs by 1.2 or more.
STATE_TOL = 1e-3

# The runs at 2 and 4 ranks, in test_parity.py's launches: at 2, H = 3 over 15 steps and an evaluation every 4
# (step 4 is mid-window: θ_outer, not a replica's weights), the resume sweep's run (conftest.CUT_FLAGS); at 4, H = 3
# with accumulation and another momentum, over two outer steps (the momentum's first and a Nesterov step on it).
# (The one-replica run below ends on a partial window.)
DILOCO_RUNS = {2: [dict(inner_steps=3, eval_interval=4)],
               4: [dict(inner_steps=3, grad_accum_steps=2, outer_momentum=0.5, max_iters=6)]}


def diloco_args(settings):
    return FLAGS + ["--implementation", "custom"] + [x for k, v in settings.items() for x in (f"--{k}", str(v))]


def diloco_runs(nproc):
    """The args of each DiLoCo run at nproc ranks (tests/test_parity.py's launch_group adds them)."""
    return [diloco_args(settings) for settings in DILOCO_RUNS.get(nproc, [])]


def config():
    return GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True)


def adamw(model, lr=1e-3):
    """AdamW as common.model.configure_optimizer builds it: decay on tensors of 2 or more dims, fused."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


@functools.cache
def simulations():
    """simulate() of every run of DILOCO_RUNS, once: {(nproc, settings' items): its result}."""
    return {(nproc, tuple(settings.items())): simulate(nproc, **settings)
            for nproc, runs in DILOCO_RUNS.items() for settings in runs}


def simulate(nproc, inner_steps, outer_lr=0.7, outer_momentum=0.9, grad_accum_steps=1, eval_interval=STEPS,
             max_iters=STEPS, seed=1337, batch=8, block=32, lr_max=1e-3, lr_min=1e-4, warmup=5):
    """DiLoCo in one process, independent of the script: nproc replicas, each trained in turn on its rows of the
    global batch with its own AdamW, clipping its own gradient by its own norm; after every inner_steps steps and
    after the last, the outer Nesterov step on the replicas' mean pseudo-gradient, and every replica restarts from
    θ_outer. Returns run_record's dict (loss, norm: the replicas' means; evaluations of θ_outer), θ_outer and the
    momentum by name, and each replica's AdamW state by name."""
    replicas = [GPT(config(), seed=seed) for _ in range(nproc)]
    optimizers = [adamw(model) for model in replicas]
    names = [name for name, _ in replicas[0].named_parameters()]
    outer = [p.detach().clone() for p in replicas[0].parameters()]
    momentum = [torch.zeros_like(p) for p in outer]
    judge = GPT(config(), seed=seed)  # holds θ_outer to evaluate it
    record = dict(loss=[], grad_norm=[], eval=[])

    @torch.no_grad()
    def evaluate(step):
        for p, o in zip(judge.parameters(), outer):
            p.copy_(o)
        judge.eval()
        means = [sum(judge(*get_batch(split, i, batch, block, seed + 1))[1].item() for i in range(PARITY_EVAL_ITERS))
                 / PARITY_EVAL_ITERS for split in ("train", "val")]
        record["eval"].append((step, *means))

    accum = grad_accum_steps
    rows = batch // nproc
    micro = rows // accum
    for step in range(max_iters):
        if step % eval_interval == 0:
            evaluate(step)
        if step < warmup:
            lr = lr_max * (step + 1) / (warmup + 1)
        else:
            decay = (step - warmup) / (max_iters - warmup)
            lr = lr_min + 0.5 * (1 + math.cos(math.pi * decay)) * (lr_max - lr_min)
        x, y = get_batch("train", step, batch, block, seed)
        losses, norms = [], []
        for r, (model, optimizer) in enumerate(zip(replicas, optimizers)):
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = 0.0
            for j in range(accum):
                part = slice(r * rows + j * micro, r * rows + (j + 1) * micro)
                _, micro_loss = model(x[part], y[part])
                (micro_loss / accum).backward()
                loss += micro_loss.item() / accum
            params = list(model.parameters())
            norm = torch.stack([(p.grad * p.grad).sum() for p in params]).sum().sqrt()
            for p in params:
                p.grad.mul_((1.0 / (norm + 1e-6)).clamp(max=1.0))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss)
            norms.append(norm.item())
        record["loss"].append(sum(losses) / nproc)
        record["grad_norm"].append(sum(norms) / nproc)
        if (step + 1) % inner_steps == 0 or step + 1 == max_iters:
            with torch.no_grad():
                local = [list(model.parameters()) for model in replicas]
                for i, (o, m) in enumerate(zip(outer, momentum)):
                    delta = sum(o - params[i] for params in local) / nproc
                    m.mul_(outer_momentum).add_(delta)
                    o.sub_(outer_lr * (delta + outer_momentum * m))
                for params in local:
                    for p, o in zip(params, outer):
                        p.copy_(o)
    evaluate(max_iters)
    inner = [{name: optimizer.state[p] for name, p in zip(names, model.parameters())}
             for model, optimizer in zip(replicas, optimizers)]
    return record, dict(zip(names, outer)), dict(zip(names, momentum)), inner


def differences(run, ref):
    """The largest |dloss| (steps and evaluations, which must be at the same steps) and relative dnorm."""
    assert [e[0] for e in run["eval"]] == [e[0] for e in ref["eval"]], (run["eval"], ref["eval"])
    losses = paired(run["loss"], ref["loss"], "loss")
    losses += paired([v for e in run["eval"] for v in e[1:]], [v for e in ref["eval"] for v in e[1:]], "evaluations")
    norms = paired(run["grad_norm"], ref["grad_norm"], "grad_norm")
    return worst(abs(a - b) for a, b in losses), worst(abs(a - b) / abs(b) for a, b in norms)


def state_bytes(args):
    """24 bytes a parameter (fp32 params, grads, AdamW's two moments, θ_outer, its momentum) and AdamW's fp32 step,
    4 bytes a tensor, as ddp's 16 + 4 a tensor (tests/test_ddp.py)."""
    params = list(GPT(config(), device="meta").parameters())
    return 24 * sum(p.numel() for p in params) + 4 * len(params)


def one_replica_run():
    """(script, args) of the one-replica run below: it rides tests/test_parity.py's one-process launch."""
    return SCRIPT, FLAGS + ["--inner_steps", "4", "--outer_lr", "1", "--outer_momentum", "0"]


def test_one_replica_with_outer_lr_1_and_no_momentum_is_plain_training(references, shared_run):
    """θ_outer − 1·(θ_outer − θ_local) is θ_local up to rounding: one replica at outer lr 1 and momentum 0 is one
    process's AdamW training (ddp_train.py's, test_parity.py's reference), H = 4 over 15 steps (a last window of
    3): every loss, grad norm and evaluation. An outer step that summed θ_outer + Δ, stepped the wrong way or reset
    AdamW's state fails here; and the model state is 24 bytes a parameter."""
    reference, _ = references()  # its launch runs this one too
    _, args = one_replica_run()
    out_dir, _ = shared_run(SCRIPT, None, args)
    run = run_record(out_dir)
    assert len(run["loss"]) == STEPS and [e[0] for e in run["eval"]] == [0, STEPS]
    dloss, dnorm = differences(run, reference)
    print(f"one replica vs one process: max |dloss| {dloss:.2e}, max rel dnorm {dnorm:.2e}")
    assert dloss <= TOL and dnorm <= NORM_TOL
    assert read_metrics(out_dir)[-1]["model_state_bytes_per_rank"] == [state_bytes(args)]


@pytest.mark.parametrize("nproc", sorted(DILOCO_RUNS))
def test_replicas_equal_a_one_process_simulation(nproc, references, shared_run):
    """2 and 4 ranks against simulate(): each step's loss and grad norm (the replicas' means), the evaluations of
    θ_outer (at 2 ranks also mid-window, at step 4), and the checkpoint at the end: θ_outer as the model, the outer
    momentum and each replica's own AdamW state; the model state is 24 bytes a parameter on every rank."""
    from test_parity import launch_group
    references()  # its launch's thread runs the simulations
    shared_run.batch(nproc, launch_group(nproc))
    for settings in DILOCO_RUNS[nproc]:
        args = diloco_args(settings)
        out_dir, _ = shared_run(SCRIPT, nproc, args)
        run = run_record(out_dir)
        ref, outer, momentum, inner = simulations()[(nproc, tuple(settings.items()))]
        steps, every = settings.get("max_iters", STEPS), settings.get("eval_interval", STEPS)
        assert len(run["loss"]) == steps, run
        assert [e[0] for e in run["eval"]] == sorted({*range(0, steps, every), steps}), run["eval"]
        dloss, dnorm = differences(run, ref)
        ckpt = torch.load(out_dir / "ckpt.pt", weights_only=True)
        pairs = [(ckpt["model"][name], outer[name]) for name in outer]
        pairs += [(ckpt["optimizer"]["diloco"]["outer_momentum"][name], momentum[name]) for name in momentum]
        assert len(ckpt["optimizer"]["diloco"]["inner"]) == nproc
        pairs += [(mine[name][key], theirs[name][key]) for mine, theirs in zip(ckpt["optimizer"]["diloco"]["inner"],
                                                                               inner)
                  for name in theirs for key in ("exp_avg", "exp_avg_sq")]
        dstate = worst(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
        print(f"DiLoCo at {nproc} ranks {' '.join(args[len(FLAGS):])} vs the simulation: max |dloss| {dloss:.2e}, "
              f"max rel dnorm {dnorm:.2e}, max rel dstate {dstate:.2e}")
        assert dloss <= TOL and dnorm <= NORM_TOL and dstate <= STATE_TOL
        assert ckpt["step"] == steps and all(ckpt["model"][n].shape == outer[n].shape for n in outer)
        assert read_metrics(out_dir)[-1]["model_state_bytes_per_rank"] == [state_bytes(args)] * nproc


def test_the_2_rank_run_is_the_resume_sweeps_uninterrupted_run():
    """tests/test_reliability.py compares its resume of the cut run with this run: the same flags, or a launch more."""
    assert diloco_runs(2) == [FLAGS + ["--implementation", "custom"] + CUT_FLAGS[SCRIPT]]


DDP_ROW = FLAGS + ["--implementation", "custom", "--grad_accum_steps", "2"]  # a 2-rank parity row of ddp_train.py


def test_each_step_sends_h_times_fewer_parameter_bytes_than_ddp(shared_run):
    """Counted on every rank, step by step (tests/runs.py: each step's bytes from the second on, the logged scalars'
    AVG all-reduces aside): the 2-rank DiLoCo run all-reduces the 4P pseudo-gradient bytes at the end of every H-th
    step and nothing in the steps between; ddp_train.py's parity row all-reduces its 4P gradient bytes every step
    (once, accumulating over 2 micro-steps): H times DiLoCo's over a window. A DiLoCo that all-reduced every step,
    or in the wrong step, fails here."""
    from test_parity import launch_group
    [settings], [args] = DILOCO_RUNS[2], diloco_runs(2)
    H = settings["inner_steps"]
    P = sum(p.numel() for p in GPT(config(), device="meta").parameters())
    shared_run.batch(2, launch_group(2))
    ddp_dir, diloco_dir = shared_run("ddp_train.py", 2, DDP_ROW)[0], shared_run(SCRIPT, 2, args)[0]
    parameters = {"all_reduce@0,1": 4 * P}  # the gradients' (ddp) or the pseudo-gradient's (DiLoCo) one all-reduce
    for rank in range(2):
        ddp, diloco = (json.load(open(os.path.join(d, f"comm_steps_rank{rank}.json"))) for d in (ddp_dir, diloco_dir))
        assert ddp == [parameters] * (STEPS - 1), ddp  # steps 1..14
        assert diloco == [parameters if (step + 1) % H == 0 else {} for step in range(1, STEPS)], diloco
        window = [sum(d.get("all_reduce@0,1", 0) for d in steps[H - 1:2 * H - 1]) for steps in (ddp, diloco)]
        assert window == [H * 4 * P, 4 * P], window  # steps H..2H-1: the second window
    print(f"parameter-sized bytes a step: ddp {4 * P:,}, DiLoCo {4 * P / H:,.0f} (H = {H})")


BAD_INPUT = [  # (flags, ranks, what the one error line names)
    (["--inner_steps", "0"], None, "--inner_steps: must be >= 1"),
    (["--outer_lr", "0"], None, "--outer_lr: must be > 0"),
    (["--outer_lr", "nan"], None, "--outer_lr: must be > 0"),
    (["--outer_momentum", "1"], None, "--outer_momentum: must be in [0, 1)"),
    (["--outer_momentum", "-0.1"], None, "--outer_momentum: must be in [0, 1)"),
    (["--inner_steps", "4", "--checkpoint_interval", "6"], None, "--checkpoint_interval: must be a multiple"),
    (["--implementation", "pytorch"], 2, "--implementation: custom only; torch has no DiLoCo"),
    (["--bucket_cap_mb", "25"], None, "--bucket_cap_mb"),  # no buckets: DDP's flag is unknown here
    (["--batch_size", "6"], 4, "--batch_size"),
]


@pytest.mark.parametrize("flags,nproc,named", BAD_INPUT, ids=[" ".join(f) for f, _, _ in BAD_INPUT])
def test_bad_input(flags, nproc, named, tmp_path, monkeypatch, capsys):
    assert named in refusal(SCRIPT, nproc, TINY + ["--max_iters", "2", "--out_dir", str(tmp_path)] + flags,
                            monkeypatch, capsys)


def test_resume_at_another_world_size_is_one_line(shared_run, capsys):
    """A DiLoCo checkpoint holds each replica's AdamW state: resumed at another world size, one error line (the
    2-rank cut run's checkpoint, conftest.cut_run_dir's, loaded by the strategy of a one-rank run, in this process)."""
    import ddp_diloco_train
    from common.config import gpt_config, parse_args
    ckpt = torch.load(cut_run_dir(shared_run, SCRIPT, "custom") / "ckpt.pt", weights_only=False)
    args = parse_args("ddp", ddp_diloco_train.add_ddp_flags, TINY)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = ddp_diloco_train.DiLoCo(gpt_config(args), args, torch.device("cpu"), ckpt["model"])
        with pytest.raises(SystemExit) as stop:
            model.configure_optimizer(args, ckpt["optimizer"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("error: --resume: the checkpoint holds 2 DiLoCo replicas, this run has 1"), errors
