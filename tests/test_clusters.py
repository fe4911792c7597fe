"""Clusters, modelled in this process with fakes; the launches are in test_reliability.py.

- resume is decided once: rank 0 chooses the checkpoint, a node that cannot see it (another out_dir, a stale
  NFS copy) ends every rank with one line, and a restart that only one node counts still resumes every rank;
- the data wait and its verdicts go over the default group (no gloo side group), polled within --timeout_s,
  with PREPARE_TIMEOUT bounding the preparation;
- two preparers racing on one folder: temporary files by host and PID, a complete file is never replaced;
- one GPU per process: cuda:0 when a rank sees exactly one GPU, one error for any count that does not fit.
"""
import json
import os
import socket
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import REPO, TINY
from common import data, distributed
from common.checkpoint import resume
from common.config import gpt_config, parse_args


# ---- 6: resume decided once ------------------------------------------------------------------------

def as_rank(monkeypatch, rank, restarts, sent):
    """Makes this process rank `rank` of 2 for common.checkpoint.resume, with fake collectives: each rank's
    restart count comes from `restarts`, rank 0's broadcast is kept in `sent` for rank 1, and the other
    rank's verdict is None. The ranks run one after the other, each in its own node's folder."""
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setenv("GROUP_RANK", str(rank))
    monkeypatch.delenv("RANK", raising=False)  # die() prints this rank's line (as rank 0 prints the first)

    def all_gather_object(out, obj, group=None):
        if isinstance(obj, int):  # resume's restart counts
            out[:] = list(restarts)
        else:  # die_on_any's verdicts
            out[:] = [obj if r == rank else None for r in range(2)]

    def broadcast_object_list(objs, src=0, group=None, device=None):
        if rank == 0:
            sent[:] = list(objs)
        else:
            objs[:] = sent

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)


def write_checkpoint(path, step, args):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(dict(model={}, optimizer={}, step=step, config=gpt_config(args).__dict__, save=time.time_ns()), path)


def run_rank(monkeypatch, capsys, rank, node, argv, restarts=(0, 0), sent=None):
    """(resume()'s checkpoint or None, None), or (None, the error line) for this rank run in folder `node`."""
    monkeypatch.chdir(node)
    as_rank(monkeypatch, rank, restarts, sent)
    args = parse_args("ddp", None, TINY + ["--max_iters", "10"] + argv)
    state = torch.get_rng_state()  # resume() seeds this process's generator
    try:
        return resume(args), None
    except SystemExit as stop:
        assert stop.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, errors
        return None, errors[0]
    finally:
        torch.set_rng_state(state)


def test_a_node_that_cannot_see_the_checkpoint_ends_every_rank_with_one_line(tmp_path, monkeypatch, capsys):
    """Two nodes whose out_dirs differ: the same flag --out_dir out, each node in its own folder. Node 0 has
    the checkpoint, node 1 has none, then a stale one (NFS showing an older file). Before the fix, rank 1
    crashed with AttributeError while rank 0 resumed."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    args = parse_args("ddp", None, TINY)
    write_checkpoint(str(nodes[0] / "out" / "ckpt.pt"), 6, args)
    argv = ["--out_dir", "out", "--resume"]
    sent = []
    ckpt, error = run_rank(monkeypatch, capsys, 0, nodes[0], argv, sent=sent)
    assert error is None and ckpt["step"] == 6
    _, error = run_rank(monkeypatch, capsys, 1, nodes[1], argv, sent=sent)
    assert error.startswith("error: --resume: out/ckpt.pt is not visible from node 1 (host ")
    assert error.endswith("out_dir must be on a shared filesystem, or pass --resume_from a path every node can read")
    write_checkpoint(str(nodes[1] / "out" / "ckpt.pt"), 4, args)  # a stale copy at the same path
    _, stale = run_rank(monkeypatch, capsys, 1, nodes[1], argv, sent=sent)
    print(f"{error}\n{stale}")
    error = stale
    assert error.startswith("error: --resume: out/ckpt.pt on node 1 (host ")
    assert "is another file than rank 0 read (step 4," in error


def test_a_restart_counted_on_one_node_resumes_every_rank(tmp_path, monkeypatch, capsys):
    """torchrun's agents count restarts per node: the node whose worker failed reads 1, a node restarted for
    it may read 0. Rank 0 (count 0) must still resume, as rank 1 (count 1) does: before the fix rank 0
    started fresh while rank 1 resumed."""
    args = parse_args("ddp", None, TINY)
    write_checkpoint(str(tmp_path / "out" / "ckpt.pt"), 6, args)
    sent = []
    steps = []
    for rank in (0, 1):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(rank))
        ckpt, error = run_rank(monkeypatch, capsys, rank, tmp_path, ["--out_dir", "out"], restarts=(0, 1),
                               sent=sent)
        assert error is None, error
        steps.append(ckpt and ckpt["step"])
    assert steps == [6, 6]


def test_resume_from_and_a_restart_after_it(tmp_path, monkeypatch, capsys):
    """--resume_from PATH starts a run in a new out_dir from any checkpoint; once that run has written its
    own, a restart continues from its own (the newer), not from PATH again."""
    args = parse_args("ddp", None, TINY)
    start = str(tmp_path / "start.pt")
    write_checkpoint(start, 3, args)
    argv = ["--out_dir", "out", "--resume_from", start]
    sent = []
    for rank in (0, 1):
        ckpt, error = run_rank(monkeypatch, capsys, rank, tmp_path, argv, sent=sent)
        assert error is None and ckpt["step"] == 3
    write_checkpoint(str(tmp_path / "out" / "ckpt.pt"), 8, args)
    ckpt, error = run_rank(monkeypatch, capsys, 0, tmp_path, argv, restarts=(1, 1), sent=[])
    assert error is None and ckpt["step"] == 8
    _, error = run_rank(monkeypatch, capsys, 0, tmp_path, ["--resume_from", str(tmp_path / "nope.pt")], sent=[])
    assert error == f"error: --resume_from: no checkpoint at {tmp_path / 'nope.pt'}"


# ---- 7: the data wait on the default group ---------------------------------------------------------

@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_data_wait_makes_no_gloo_group(one_rank_group, monkeypatch):
    """On nccl a gloo side group picks its network interface from the hostname, often wrongly across nodes.
    setup_data must make no group of its own: every collective on the default group, its tensors on
    collective_device() (this rank's GPU under nccl, checked with a faked backend below)."""
    def no_new_group(*args, **kwargs):
        raise AssertionError(f"setup_data made a process group: new_group{args}{kwargs}")

    seen = []
    all_reduce, all_gather_object = dist.all_reduce, dist.all_gather_object

    def recorded_all_reduce(tensor, *args, **kwargs):
        seen.append(("all_reduce", kwargs.get("group"), tensor.device))
        return all_reduce(tensor, *args, **kwargs)

    def recorded_all_gather_object(out, obj, group=None):
        seen.append(("all_gather_object", group, None))
        return all_gather_object(out, obj, group=group)

    monkeypatch.setattr(dist, "new_group", no_new_group)
    monkeypatch.setattr(dist, "all_reduce", recorded_all_reduce)
    monkeypatch.setattr(dist, "all_gather_object", recorded_all_gather_object)
    distributed.setup_data(parse_args("ddp", None, TINY))
    assert seen and all(group is None for _, group, _ in seen), seen
    assert all(device == torch.device("cpu") for name, _, device in seen if name == "all_reduce"), seen
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert distributed.collective_device() == torch.device("cuda", 3)


def test_a_preparation_past_prepare_timeout_is_one_error(one_rank_group, monkeypatch, capsys):
    """Tokenising may take up to PREPARE_TIMEOUT (2 h; here 0.5 s), longer than --timeout_s: the wait polls
    and past it ends with one line. Before the fix the wait was a gloo collective; a rank alone waited on
    itself, and its late preparation passed."""
    monkeypatch.setattr(distributed, "PREPARE_TIMEOUT", timedelta(seconds=0.5))
    monkeypatch.setattr(data, "prepare", lambda *args: time.sleep(3))
    t0 = time.time()
    with pytest.raises(SystemExit) as stop:
        distributed.setup_data(parse_args("ddp", None, TINY + ["--timeout_s", "1"]))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and errors == [
        "error: --dataset shakespeare: preparing the data took more than 0:00:00.500000 "
        "(common.distributed.PREPARE_TIMEOUT)"]
    assert time.time() - t0 < 2.5


# ---- 8: two preparers on one folder ----------------------------------------------------------------

@pytest.fixture
def small_dataset(tmp_path, monkeypatch):
    """data/race/input.txt: the first 20,000 characters of Tiny Shakespeare, in a data root of this test."""
    monkeypatch.setattr(data, "DATA_ROOT", str(tmp_path / "data"))
    folder = tmp_path / "data" / "race"
    folder.mkdir(parents=True)
    with open(os.path.join(REPO, "data", "shakespeare", "input.txt"), encoding="utf-8") as f:
        (folder / "input.txt").write_text(f.read()[:20000], encoding="utf-8")
    return folder


def test_two_preparers_racing_on_one_folder_never_replace_a_complete_file(small_dataset, monkeypatch):
    """Preparer B (host nodeB) checks the folder, finds nothing and tokenises; meanwhile preparer A (host nodeA,
    the same PID: containers) prepares the folder completely and its node memmaps train.bin. B must not
    clobber A's temporary files nor replace A's complete files (on NFS: ESTALE or SIGBUS under the memmap)."""
    import tiktoken
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    host = ["nodeB"]
    monkeypatch.setattr(socket, "gethostname", lambda: host[0])
    real = tiktoken.get_encoding("gpt2")
    seen = {}

    class Encoding:
        calls = 0

        def encode_ordinary(self, text):
            Encoding.calls += 1
            if Encoding.calls == 2:  # B has tokenised train, A runs start to end
                seen["before"] = sorted(os.listdir(small_dataset))
                host[0] = "nodeA"
                assert data.prepare("race") is None
                host[0] = "nodeB"
                seen["after"] = sorted(os.listdir(small_dataset))
                seen["inodes"] = {f: os.stat(small_dataset / f).st_ino for f in ("train.bin", "val.bin", "meta.json")}
                seen["reader"] = np.memmap(small_dataset / "train.bin", dtype=np.uint16, mode="r")
            return real.encode_ordinary(text)

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: Encoding())
    assert data.prepare("race") is None
    assert {f: os.stat(small_dataset / f).st_ino for f in seen["inodes"]} == seen["inodes"]  # never replaced
    assert "train.bin.tmp.nodeB.4242" in seen["before"] and "train.bin.tmp.nodeB.4242" in seen["after"]
    assert sorted(os.listdir(small_dataset)) == ["input.txt", "meta.json", "train.bin", "val.bin"]  # no tmp left
    meta = json.loads((small_dataset / "meta.json").read_text())
    assert len(seen["reader"]) == meta["tokens"]["train"] > 0


def test_publish_keeps_an_equal_file_and_replaces_another(tmp_path):
    path, tmp = tmp_path / "train.bin", tmp_path / "train.bin.tmp.h.1"
    tmp.write_bytes(b"abcd")
    data.publish(str(tmp), str(path))  # nothing there: created
    inode = path.stat().st_ino
    tmp.write_bytes(b"abcd")
    data.publish(str(tmp), str(path))  # the same bytes: kept
    assert path.stat().st_ino == inode and not tmp.exists()
    tmp.write_bytes(b"abce")
    data.publish(str(tmp), str(path))  # other bytes (an older text's data): replaced
    assert path.read_bytes() == b"abce" and not tmp.exists()


def test_a_truncated_bin_is_prepared_again(small_dataset):
    """meta.json holds each split's token count; a .bin of another size is not taken as prepared."""
    assert data.prepare("race") is None
    whole = (small_dataset / "train.bin").read_bytes()
    (small_dataset / "train.bin").write_bytes(whole[:100])
    assert data.prepare("race") is None
    assert (small_dataset / "train.bin").read_bytes() == whole


# ---- 9: one GPU per process ------------------------------------------------------------------------

def fake_gpus(monkeypatch, count, local_rank, local_world, visible=None, native_bf16=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    # bf16 on a GPU of compute capability 8.0+ (native); a V100 or T4 only emulates it, and says True only when
    # emulation counts, is_bf16_supported's default
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16 or including_emulation)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def test_a_rank_that_sees_one_gpu_uses_cuda_0(monkeypatch):
    """SLURM --gpus-per-task=1 or CUDA_VISIBLE_DEVICES per rank: local rank 1 sees one GPU, its own, as
    cuda:0 (cuda:1 does not exist). setup() runs with init_process_group faked: nccl on cuda:0."""
    fake_gpus(monkeypatch, 1, local_rank=1, local_world=2, visible="1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw["device_id"])))
    # the GPU's timers and numerics (torch's global switches: faked here, they would outlive the test)
    monkeypatch.setattr(distributed.timers, "use_device", lambda device: calls.append(("timers", device)))
    monkeypatch.setattr(distributed, "set_numerics", lambda args, use_cuda: calls.append(("numerics", use_cuda)))
    state = torch.get_rng_state()
    args = parse_args("ddp", None, TINY)
    try:
        assert distributed.setup(args) == (1, 2, torch.device("cuda", 0))
    finally:
        torch.set_rng_state(state)
    assert args.compile is True and args.dtype == "bfloat16"  # --compile's and --dtype's defaults on CUDA
    assert calls == [("set_device", torch.device("cuda", 0)), ("numerics", True), ("timers", torch.device("cuda", 0)),
                     ("nccl", torch.device("cuda", 0))]


@pytest.mark.parametrize("count,local_rank,local_world,visible,expected", [
    (4, 1, 2, None, 1),  # every GPU of the node visible: cuda:LOCAL_RANK
    (2, 1, 2, "0,1", 1),
    (1, 0, 1, None, 0),
    (1, 3, 1, "3", 0),  # srun: LOCAL_RANK set, LOCAL_WORLD_SIZE not
    (1, 1, 2, None, "1 GPU(s)"),  # a 1-GPU machine, 2 ranks: they would share it
    (2, 2, 3, "0,1", "2 GPU(s)"),  # neither 1 nor >= local world size
    (2, 3, 1, None, "2 GPU(s)"),  # local rank 3 with 2 GPUs
])
def test_the_gpu_of_each_rank(count, local_rank, local_world, visible, expected, monkeypatch, capsys):
    fake_gpus(monkeypatch, count, local_rank, local_world, visible)
    monkeypatch.delenv("RANK", raising=False)
    args = parse_args("ddp", None, TINY)
    if isinstance(expected, int):
        assert distributed.cuda_device(args, local_rank, local_world) == torch.device("cuda", expected)
        return
    with pytest.raises(SystemExit):
        distributed.cuda_device(args, local_rank, local_world)
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: --device: auto needs one GPU per local rank: ") and expected in error, error
