"""Checkpoints, resume, faults, multi-node and determinism, for every script and both implementations.

- resume: 6 steps, then resume to 15, equals 15 uninterrupted steps bit for bit (fp32, CPU), for
  every script;
- every script's checkpoint at step 6, custom and PyTorch's, is the same full state as ddp's;
- resume puts AdamW's step where torch's own load_state_dict does for the optimizer built (fused: on the
  parameter's device, the meta device standing in for the GPU);
- cross-strategy resume: a full checkpoint from one script continues in another and matches the
  single-process reference within the parity tolerance; PyTorch's implementations (cp's needs CUDA)
  save the checkpoint and resume from it;
- a rank SIGKILLed under torchrun --max-restarts=1: the job restarts, resumes, same final loss;
- a crash without restarts: every other rank exits within the collective timeout;
- two "nodes" on loopback give the 2-rank single-node losses, bit for bit (identical runs give identical
  losses; with dropout: tests/test_tp.py's resume, whose cut run repeats the uninterrupted run's first steps);
- corrupt or truncated checkpoints: one clear error, nothing overwritten; sample.py;
- a sweep of bad flags over every script: non-zero exit, one error line, under 30 s.
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import (CUT, CUT_FLAGS, CUT_SCRIPTS, PARITY, PARITY_STEPS, REPO, cut_run_dir, free_port, launch, paired,
                      peer_needs, read_metrics, refusal, runs_here, step_losses, the_one_error, worst)
from common.checkpoint import set_adamw_state
from common.model import configure_optimizer

SCRIPTS = CUT_SCRIPTS  # tier 1, then tier 2: each copy resumed as its base is, at its defaults
TORCH_ON_CPU = SCRIPTS[:5]  # cp's PyTorch implementation needs CUDA SDPA kernels (tests/test_cp.py)
# The parity config (so that the uninterrupted runs and the reference are test_parity.py's own runs,
# shared through the shared_run fixture). --lr_decay_iters pins the schedule, so a run with fewer
# --max_iters is a prefix of the longer one.
STEPS = PARITY_STEPS
FLAGS = PARITY + ["--lr_decay_iters", str(STEPS)]
TOL = 1e-5  # the parity tolerance (tests/test_parity.py)


def run(script, nproc, args, out_dir, timeout=300):
    result = launch(script, nproc, FLAGS + list(args) + ["--out_dir", str(out_dir)], timeout=timeout, torchrun=False)
    assert result.returncode == 0, f"{script} {args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def by_step(out_dir):
    """{step: loss} from metrics.jsonl (a resumed run appends; a step logged twice keeps the last)."""
    return {r["step"]: r["loss"] for r in read_metrics(out_dir) if "loss" in r}


def uninterrupted(shared_run, script, nproc, implementation="custom"):
    """The losses of test_parity.py's run of this script (the same flags, so the same run)."""
    args = PARITY + ["--max_iters", str(STEPS)] + ([] if nproc is None else ["--implementation", implementation])
    args += CUT_FLAGS.get(script, []) if nproc is not None else []
    return step_losses(shared_run(script, nproc, args)[0])


@pytest.fixture(scope="module")
def reference(shared_run):
    return uninterrupted(shared_run, "ddp_train.py", None)


def cut_run(shared_run, script, implementation, out):
    """Copies into `out` the run of CUT steps of this script at 2 ranks (one run per session, shared by the
    resume and cross-strategy tests): its checkpoint at step CUT and the metrics of steps 0..CUT-1."""
    shutil.copytree(cut_run_dir(shared_run, script, implementation), out, dirs_exist_ok=True)
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == CUT


@pytest.fixture(scope="module")
def resumed(shared_run, tmp_path_factory):
    """Every resume below in one launch of tests/runs.py at 2 ranks: each (first, implementation, second,
    implementation) continues a copy of first's cut run in second to STEPS. Returns {key: out_dir} and the launch's
    result; a run's "resuming from" line names its own out_dir."""
    jobs = [(s, "custom", s, "custom") for s in SCRIPTS] + [(f, impl(f), s, impl(s)) for f, s in CROSS]
    jobs = [job for job in jobs if runs_here(*job[:2]) and runs_here(*job[2:])] + [THETA_OUTER]
    out_dirs, argv = {}, []
    for job in jobs:
        first, first_impl, second, second_impl = job
        out = out_dirs[job] = tmp_path_factory.mktemp("resume")
        cut_run(shared_run, first, first_impl, out)
        argv += [second, *FLAGS, "--implementation", second_impl, "--max_iters", str(STEPS), "--resume",
                 *CUT_FLAGS.get(second, []), *(["--eval_interval", str(CUT)] if job == THETA_OUTER else []),
                 "--out_dir", str(out), "---"]
    result = launch("tests/runs.py", 2, argv[:-1], timeout=60 + 30 * len(jobs), torchrun=False)
    assert result.returncode == 0, f"failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return out_dirs, result


def _cut_and_resume(resumed, script, implementation):
    """CUT steps, then --resume to STEPS in the same out_dir; returns the logged losses by step."""
    out_dirs, result = resumed
    out = out_dirs[(script, implementation, script, implementation)]
    assert f"resuming from {out / 'ckpt.pt'} at step {CUT}" in result.stdout
    losses = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in losses] == list(range(STEPS))  # the lines before CUT kept, each step once
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == STEPS
    return [r["loss"] for r in losses]


@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_is_bit_identical(script, shared_run, resumed):
    assert _cut_and_resume(resumed, script, "custom") == uninterrupted(shared_run, script, 2)


# ddp_train.py continuing ddp_diloco_train.py's cut run, evaluating before its first step: a DiLoCo checkpoint's model
# is θ_outer (every replica's weights at an outer step), which every script resumes as a plain run's.
THETA_OUTER = ("ddp_diloco_train.py", "custom", "ddp_train.py", "custom")


def test_ddp_resumes_diloco_at_theta_outer(shared_run, resumed):
    """ddp_train.py's evaluation at the cut (step 6, before its first step) is the DiLoCo cut run's own evaluation at
    its end, of θ_outer: the same losses, bit for bit; then it trains on to the end."""
    out_dirs, result = resumed
    out = out_dirs[THETA_OUTER]
    assert f"resuming from {out / 'ckpt.pt'} at step {CUT}" in result.stdout
    evals = [r for r in read_metrics(out) if "val_loss" in r]
    cut = [r for r in read_metrics(cut_run_dir(shared_run, *THETA_OUTER[:2])) if "val_loss" in r]
    assert cut[-1]["step"] == CUT and [r["step"] for r in evals if r["step"] >= CUT] == [CUT, 12, STEPS], evals
    [at_cut] = [r for r in evals if r["step"] == CUT]
    assert (at_cut["train_loss"], at_cut["val_loss"]) == (cut[-1]["train_loss"], cut[-1]["val_loss"]), (at_cut, cut)
    assert sorted(by_step(out)) == list(range(STEPS))


def impl(script):
    """PyTorch's implementation where it runs on CPU (cp's needs CUDA), else the hand-written one."""
    return "pytorch" if script in TORCH_ON_CPU else "custom"


# One launch each: a cut run of `first` continued by `second`, each in PyTorch's implementation where it runs on
# CPU, so every peer both writes a checkpoint that another script continues and continues one. (The hand-written
# ones: every script resumes its own checkpoint above, and test_every_cut_checkpoint_is_the_same_full_state
# checks that each one writes the same full state.)
CROSS = [("fsdp_train.py", "tp_train.py"), ("ddp_train.py", "pp_train.py"), ("zero3_train.py", "cp_train.py"),
         ("tp_train.py", "zero3_train.py"), ("pp_train.py", "ddp_train.py"), ("cp_train.py", "fsdp_train.py")]


@pytest.mark.parametrize("first,second", [pytest.param(f, s, marks=peer_needs(f, impl(f)) + peer_needs(s, impl(s)))
                                          for f, s in CROSS])
def test_cross_strategy_resume_matches_the_reference(first, second, resumed, reference):
    out_dirs, result = resumed
    out = out_dirs[(first, impl(first), second, impl(second))]
    assert f"resuming from {out / 'ckpt.pt'} at step {CUT}" in result.stdout
    got = by_step(out)
    assert sorted(got) == list(range(STEPS))
    delta = worst(abs(a - b) for a, b in paired([got[s] for s in range(STEPS)], reference, "losses"))
    print(f"{first} {impl(first)} -> {second} {impl(second)}: max |dloss| vs the reference over {STEPS} steps = "
          f"{delta:.2e}")
    assert delta <= TOL


# The step-6 states of two correct runs differ by float reordering, which AdamW amplifies where a gradient is
# near 0 (the update is m / sqrt(v), about +-lr whatever g): measured up to 5e-4 of a tensor's largest value
# (tp, cp), 8e-6 in AdamW's moments. A wrong layout (a shard out of place, a transposed or tied tensor, another
# rank's rows) differs by O(1).
STATE_TOL = 1e-2


@pytest.mark.parametrize("script,implementation",
                         [pytest.param(s, i, marks=peer_needs(s, i)) for s in SCRIPTS for i in ("custom", "pytorch")
                          if (s, i) != ("ddp_train.py", "custom") and (i == "custom" or s in TORCH_ON_CPU)
                          and s != "ddp_diloco_train.py"])  # its own state: θ_outer, each replica's AdamW
def test_every_cut_checkpoint_is_the_same_full_state(script, implementation, shared_run):
    """The checkpoints the resume tests continue (no launch of its own, read where they were written), against
    ddp's: the same step, model keys and shapes, AdamW state per parameter name, and values within STATE_TOL of
    each tensor's largest."""
    ref, got = (torch.load(cut_run_dir(shared_run, s, i) / "ckpt.pt", weights_only=False)
                for s, i in (("ddp_train.py", "custom"), (script, implementation)))
    assert got["step"] == ref["step"] == CUT and got["config"] == ref["config"]
    assert {k: v.shape for k, v in got["model"].items()} == {k: v.shape for k, v in ref["model"].items()}
    assert {n: sorted(st) for n, st in got["optimizer"].items()} == {n: sorted(st) for n, st in ref["optimizer"].items()}
    pairs = [(got["model"][k], v) for k, v in ref["model"].items()]
    pairs += [(got["optimizer"][n][k], v) for n, st in ref["optimizer"].items() for k, v in st.items()]
    for a, b in pairs:
        assert a.dtype == b.dtype and a.device.type == b.device.type == "cpu"
        assert (a - b).abs().max() <= STATE_TOL * b.abs().max()


# AdamW's `step` on resume. Every resume puts the optimizer state in by hand (set_adamw_state), and must put `step`
# where torch's own AdamW.load_state_dict does for the same optimizer: a fused or capturable AdamW reads it on the
# parameter's device as float32 (the fused CUDA kernel dereferences it there, and nothing checks that it is), any
# other on the CPU, as saved. The meta device stands in for the GPU.
ADAMWS = {
    "the scripts'": lambda params: configure_optimizer(params, 0.1, 1e-3, (0.9, 0.95)),  # fused (FUSED_ADAMW)
    "fused": lambda params: torch.optim.AdamW([p for _, p in params], fused=True),
    "capturable": lambda params: torch.optim.AdamW([p for _, p in params], capturable=True),
    "for-loop": lambda params: torch.optim.AdamW([p for _, p in params], foreach=False),
}


def _adamw_states(adamw, device, make_param=torch.nn.Parameter):
    """(the state set_adamw_state puts in, the one torch's load_state_dict puts in) for two parameters (a weight,
    decayed, and a bias, not: two groups in the scripts' AdamW) on `device`, from a checkpoint's CPU state with a
    float32 and a float64 step."""
    shapes = {"weight": (4, 3), "bias": (4,)}
    saved = {name: {"step": torch.tensor(6.0, dtype=torch.float32 if name == "weight" else torch.float64),
                    "exp_avg": torch.randn(shape), "exp_avg_sq": torch.rand(shape)} for name, shape in shapes.items()}
    ours, theirs = ([(n, make_param(torch.zeros(s, device=device))) for n, s in shapes.items()] for _ in range(2))
    optimizer = ADAMWS[adamw](ours)
    for name, p in ours:
        set_adamw_state(optimizer, p, saved[name], lambda full, p=p: full.to(p.device, copy=True))
    reference = ADAMWS[adamw](theirs)
    names = {id(p): name for name, p in theirs}
    in_order = [names[id(p)] for group in reference.param_groups for p in group["params"]]  # state_dict's ids
    reference.load_state_dict({"state": {i: saved[name] for i, name in enumerate(in_order)},
                               "param_groups": reference.state_dict()["param_groups"]})
    return [optimizer.state[p] for _, p in ours], [reference.state[p] for _, p in theirs], saved


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("adamw", ADAMWS)
def test_resume_puts_adamw_step_where_torch_load_state_dict_does(adamw, device):
    """set_adamw_state, which every script's resume calls (--resume, --resume_from, a torchrun restart and fsdp's
    --resume_sharded), against torch's AdamW.load_state_dict for the same optimizer: each state tensor a plain
    tensor of the same device and dtype, and on the CPU the same value (the fused float32 step keeps its bits, so
    a CPU resume is unchanged), copied, not the checkpoint's own tensor."""
    ours, theirs, saved = _adamw_states(adamw, device)
    for mine, torchs, name in zip(ours, theirs, ("weight", "bias")):
        assert list(mine) == list(torchs) == ["step", "exp_avg", "exp_avg_sq"]
        for key in mine:
            assert type(mine[key]) is torch.Tensor and mine[key] is not saved[name][key]
            assert (mine[key].device, mine[key].dtype) == (torchs[key].device, torchs[key].dtype), (name, key)
            assert device == "meta" or torch.equal(mine[key], torchs[key])
        fused_or_capturable = adamw != "for-loop"
        assert mine["step"].device == torch.device(device if fused_or_capturable else "cpu"), mine["step"].device


def test_resume_puts_a_dtensor_parameters_adamw_step_on_its_local_device_as_a_plain_tensor():
    """PyTorch's fsdp and hybrid peers resume DTensor parameters: a fused AdamW's step goes to the local tensor's
    device (meta here, with a meta local tensor on a one-rank CPU mesh), as a plain tensor, as torch's
    load_state_dict puts it; a for-loop AdamW's stays on the CPU."""
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def as_dtensor(local):
            return torch.nn.Parameter(DTensor.from_local(local, mesh, [Replicate()], run_check=False))
        for adamw, device in (("the scripts'", "meta"), ("for-loop", "cpu")):
            ours, theirs, _ = _adamw_states(adamw, "meta", as_dtensor)
            for mine, torchs in zip(ours, theirs):
                assert type(mine["step"]) is type(torchs["step"]) is torch.Tensor
                assert mine["step"].device == torchs["step"].device == torch.device(device)
                assert mine["step"].dtype == torchs["step"].dtype
    finally:
        dist.destroy_process_group()


def _pids_of_rank(out_dir, rank):
    """The pids of worker processes of this test's run (its out_dir on the command line) with RANK=rank."""
    pids = []
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            cmdline = open(f"{proc}/cmdline", "rb").read().split(b"\0")
            environ = open(f"{proc}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if str(out_dir).encode() in cmdline and f"RANK={rank}".encode() in environ and b"-m" not in cmdline:
            pids.append(int(proc.rsplit("/", 1)[1]))
    return pids


def _start(script, nproc, args, out_dir, torchrun_flags=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *torchrun_flags, script, *FLAGS, *args, "--out_dir", str(out_dir)]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill_all(proc):
    """Whatever happened, leave no launcher or worker behind (they are in proc's session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _signal_rank_after(out_dir, rank, step, proc, sig=signal.SIGKILL, deadline_s=120):
    """Send `sig` to `rank` once metrics.jsonl shows `step` was logged; returns the time."""
    t0 = time.time()
    while time.time() - t0 < deadline_s and proc.poll() is None:
        path = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(path) and any(r.get("step", -1) >= step and "loss" in r for r in read_metrics(out_dir)):
            pids = _pids_of_rank(out_dir, rank)
            assert pids, "the rank to kill was not found"
            for pid in pids:
                os.kill(pid, sig)
            return time.time()
        time.sleep(0.05)
    raise AssertionError(f"step {step} never logged:\n{proc.communicate()[0][-3000:]}")


def test_killed_rank_restarts_resumes_and_finishes_with_the_same_loss(shared_run, tmp_path):
    """The restarted job's losses equal test_parity.py's uninterrupted run of the same flags, bit for bit
    (--checkpoint_interval changes no number)."""
    faulty = tmp_path / "faulty"
    args = ["--max_iters", str(STEPS), "--checkpoint_interval", "4"]
    proc = _start("fsdp_train.py", 2, args, faulty, ["--max-restarts=1"])
    try:
        _signal_rank_after(faulty, 1, 9, proc)
        out, _ = proc.communicate(timeout=300)
    finally:
        _kill_all(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "resuming from" in out and "at step 8" in out
    whole = uninterrupted(shared_run, "fsdp_train.py", 2)
    assert by_step(faulty) == dict(enumerate(whole))
    assert step_losses(faulty)[-1] == whole[-1]


def test_crash_without_restart_ends_every_rank_within_the_timeout(tmp_path):
    proc = _start("ddp_train.py", 2, ["--max_iters", "100000", "--timeout_s", "20"], tmp_path)
    try:
        killed_at = _signal_rank_after(tmp_path, 1, 2, proc)
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("the surviving rank did not exit within 60 s of the crash")
    finally:
        _kill_all(proc)
    print(f"every rank gone {time.time() - killed_at:.1f} s after SIGKILL of rank 1")
    assert proc.returncode != 0
    assert _pids_of_rank(tmp_path, 0) == []


def test_a_hung_peer_is_bounded_by_timeout_s(tmp_path):
    """No launcher to clean up, and a peer that hangs (SIGSTOP) instead of dying, so its sockets
    stay open: rank 0 must give up on its own once the collective waits longer than --timeout_s."""
    port, timeout_s = free_port(), 6
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, "ddp_train.py", *FLAGS, "--max_iters", "100000",
                                       "--timeout_s", str(timeout_s), "--out_dir", str(tmp_path)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    try:
        _signal_rank_after(tmp_path, 1, 2, procs[0], signal.SIGSTOP)
        t0 = time.time()
        try:
            out, _ = procs[0].communicate(timeout=timeout_s + 50)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank 0 still waits {timeout_s + 50} s after rank 1 hung")
        print(f"rank 0 exited {time.time() - t0:.1f} s after rank 1 hung (--timeout_s {timeout_s})")
        assert procs[0].returncode != 0
    finally:
        for p in procs:
            _kill_all(p)


def test_two_nodes_with_their_own_checkouts_equal_one_node(shared_run, tmp_path):
    """docs/running.md's multi-node recipe with nothing shared but the out_dir: node 1 runs from a second
    checkout holding only the text (the offline recipe), nothing tokenised, under static rendezvous
    (--master_addr/--master_port). Its local rank 0 must tokenise its own copy; the losses equal one
    node's with 2 ranks."""
    second = tmp_path / "node1"
    shutil.copytree(REPO, second, ignore=shutil.ignore_patterns(".git", "data", "out", "runs", "__pycache__", ".*"))
    (second / "data" / "shakespeare").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "data", "shakespeare", "input.txt"), second / "data" / "shakespeare")
    port, nodes = free_port(), []
    for node_rank, checkout in ((0, REPO), (1, second)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}",
               "ddp_train.py", *PARITY, "--max_iters", str(STEPS), "--out_dir", str(tmp_path / "two")]
        # Both "nodes" share this machine's cores as the 2 local ranks of one node do.
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        nodes.append(subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    try:
        outs = [p.communicate(timeout=300)[0] for p in nodes]
    finally:
        for p in nodes:
            _kill_all(p)
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-2000:] for o in outs)
    assert sorted(os.listdir(second / "data" / "shakespeare")) == ["input.txt", "meta.json", "train.bin", "val.bin"]
    two, single = step_losses(tmp_path / "two"), uninterrupted(shared_run, "ddp_train.py", 2)
    print(f"two nodes vs one node: max |dloss| = {max(abs(a - b) for a, b in zip(two, single)):.2e}")
    assert two == single


def test_data_wait_is_not_bounded_by_timeout_s(tmp_path, monkeypatch):
    """Tokenising may take longer than --timeout_s (a step's collective bound): the other ranks wait
    for it (here tokenising is slowed to 6 s with --timeout_s 3) and the run finishes."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import time\nimport common.data as d\nslow = d.prepare\n"
        "d.prepare = lambda *a: (time.sleep(6) if __import__('os').environ.get('RANK') == '0' else None) or slow(*a)\n")
    monkeypatch.setenv("PYTHONPATH", f"{hook}{os.pathsep}{REPO}")
    run("ddp_train.py", 2, ["--max_iters", "1", "--timeout_s", "3"], tmp_path / "out")


def test_a_preparation_past_prepare_timeout_ends_every_rank_with_one_line(tmp_path, monkeypatch):
    """The data wait polls over the default group (no gloo group of its own): past PREPARE_TIMEOUT (here 2 s,
    rank 0 tokenising for 30 s) every rank ends with one line, within --timeout_s of it."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\nfrom datetime import timedelta\nimport common.data as d\nimport common.distributed\n"
        "common.distributed.PREPARE_TIMEOUT = timedelta(seconds=2)\nslow = d.prepare\n"
        "d.prepare = lambda *a: (time.sleep(30) if os.environ.get('RANK') == '0' else None) or slow(*a)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{REPO}")
    assert the_one_error("ddp_train.py", 2, ["--max_iters", "1", "--timeout_s", "3", "--out_dir",
                                             str(tmp_path / "out")]) == (
        "error: --dataset shakespeare: preparing the data took more than 0:00:02 (common.distributed.PREPARE_TIMEOUT)")


def test_resume_on_nodes_whose_out_dirs_differ_is_one_clear_error(shared_run, tmp_path, monkeypatch):
    """Two "nodes" of one rank each, run from their own folders with the same --out_dir out: node 0's holds
    the checkpoint, node 1's nothing (out_dir not shared). Every rank must end with one line naming the path,
    not resume on one node and start fresh on the other (which then hung in a collective)."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    cut_run(shared_run, "ddp_train.py", "custom", nodes[0] / "out")
    nodes[1].mkdir()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(  # each rank in its node's folder, as the only rank of its node
        "import os\nrank = os.environ.get('RANK')\nif rank is not None:\n"
        f"    os.chdir(os.path.join({str(tmp_path)!r}, 'node' + rank))\n"
        "    os.environ.update(GROUP_RANK=rank, LOCAL_RANK='0', LOCAL_WORLD_SIZE='1')\n")
    monkeypatch.setenv("PYTHONPATH", str(hook))
    error = the_one_error(os.path.join(REPO, "ddp_train.py"), 2, FLAGS + ["--max_iters", str(STEPS), "--resume",
                                                                          "--out_dir", "out"])
    assert error.startswith("error: --resume: out/ckpt.pt is not visible from node 1 (host "), error
    assert "out_dir must be on a shared filesystem, or pass --resume_from" in error


def test_device_auto_with_more_local_ranks_than_gpus_is_one_clear_error(tmp_path, monkeypatch):
    """The quick start's 2-rank command on a 1-GPU machine: 2 local ranks, 1 GPU (faked), no CUDA_VISIBLE_DEVICES,
    so both ranks see the same GPU. (One GPU per rank, each its own: tests/test_clusters.py.)"""
    (tmp_path / "sitecustomize.py").write_text(
        "import torch\ntorch.cuda.is_available = lambda: True\ntorch.cuda.device_count = lambda: 1\n"
        "torch.cuda.is_bf16_supported = lambda including_emulation=True: True\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert the_one_error("ddp_train.py", 2, ["--max_iters", "1", "--out_dir", str(tmp_path / "out")]) == (
        "error: --device: auto needs one GPU per local rank: 2 local ranks, 1 GPU(s) on this node; "
        "run at most 1 per node (--nproc_per_node), give each rank its own GPU (CUDA_VISIBLE_DEVICES), "
        "or pass --device cpu")


def test_a_slow_rank_0_still_prints_the_error_line(tmp_path, monkeypatch):
    """Bad input on 2 ranks where rank 0 starts 3 s late (as under load): rank 1 reaches the check first,
    and torchrun stops the job at the first rank that exits; the error line must still come out."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0': time.sleep(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert the_one_error("ddp_train.py", 2, ["--batch_size", "0", "--out_dir", str(tmp_path / "out")]).startswith(
        "error: --batch_size")


def test_bad_checkpoint_gives_one_clear_error_and_loses_nothing(shared_run, tmp_path):
    cut_run(shared_run, "ddp_train.py", "custom", tmp_path)  # a good checkpoint and metrics, then damaged
    path, metrics_path = tmp_path / "ckpt.pt", tmp_path / "metrics.jsonl"
    good, metrics = path.read_bytes(), metrics_path.read_bytes()
    torch.save({"weights": torch.zeros(3)}, path)
    damaged = {"truncated": good[: len(good) // 2], "garbage": os.urandom(4096), "not_a_checkpoint": path.read_bytes()}
    for damage, bad in damaged.items():
        path.write_bytes(bad)
        # rank 0 reads the file for every script (common.checkpoint.resume): one script per damage
        for script in ("pp_train.py",) if damage == "truncated" else ("fsdp_train.py",):
            t0 = time.time()
            result = launch(script, 2, FLAGS + ["--max_iters", "6", "--resume", "--out_dir", str(tmp_path)], timeout=60,
                            torchrun=False)
            assert result.returncode != 0 and time.time() - t0 < 30
            errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and "--resume" in errors[0] and str(path) in errors[0], (damage, result.stderr[-2000:])
            assert path.read_bytes() == bad and metrics_path.read_bytes() == metrics  # nothing overwritten
        result = launch("sample.py", None, ["--out_dir", str(tmp_path)], timeout=60)  # `python sample.py`
        assert result.returncode != 0 and result.stderr.strip().startswith("error:") and str(path) in result.stderr


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    result = launch("fsdp_train.py", 2, FLAGS + ["--max_iters", "3", "--resume", "--out_dir", str(tmp_path)], timeout=60,
                    torchrun=False)
    assert result.returncode != 0 and f"error: --resume: no checkpoint at {tmp_path / 'ckpt.pt'}" in result.stderr


def test_sample_generates_text_from_a_checkpoint(shared_run, tmp_path):
    cut_run(shared_run, "zero3_train.py", "custom", tmp_path)  # zero3's checkpoint at step CUT
    args = ["--out_dir", str(tmp_path), "--start", "ROMEO:", "--num_samples", "2", "--max_new_tokens", "20",
            "--seed", "7"]
    a, b = (launch("sample.py", None, args, timeout=120) for _ in range(2))  # two `python sample.py`
    assert a.returncode == 0, a.stderr[-2000:]
    assert a.stdout.count("ROMEO:") == 2 and a.stdout == b.stdout
    assert len(a.stdout) > 2 * len("ROMEO:") + 20


BAD = [  # (script, flags, nproc (None: one process), the flag the error must name); per-strategy flags: test_<strategy>.py
    ("ddp_train.py", ["--no_such_flag"], None, "--no_such_flag"),
    ("ddp_train.py", ["--max_iters", "0"], None, "--max_iters"),
    ("ddp_train.py", ["--n_head", "3"], 2, "--n_head"),
    ("ddp_train.py", ["--batch_size", "6", "--grad_accum_steps", "2"], 2, "--batch_size"),
    ("fsdp_train.py", ["--block_size", "100000"], 2, "--block_size"),
    ("fsdp_train.py", ["--implementation", "magic"], None, "--implementation"),
    ("pp_train.py", ["--activation_checkpointing", "attention"], None, "--activation_checkpointing"),
    ("zero3_train.py", ["--learning_rate", "-1"], None, "--learning_rate"),
    ("zero3_train.py", ["--dataset", "nosuchdata"], 2, "--dataset"),
    ("tp_train.py", ["--n_head", "3", "--n_embd", "66"], 2, "--n_head"),
    ("tp_train.py", ["--timeout_s", "0"], None, "--timeout_s"),
    ("tp_train.py", ["--tp_overlap"], 2, "tp_overlap_train.py"),  # a flag that moved names the script that has it
    ("pp_train.py", ["--batch_size", "6", "--n_microbatches", "4"], 2, "--batch_size"),
    ("pp_train.py", ["--n_layer", "2"], 4, "--n_layer"),
    ("cp_train.py", ["--dropout", "0.1"], 2, "--dropout"),
    ("ddp_train.py", ["--compile", "maybe"], None, "--compile"),
    ("ddp_train.py", ["--implementation", "pytorch", "--bucket_cap_mb", "0.5", "--compile"], None, "--compile"),
    # torch's selective checkpointing cannot see into a compiled block (docs/compile.md)
    ("tp_train.py", ["--implementation", "pytorch", "--activation_checkpointing", "selective", "--compile"], None,
     "--compile"),
]


@pytest.mark.parametrize("script,flags,nproc,flag", BAD, ids=[f"{s[:-9]}{' '.join(f)}-{n or 1}r" for s, f, n, _ in BAD])
def test_bad_input_sweep(script, flags, nproc, flag, tmp_path, monkeypatch, capsys):
    """End to end, as a user runs it (torchrun, or one `python script.py`: the first row), except the other flag
    checks of one process: the same die() in this process, no launch (conftest.refusal)."""
    args = FLAGS + ["--max_iters", "3"] + flags + ["--out_dir", str(tmp_path)]
    if nproc is None and (script, flags) != BAD[0][:2]:
        assert flag in refusal(script, None, args, monkeypatch, capsys)
    else:
        assert flag in the_one_error(script, nproc, args)


def test_resume_rewrites_metrics_by_rename_never_in_place(tmp_path):
    """A resumed run keeps the lines of the steps before its checkpoint. They go to a new file that
    replaces metrics.jsonl by a rename, so a crash mid-rewrite cannot leave a truncated file: the
    old file (seen here through a hard link) is never written to."""
    from common.metrics import Metrics
    lines = [json.dumps(dict(step=s, loss=10.0 - s)) + "\n" for s in range(8)] + ['{"summary": true}\n']
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(lines))
    os.link(path, tmp_path / "old.jsonl")
    metrics = Metrics(str(tmp_path), enabled=True, tensorboard=False, start_step=5)
    metrics.log(dict(step=5, loss=1.0))
    metrics.close()
    assert (tmp_path / "old.jsonl").read_text() == "".join(lines)
    assert path.read_text() == "".join(lines[:5]) + json.dumps(dict(step=5, loss=1.0)) + "\n"
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "old.jsonl"]  # no temporary file left
