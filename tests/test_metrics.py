"""common.metrics' wait timers on CUDA's semantics, modelled on CPU: the host only queues work on a stream, an NCCL
`work.wait()` makes the stream wait and returns at once, so host time around it is ~0 while the stream waits. A fake
stream runs its queue only when the host synchronizes; a fake CUDA event is stamped with the stream's time when the
stream reaches it. The device clock must report the stream's time, read after the step's synchronize, and every
script's span around its NCCL waits must be on it; the CPU clock stays the host's perf_counter."""
import collections
import time
from types import SimpleNamespace

import pytest
import torch

import common.metrics
import cp_train
import fsdp_train
import tp_overlap_train
import zero3_train
from common.metrics import DeviceClock, HostClock, Timers, timers


class FakeStream:
    """A CUDA stream: the host queues kernels, waits and events and returns at once; the device runs the queue
    (its own clock, in seconds) only when the host synchronizes."""

    def __init__(self):
        self.queue = []
        self.now = 0.0  # the device's time when it has run everything queued so far
        self.synchronizes = 0

    def launch(self, seconds):  # a kernel
        self.queue.append(("kernel", seconds))

    def synchronize(self):
        self.synchronizes += 1
        for kind, value in self.queue:
            if kind == "kernel":
                self.now += value
            elif kind == "wait":  # the stream waits for a transfer that ends at `value`
                self.now = max(self.now, value)
            else:  # an event: stamped when the stream reaches it
                value.time = self.now
        self.queue = []


class FakeEvent:
    """torch.cuda.Event(enable_timing=True) on one stream."""

    def __init__(self, stream):
        self.stream = stream
        self.time = None

    def record(self):
        self.stream.queue.append(("event", self))

    def synchronize(self):
        if self.time is None:
            self.stream.synchronize()

    def elapsed_time(self, end):
        if self.time is None or end.time is None:  # as CUDA: an event not yet reached has no time
            raise RuntimeError("elapsed_time: an event has not completed")
        return 1000 * (end.time - self.time)


class FakeWork:
    """An NCCL Work whose transfer ends at device time `done`: wait() makes the stream wait, the host does not."""

    def __init__(self, stream, done):
        self.stream = stream
        self.done = done

    def wait(self):
        self.stream.queue.append(("wait", self.done))
        return True


def device_timers(stream):
    return Timers(DeviceClock(event=lambda: FakeEvent(stream)))


def test_device_clock_reports_the_streams_wait_read_after_the_step():
    stream = FakeStream()
    t = device_timers(stream)
    t.keep_spans = True
    t.start_step()
    stream.launch(0.003)  # 3 ms of compute queued before the wait
    host_start = time.perf_counter()
    with t("exposed_comm"):
        FakeWork(stream, done=0.010).wait()  # the transfer ends at 10 ms: the stream waits 7 ms of it
    with t("compute", label=("F", 0, 0)):
        stream.launch(0.004)
    host_seconds = time.perf_counter() - host_start
    assert stream.synchronizes == 0  # the spans did not make the host wait: overlap is left intact
    stream.synchronize()  # the training loop's synchronize before Metrics.step
    t.end_step()
    ms = t.medians_ms()
    assert ms["exposed_comm"] == pytest.approx(7.0) and ms["compute"] == pytest.approx(4.0)
    assert host_seconds < 0.002  # what a host clock would have reported for both
    # the timeline's spans: offsets from the step's start event, on the device
    assert [label for label, _, _ in t.last_spans] == ["exposed_comm", ("F", 0, 0)]
    assert [s for _, *s in t.last_spans] == [pytest.approx([0.003, 0.010]), pytest.approx([0.010, 0.014])]
    # a second step: its own spans only, device time summed per name
    stream.launch(0.001)
    for done in (0.015, 0.020):
        with t("exposed_comm"):
            FakeWork(stream, done).wait()
    stream.synchronize()
    t.end_step()
    assert t.steps["exposed_comm"] == pytest.approx([7.0, 5.0])  # 15 - 15, then 20 - 15
    assert [s for _, *s in t.last_spans] == [pytest.approx([0.001, 0.001]), pytest.approx([0.001, 0.006])]


def test_host_clock_is_the_host_perf_counter(monkeypatch):
    ticks = iter([10.0, 10.5, 11.25, 12.0, 13.0, 14.5])
    monkeypatch.setattr(common.metrics.time, "perf_counter", lambda: next(ticks))
    t = Timers()
    t.keep_spans = True
    t.start_step()  # 10.0
    with t("exposed_comm"):  # 10.5 .. 11.25
        pass
    with t("compute", label="F0"):  # 12.0 .. 13.0
        pass
    t.end_step()  # the next step starts at 14.5
    assert t.medians_ms() == {"exposed_comm": 750.0, "compute": 1000.0}
    assert t.last_spans == [("exposed_comm", 0.5, 1.25), ("F0", 2.0, 3.0)]
    assert t.t0 == 14.5


def test_use_device_picks_events_on_cuda_and_the_host_clock_on_cpu(monkeypatch):
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: FakeEvent(stream))
    t = Timers()
    t.use_device(torch.device("cuda", 0))
    assert isinstance(t.clock, DeviceClock)
    with t("attention"):
        stream.launch(0.002)  # kernels queued: host time ~0, device time 2 ms
    stream.synchronize()
    t.end_step()
    assert t.medians_ms() == {"attention": pytest.approx(2.0)}
    t.use_device(torch.device("cpu"))
    assert isinstance(t.clock, HostClock)


def fsdp_wait(work):
    sharded = object.__new__(fsdp_train.FullyShardedGPT)
    unit = SimpleNamespace(local_shard=SimpleNamespace(grad=torch.zeros(2)))
    sharded.pending = [(unit, torch.ones(2), None, work)]
    sharded.finish_backward()


def zero_reduce_wait(work):
    reduces = object.__new__(zero3_train.ReduceToOwner)
    grad = torch.zeros(2)
    reduces.reduces = collections.deque([(grad, work)])  # the window's queue, oldest first
    reduces.in_flight = grad.numel() * grad.element_size()
    reduces.finish_backward(True)  # the step's last micro-step
    assert reduces.in_flight == 0


WAITS = {  # each script's wait on its in-flight collectives, and the timer it is reported under
    "fsdp reduce-scatter": (fsdp_wait, "exposed_comm"),
    "zero2/3 reduce": (zero_reduce_wait, "reduce_wait"),
    "cp ring": (lambda work: cp_train.wait([work]), "exposed_comm"),
    "tp overlap": (lambda work: tp_overlap_train.wait([work]), "exposed_comm"),
}


@pytest.mark.parametrize("site", WAITS)
def test_every_scripts_nccl_wait_is_timed_on_the_stream(site, monkeypatch):
    wait_for, name = WAITS[site]
    stream = FakeStream()
    monkeypatch.setattr(timers, "clock", DeviceClock(event=lambda: FakeEvent(stream)))
    for attribute in ("steps", "marks", "t0"):  # restored after the test, as the clock
        monkeypatch.setattr(timers, attribute, getattr(timers, attribute))
    timers.steps = {}
    timers.start_step()
    stream.launch(0.002)
    wait_for(FakeWork(stream, done=0.009))  # the stream waits from 2 ms to 9 ms
    stream.synchronize()
    timers.end_step()
    assert timers.medians_ms() == {name: pytest.approx(7.0)}


def test_mfu_is_model_flops_over_the_known_peak(monkeypatch):
    """MFU in every log line: nanoGPT's FLOPs a token (6 a parameter without wpe, + 12 L C T) times tokens/s, over
    the datasheet peak of every rank's GPU for the run's matmul dtype (bf16, TF32, or fp32), None on a CPU."""
    from common.config import parse_args
    from common.metrics import MFU, flops_per_token, peak_flops
    from common.model import PRESETS
    gpt2 = PRESETS["gpt2"]
    per_token = 6 * (124475904 - 1024 * 768) + 12 * 12 * 768 * 1024  # GPT-2 124M (vocab 50304): nanoGPT's count
    assert flops_per_token(gpt2) == per_token
    args = parse_args("ddp", None, ["--preset", "gpt2", "--dtype", "bfloat16"])
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert peak_flops(cpu, args) is None and MFU(gpt2, args, cpu, 2)(1e5) is None
    for name, dtype, tf32, peak in [("NVIDIA H100 80GB HBM3", "bfloat16", True, 989e12),
                                    ("NVIDIA H100 80GB HBM3", "float32", True, 494.5e12),
                                    ("NVIDIA H100 PCIe", "float32", False, 51e12),
                                    ("NVIDIA A100-SXM4-80GB", "bfloat16", True, 312e12),
                                    ("NVIDIA H100 NVL", "bfloat16", True, 835e12),
                                    ("NVIDIA L40S", "float32", True, 183e12),
                                    ("NVIDIA L4", "bfloat16", True, 121e12),
                                    ("NVIDIA GeForce RTX 4090", "bfloat16", True, 165.2e12),
                                    ("Tesla T4", "bfloat16", True, None)]:  # not in the table
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        args.dtype, args.tf32 = dtype, tf32
        assert peak_flops(gpu, args) == peak, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    args.dtype = "bfloat16"
    mfu = MFU(gpt2, args, gpu, world_size=8)  # 8 H100s at 1M tokens/s: 855 TFLOP/s of 7.9 PFLOP/s
    assert mfu(1e6) == pytest.approx(1e6 * per_token / (8 * 989e12))
