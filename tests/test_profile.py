"""--profile on every script: a torch.profiler trace per rank whose timeline shows both the
communication (gloo/nccl collectives and send/recv) and the compute (matmuls), so a reader can see
whether communication overlaps compute. (The hand-written strategies; the profiler is the same
common.metrics.Profiler around the same loop for --implementation pytorch.)"""
import glob
import json
import os

import pytest

from conftest import TINY, launch

SCRIPTS = ["ddp_train.py", "fsdp_train.py", "zero3_train.py", "tp_train.py", "pp_train.py", "cp_train.py"]


def trace_events(path):
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_profile_trace_shows_communication_and_compute(script, tmp_path):
    result = launch(script, 2, TINY + ["--max_iters", "5", "--profile", "--out_dir", str(tmp_path)], torchrun=False)
    assert result.returncode == 0, result.stderr[-3000:]
    traces = sorted(glob.glob(os.path.join(tmp_path, "profile", "*.pt.trace.json")))
    assert [os.path.basename(t).split(".")[0] for t in traces] == ["rank0", "rank1"]
    for trace in traces:
        events = trace_events(trace)
        names = {e["name"] for e in events}
        comm = [e for e in events if e["name"].startswith(("gloo:", "nccl:"))]
        assert comm, f"{trace}: no collective or send/recv on the timeline"
        assert names & {"aten::mm", "aten::addmm"}, f"{trace}: no matmul on the timeline"
        steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
        assert len({e["name"] for e in steps}) == 3, steps  # the active steps: wait 1, warm-up 1, then 3 recorded
        # Every collective on the timeline starts within those steps (a strategy waits for its own traffic).
        start, end = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
        assert all(start <= e["ts"] <= end for e in comm), (start, end, [e["ts"] for e in comm])
