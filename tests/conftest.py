"""Shared test plumbing: offline data, launching scripts under torchrun, spawning gloo ranks."""
import importlib
import itertools
import json
import math
import os
import pickle
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# What PyTorch's own implementations need beyond the floor (common.config.TORCH_FLOOR), as the scripts refuse
# it: (script, implementation, dtype) -> torch version. Tests of those runs are skipped on an older torch.
PEER_NEEDS = {("pp_train.py", "pytorch", "float32"): "2.10", ("pp_train.py", "pytorch", "bfloat16"): "2.11",
              ("hybrid_train.py", "pytorch", "float32"): "2.10"}
for _copy in ("pp_zb_train.py", "pp_vocab_train.py"):  # pp_train.py's tier-2 copies: the same peer
    PEER_NEEDS.update({(_copy, "pytorch", "float32"): "2.10", (_copy, "pytorch", "bfloat16"): "2.11"})


def peer_needs(script, implementation, dtype="float32"):
    """A skip mark for a run this torch refuses (see PEER_NEEDS), or no mark."""
    needed = PEER_NEEDS.get((script, implementation, dtype))
    too_old = needed is not None and TorchVersion(torch.__version__) < needed
    return [pytest.mark.skipif(too_old, reason=f"{script} {implementation} {dtype} needs torch >= {needed}")]


# The suite checks the CPU (gloo) paths, whatever the machine: a machine's GPUs are hidden from this process and every
# script it launches, before anything asks CUDA (two ranks on one GPU are refused by NCCL; a GPU would change the
# default dtype to bf16). The GPU paths are checked by fakes (tests/test_setup.py) and by tests/gpu/.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), "shared")
sys.path.insert(0, REPO)
from common import data  # noqa: E402 (after REPO is on the path)
from runs import check_plan  # noqa: E402

# Offline: the folder NANODIST_OFFLINE_DIR names (docs/offline.md), by default ../shared beside the checkout
# when it holds the text (never committed); with neither, the text and the tokenizer are downloaded. The scripts
# the tests launch inherit the variable; prepared_data copies the text from the folder (temporary, then publish()).
if data.OFFLINE_DIR not in os.environ and os.path.isfile(os.path.join(SHARED, data.OFFLINE_TEXT)):
    os.environ[data.OFFLINE_DIR] = SHARED


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    error = data.use_offline_dir()  # a folder without the files: one line, before any test
    if error is not None:
        raise pytest.UsageError(error)
    # pytest-xdist's -n: --dist loadgroup whatever --dist says, so that the groups below hold
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, one worker runs each group: every test that reads a shared_run (the runs the parity,
    resume, profile and ledger tests share, each made once), and each other file's tests (its module fixtures,
    such as test_zero3.py's spawned ranks, made once). Without -n the marks do nothing."""
    for item in items:
        group = "shared_run" if "shared_run" in item.fixturenames else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))


# A small config where one step takes a few tens of milliseconds on CPU.
TINY = ["--n_layer", "2", "--n_head", "4", "--n_embd", "64", "--block_size", "32", "--batch_size", "8",
        "--dropout", "0", "--bias", "true", "--tensorboard", "false", "--eval_interval", "0", "--log_interval", "1"]


@pytest.fixture(scope="session", autouse=True)
def prepared_data():
    error = data.prepare("shakespeare")
    assert error is None, error


# One process's intra-op threads, the same in the single-process reference and in test_parity.py's plain loop: a sum
# split over another number of threads adds in another order (on a machine with many cores, a flake in waiting). One:
# the references' launch and the plain loops run side by side, a core each.
ONE_PROCESS_THREADS = 1


def launch(script, nproc, args, timeout=300, check_teardown=True, torchrun=True, old_names=False):
    """Run a strategy script: plain python when nproc is None, else nproc ranks under torchrun.

    torchrun=False starts the nproc ranks as `python script` processes given the environment torchrun
    gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT with a free
    port, OMP_NUM_THREADS=1): the same code path in the script (env:// rendezvous, rank 0 hosts the
    store), without torchrun's own start-up, about 2 s a launch here. The numeric tests (parity,
    resume) use it; everything about how a job starts, fails or restarts keeps torchrun. Each
    such `python script` (and nproc=None's) is a fork of tests/zygote.py (ForkServer), which has imported
    torch: a fresh interpreter spends about 2.2 s of CPU on that, per rank and launch.
    Every launch but old_names=True (launch_as_user's) checks that no collective was called by a name torch
    2.13 deprecates (common.distributed picks the new one where it exists)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if nproc is None:  # the one-process reference's threads: the plain loop's (test_parity.py), on any machine
        ranks = [([sys.executable, script], dict(env, OMP_NUM_THREADS=str(ONE_PROCESS_THREADS)))]
    elif torchrun:
        ranks = [([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script],
                  env)]
    else:
        rendezvous = dict(env, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        ranks = [([sys.executable, script], dict(rendezvous, RANK=str(r), LOCAL_RANK=str(r))) for r in range(nproc)]
    # Each process in its own session, so a timeout kills torchrun and its workers alike: a worker left
    # behind could hold ports and CPU and disturb the tests after it. Output goes to files, not pipes, so
    # that no rank blocks on a full pipe while another is being read.
    with tempfile.TemporaryDirectory() as logs:
        procs, files = [], []
        try:
            for r, (cmd, rank_env) in enumerate(ranks):
                out, err = open(os.path.join(logs, f"{r}.out"), "w+"), open(os.path.join(logs, f"{r}.err"), "w+")
                files.append((out, err))
                if cmd[1:] == [script]:  # python <script>: a fork of a process that has imported torch
                    procs.append(fork_server(rank_env).start(cmd[1:] + list(args), rank_env, out.name, err.name))
                else:
                    procs.append(subprocess.Popen(cmd + list(args), cwd=REPO, env=rank_env, stdout=out,
                                                  stderr=err, text=True, start_new_session=True))
            deadline = time.time() + timeout
            # As torchrun does, the first rank to fail ends the job (the finally below kills the rest).
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                if time.time() > deadline:
                    raise subprocess.TimeoutExpired(procs[0].args, timeout)
                time.sleep(0.02)
            codes = [p.poll() for p in procs]  # None: still running, to be killed because another rank failed
        finally:
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # ended; or a fork not yet in its own session
                    if proc.poll() is None:
                        os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        stdout, stderr = "", ""
        for out, err in files:
            out.seek(0), err.seek(0)
            stdout, stderr = stdout + out.read(), stderr + err.read()
            out.close(), err.close()
    # Every run checks that it released its process groups (common.distributed.teardown): a group left
    # alive into interpreter shutdown can abort a finished run (SIGABRT) about once in 100 launches.
    if check_teardown:
        assert "warning: teardown" not in stderr, stderr[-3000:]
    if not old_names:
        assert not re.search(r"torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                             stderr), stderr[-3000:]
    code = next((c for c in codes if c), 0)
    if code == 0 and script.endswith("_train.py") and "--out_dir" in args:  # plan.py's model state, exact
        out_dir = args[list(args).index("--out_dir") + 1]
        check_plan(os.path.basename(script), list(args), os.path.join(REPO, out_dir))  # an absolute one: itself
    return subprocess.CompletedProcess(procs[0].args, code, stdout, stderr)


# The environment variables that can change what importing torch does (threads, logging, config read at import):
# launches that differ in them get different fork servers.
IMPORT_ENV = ("OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH", "CUDA", "NCCL", "GLOO", "TRITON", "PYTHON", "LD_")


class ForkServer:
    """tests/zygote.py, started once per import-time environment: launch() runs each `python <script> <args>` rank
    as a fork of it (start() -> a Forked, which launch() polls and kills as it does a Popen)."""

    def __init__(self, env):
        self.proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "zygote.py")], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.codes = {}  # pid -> exit code, once the server has reaped it
        self.started = []  # pids, in the order of the requests
        self.pending = b""

    def start(self, argv, env, stdout, stderr):
        job = dict(argv=argv, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
        os.write(self.proc.stdin.fileno(), json.dumps(job).encode() + b"\n")
        while not self.started:
            self.pump(1.0)
        return Forked(self, self.started.pop(0), argv)

    def pump(self, timeout):
        """Reads what the server has said, waiting up to `timeout` s for it to say something."""
        out = self.proc.stdout.fileno()
        ready, _, _ = select.select([out], [], [], timeout)
        if not ready:
            return
        chunk = os.read(out, 1 << 16)
        if not chunk:
            raise RuntimeError(f"tests/zygote.py ended (exit code {self.proc.wait()})")
        self.pending += chunk
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            what, pid, *code = line.decode().split()
            if what == "started":
                self.started.append(int(pid))
            else:
                self.codes[int(pid)] = int(code[0])


class Forked:
    """One rank forked by a ForkServer: the part of subprocess.Popen that launch() uses."""

    def __init__(self, server, pid, args):
        self.server, self.pid, self.args = server, pid, args

    def poll(self):
        self.server.pump(0)
        return self.server.codes.get(self.pid)

    def wait(self):
        while self.pid not in self.server.codes:
            self.server.pump(0.05)
        return self.server.codes[self.pid]


FORK_SERVERS = {}


def fork_server(env):
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV)))
    if key not in FORK_SERVERS or FORK_SERVERS[key].proc.poll() is not None:
        FORK_SERVERS[key] = ForkServer({k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK")})
    return FORK_SERVERS[key]


def the_one_error(script, nproc, args):
    """Run a script on input it must refuse and return its error line, having checked the contract for
    bad input: a non-zero exit within 30 s, exactly one line starting "error:", and no traceback from
    the script or common/ (torchrun prints its own ChildFailedError summary)."""
    start = time.time()
    result = launch(script, nproc, args, timeout=60)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0
    assert len(errors) == 1, result.stderr[-2000:]
    assert not re.search(rf'File ".*({re.escape(script)}|common/)', output), result.stderr[-2000:]
    assert time.time() - start < 30
    return errors[0]


def refusal(script, nproc, args, monkeypatch, capsys):
    """The error line of a script's flag checks, in this process: its main() on `args` as one of `nproc` ranks
    (WORLD_SIZE; rank 0) must stop before any process group, with exit code 2 and exactly one "error:" line.
    The same die() end to end, under torchrun and on every rank, is the_one_error's (test_reliability's sweep runs
    it for every script); this costs no launch, so each script's own bad-flag tables use it."""
    module = importlib.import_module(script[:-3])
    monkeypatch.setenv("WORLD_SIZE", str(nproc or 1))
    monkeypatch.delenv("RANK", raising=False)
    try:
        with pytest.raises(SystemExit) as stop:
            module.main(list(args))
    finally:  # a check that let the input through went on to set up: leave no group to the next test
        if dist.is_initialized():
            dist.destroy_process_group()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and len(errors) == 1, errors
    return errors[0]


def probe(script, nproc, args, tmp_path):
    """Runs the script's real main() under tests/probe.py on nproc ranks (torchrun=False, as the numeric tests
    do); returns each rank's record (see tests/probe.py) by rank."""
    return probe_runs(nproc, [(script, args)], tmp_path)[0]


def probe_runs(nproc, runs, tmp_path):
    """probe() of several (script, args) runs in one launch, each its script's main() in turn: their records."""
    os.environ["PROBE_OUT"] = str(tmp_path / "probe")
    try:
        argv = [arg for script, args in runs for arg in [script, *args, "---"]][:-1]
        result = launch("tests/probe.py", nproc, argv, timeout=60 + 30 * len(runs), torchrun=False)
    finally:
        del os.environ["PROBE_OUT"]
    assert result.returncode == 0, result.stderr[-3000:]
    folders = [tmp_path / "probe"] if len(runs) == 1 else [tmp_path / "probe" / str(k) for k in range(len(runs))]
    return [[json.loads((folder / f"rank{r}.json").read_text()) for r in range(nproc)] for folder in folders]


def launch_as_user(script, nproc, args, adamw="fused", timeout=300):
    """Runs the script under tests/user_torch.py on nproc ranks (torchrun=False): AdamW on its `adamw` path
    (fused: the scripts' own on every device; or foreach, CUDA's default for an AdamW built without a path) and
    the project's code without torch 2.13's collective names. Returns
    the result, with .adamw_multi_tensor_steps: each rank's count of multi-tensor AdamW updates."""
    with tempfile.TemporaryDirectory() as out:
        env = {"USER_TORCH_OUT": out, "USER_TORCH_ADAMW": adamw, "USER_TORCH_BEFORE_2_13": "1"}
        os.environ.update(env)
        try:
            result = launch("tests/user_torch.py", nproc, [script, *args], timeout=timeout, torchrun=False,
                            old_names=True)
        finally:
            for key in env:
                del os.environ[key]
        assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        ranks = [json.loads(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(nproc or 1)]
        result.adamw_multi_tensor_steps = [rank["adamw_multi_tensor_steps"] for rank in ranks]
        result.adamw_per_run = [rank["per_run"] for rank in ranks]  # runs separated by "---" in args
    return result


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_losses(out_dir):
    return [r["loss"] for r in read_metrics(out_dir) if "loss" in r]


def run_record(out_dir):
    """What a run logged that parity compares: every step's loss and pre-clip grad norm, and every evaluation
    as (step, train loss, val loss)."""
    rows = read_metrics(out_dir)
    return dict(loss=[r["loss"] for r in rows if "loss" in r], grad_norm=[r["grad_norm"] for r in rows if "loss" in r],
                eval=[(r["step"], r["train_loss"], r["val_loss"]) for r in rows if "val_loss" in r])


def finite(values, what):
    """values as a list, asserting that every one is a finite number: a NaN or an inf anywhere fails the caller."""
    values = list(values)
    bad = [(i, v) for i, v in enumerate(values) if not math.isfinite(v)]
    assert not bad, f"{what}: non-finite values (index, value) {bad[:5]} of {len(values)}"
    return values


def paired(run, ref, what):
    """zip(run, ref) as a list, asserting equal lengths (zip alone cuts the longer one short) and finite values."""
    run, ref = finite(run, f"{what} (run)"), finite(ref, f"{what} (reference)")
    assert len(run) == len(ref), f"{what}: {len(run)} values against the reference's {len(ref)}"
    return list(zip(run, ref))


def worst(values, what="difference"):
    """The largest of values, every one finite: Python's max keeps a NaN only when it comes first, so a run that
    turns NaN after its first step would otherwise compare as well as its first step did."""
    values = finite(values, what)
    assert values, f"{what}: nothing to compare"
    return max(values)


# The parity config (tests/test_parity.py), shared with the resume tests so that they can reuse its runs.
PARITY_STEPS = 15
PARITY_EVAL_ITERS = 2  # batches per split of each evaluation
# --deterministic: what docs/checkpoints.md tells users to pass for bit-identical reruns and resumes (on CPU
# the kernels were already deterministic, and the losses are the same bits with it or without).
# --eval_interval PARITY_STEPS: an evaluation before the first step and one at the end of the run (a run of
# fewer steps too, and a resumed run at its end), each checked against one process's.
PARITY = TINY + ["--learning_rate", "1e-3", "--min_lr", "1e-4", "--warmup_iters", "5", "--seed", "1337",
                 "--deterministic", "--eval_interval", str(PARITY_STEPS), "--eval_iters", str(PARITY_EVAL_ITERS)]
CUT = 6  # the step tests/test_reliability.py's resumes start from


def cut_args(implementation, script=None):
    """The 2-rank run of CUT steps at the parity config that the resume and cross-strategy tests continue
    from its checkpoint. --lr_decay_iters pins the schedule, so it is a prefix of the PARITY_STEPS run.
    --profile: tests/test_profile.py reads its traces (one launch for both; profiling changes no number)."""
    return PARITY + ["--lr_decay_iters", str(PARITY_STEPS), "--implementation", implementation,
                     "--max_iters", str(CUT), "--profile"] + CUT_FLAGS.get(script, [])


# tests/test_tp.py's runs with dropout 0.5 (custom with SP: every rank's forked stream; pytorch without: the shared
# stream), uninterrupted: each rides the 2-rank launch of tests/test_parity.py, and test_tp.py's cut run of the same
# flags, a launch of its own, must repeat its first steps bit for bit (a batched run is the run alone).
TP_DROPOUT_STEPS = 4
TP_DROPOUT = [("custom", True), ("pytorch", False)]


def assert_alone_is_batched_prefix(alone, batched, steps):
    """A run alone (run_record's dict) of `steps` steps repeats the batched run of the same flags, bit for bit: its
    losses and grad norms, all finite, and its evaluation before the first step."""
    finite(alone["loss"] + alone["grad_norm"] + list(alone["eval"][0]), "the run alone")
    assert len(alone["loss"]) == steps, alone
    assert alone["loss"] == batched["loss"][:steps], (alone, batched)
    assert alone["grad_norm"] == batched["grad_norm"][:steps], (alone, batched)
    assert alone["eval"][0] == batched["eval"][0], (alone["eval"], batched["eval"])


def tp_dropout_args(implementation, sp):
    return TINY + ["--dropout", "0.5", "--implementation", implementation, "--lr_decay_iters", str(TP_DROPOUT_STEPS),
                   "--eval_interval", "2", "--eval_iters", "1"] + (["--sequence_parallel"] if sp else [])


def runs_here(script, implementation, dtype="float32"):
    """Whether this torch runs (script, implementation, dtype): peer_needs marks no skip."""
    return not any(mark.args[0] for mark in peer_needs(script, implementation, dtype))


# Every cut run, each script's hand-written one and PyTorch's where it runs on CPU (cp's needs CUDA): the resume,
# cross-strategy, checkpoint-state and profile tests all read them, so the first to ask runs them all in one launch.
CUT_SCRIPTS = ["ddp_train.py", "fsdp_train.py", "zero3_train.py", "tp_train.py", "pp_train.py", "cp_train.py",
               "pp_zb_train.py", "pp_vocab_train.py", "zero3_tuning_train.py", "tp_overlap_train.py",
               "fsdp_hsdp_train.py", "ddp_diloco_train.py"]
CUT_RUNS = [(s, "custom") for s in CUT_SCRIPTS] + [(s, "pytorch") for s in CUT_SCRIPTS[:5]]
CUT_FLAGS = {"fsdp_hsdp_train.py": ["--replicate_size", "2"],  # 2 replicas: their all-reduce, replica 0's checkpoint
             # an outer step every 3 steps (CUT is one: a checkpoint) and an evaluation mid-window (step 4)
             "ddp_diloco_train.py": ["--inner_steps", "3", "--eval_interval", "4"]}


def cut_run_dir(shared_run, script, implementation):
    """The out_dir of the 2-rank cut run (cut_args) of this script and implementation, made by shared_run: every cut
    run this torch runs (CUT_RUNS) in one launch, the first time one is asked for."""
    shared_run.batch(2, [(s, cut_args(i, s)) for s, i in CUT_RUNS if runs_here(s, i)])
    return shared_run(script, 2, cut_args(implementation, script))[0]


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """shared_run(script, nproc, args, as_user=False) -> (out_dir, result): each distinct (script, nproc, args,
    as_user) runs once per session and every test that needs it (a reference, a parity row, the uninterrupted
    run a resume is compared with) reads the same out_dir. Each torchrun launch costs seconds of start-up.
    as_user: run it as launch_as_user does (AdamW's fused path, counted; torch < 2.13's collective names)."""
    runs = {}

    def batch(nproc, many, as_user=False):
        """Runs every (script, args) of `many` not run yet in one launch (tests/runs.py, or tests/user_torch.py's
        several runs: one process group, each run its script's main()), each into its own out_dir, and keeps each
        under its own key, as get() would have: a launch is mostly start-up (about 7 s at 2 ranks), a tiny run a
        fraction of a second."""
        todo = [(script, list(args)) for script, args in dict.fromkeys((s, tuple(a)) for s, a in many)
                if (script, nproc, args, as_user) not in runs]
        if len(todo) < 2:
            return
        out_dirs = [tmp_path_factory.mktemp("run") for _ in todo]
        argv = []
        for (script, args), out_dir in zip(todo, out_dirs):
            argv += [script] + args + ["--out_dir", str(out_dir), "---"]
        if as_user:
            result = launch_as_user(argv[0], nproc, argv[1:-1], timeout=60 + 30 * len(todo))
        else:
            result = launch("tests/runs.py", nproc, argv[:-1], timeout=60 + 30 * len(todo), torchrun=False)
        assert result.returncode == 0, f"failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        for k, ((script, args), out_dir) in enumerate(zip(todo, out_dirs)):
            one = subprocess.CompletedProcess(result.args, 0, result.stdout, result.stderr)
            if as_user:  # each rank's multi-tensor AdamW steps in this run
                one.adamw_multi_tensor_steps = [per_run[k] for per_run in result.adamw_per_run]
            runs[(script, nproc, tuple(args), as_user)] = out_dir, one

    def get(script, nproc, args, as_user=False):
        key = (script, nproc, tuple(args), as_user)
        if key not in runs:
            out_dir = tmp_path_factory.mktemp("run")
            args = list(args) + ["--out_dir", str(out_dir)]
            if as_user:
                result = launch_as_user(script, nproc, args)
            else:
                result = launch(script, nproc, args, torchrun=False)
            assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            runs[key] = out_dir, result
        return runs[key]
    get.batch = batch
    return get


@pytest.fixture(scope="session")
def references(shared_run):
    """references(extra=()) -> (reference, plain): tests/test_parity.py's one-process reference and plain loop for
    that row's model shape (one_process_references there), made once a session, by the first test that asks (its
    launch carries every other one-process run that a test compares with them)."""
    from test_parity import one_process_references
    return one_process_references(shared_run)


def _plain(t):
    return type(t) in (torch.Tensor, torch.nn.Parameter)


class DeviceMemory(TorchDispatchMode):
    """A GPU's memory modelled on the CPU: inside it, every tensor an op allocates counts as device memory, except
    the copies `.to("cpu", copy=True)` makes (aten._to_copy to the CPU), which are CPU memory (is_cpu_copy tells
    them). A tensor counts until Python frees it; `peak`: the most device bytes alive at once.
    whole_run: a whole run on the CPU as its device. Its copies to the CPU count; a storage counts until it is freed
    (its last tensor, view or holder gone: a parameter made by to_empty, logits a view of which the loss saved), at its
    size then: one resized in place (FSDP's reshard frees its unit with resize_(0), its gather resizes it back)
    counts its new size at once, as CUDA's allocator frees and allocates those bytes."""

    def __init__(self, whole_run=False):
        super().__init__()
        self.alive = 0
        self.peak = 0
        self.sizes = {}  # id of each tensor (whole_run: storage) counted -> its bytes now
        self.cpu_copies = {}  # id -> weak reference
        self.whole_run = whole_run

    def _freed(self, key):
        self.alive -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if _plain(t)}
        for t in tree_flatten(out)[0]:
            if not _plain(t) or t.untyped_storage().data_ptr() in inputs:
                continue  # a view or an in-place result: no new memory (a DTensor: its local ops count)
            if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu") \
                    and not self.whole_run:
                self.cpu_copies[id(t)] = weakref.ref(t)
                continue
            # whole_run: the storage, one Python object while it lives (torch keeps it)
            owner = t.untyped_storage() if self.whole_run else t
            if id(owner) not in self.sizes:
                self.sizes[id(owner)] = t.untyped_storage().nbytes()
                self.alive += self.sizes[id(owner)]
                self.peak = max(self.peak, self.alive)
                weakref.finalize(owner, self._freed, id(owner))
        return out

    def __enter__(self):
        if not self.whole_run:
            return super().__enter__()
        resize = self._resize = torch.UntypedStorage.resize_

        def counted_resize(storage, nbytes):
            out = resize(storage, nbytes)
            if id(storage) in self.sizes:
                self.alive += storage.nbytes() - self.sizes[id(storage)]
                self.sizes[id(storage)] = storage.nbytes()
                self.peak = max(self.peak, self.alive)
            return out
        torch.UntypedStorage.resize_ = counted_resize
        return super().__enter__()

    def __exit__(self, *exc):
        if self.whole_run:
            torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def is_cpu_copy(self, t):
        ref = self.cpu_copies.get(id(t))
        return ref is not None and ref() is t


def cpu_copies_only(memory, *states):
    """True if every tensor in the (nested) dicts `states` is one of the CPU copies `memory` saw made."""
    tensors = [t for t in tree_flatten(states)[0] if torch.is_tensor(t)]
    return len(tensors) > 0 and all(memory.is_cpu_copy(t) for t in tensors)


_ports = itertools.count()


def free_port():
    """A free TCP port, which this process alone hands out: under pytest-xdist worker gwN takes only ports from
    its own range, 20000 + 500 N onwards (below Linux's ephemeral range, where the kernel picks the ports that
    bind(0) and connections take), so no two workers pick one port between checking it and using it."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    while True:
        port = 20000 + 500 * worker + next(_ports) % 500
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use: the next one
                continue
            return port


def _worker(rank, world_size, port, fn, args, queue):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        # Plain pickle, by value: the queue's own pickler would send a tensor as a file descriptor that
        # the parent fetches from this process later, and fails to if this process has exited by then.
        queue.put((rank, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report, so the test fails instead of hanging
        import traceback
        queue.put((rank, pickle.dumps(RuntimeError(f"rank {rank}: {traceback.format_exc()}"))))
        raise
    finally:
        dist.destroy_process_group()


FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.tensor",
                      "torch.distributed.fsdp", "conftest"]


def spawn(fn, world_size, *args, timeout=300):
    """Run fn(rank, world_size, *args) on world_size gloo ranks; return the results by rank.
    fn must be a module-level function of a test module (it is pickled). The ranks are forks of multiprocessing's
    fork server, which has imported torch and its distributed packages once (FORKSERVER_PRELOAD): a spawned
    process would import them again for every rank, about 2-4 s each."""
    import queue as queue_module
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts: at the first spawn()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):  # drain before join: a child blocks until its result is read
            rank, value = queue.get(timeout=timeout)
            results[rank] = value = pickle.loads(value)
            if isinstance(value, Exception):
                raise value
    except queue_module.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(results))} hung or died")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
