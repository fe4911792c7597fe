"""The step's batch is ready before the step needs it (common.data.Batches). That a training step syncs the host
with the device once, for the log line, is checked in tests/test_ops.py's runs."""
import pytest
import torch

from common.config import parse_args
from common.data import Batches, get_batch
from conftest import TINY


def _args(max_iters=6):
    return parse_args("ddp", None, TINY + ["--max_iters", str(max_iters)])


def test_batches_are_get_batch_rows_in_step_order_and_never_pinned_on_cpu(monkeypatch):
    """On CPU: no pinned memory (pin_memory() fails on a CPU-only torch), and get(step) is this rank's rows of
    get_batch(step), whether it was fetched ahead or not, for a run that starts at a resumed step."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda *a, **k: pytest.fail("pinned on a CPU"))
    args, rows = _args(), slice(2, 6)
    batches = Batches(args, rows, torch.device("cpu"))
    for step in range(3, args.max_iters):  # resumed at step 3: nothing was fetched ahead of it
        x, y = batches.get(step)
        want_x, want_y = get_batch("train", step, args.batch_size, args.block_size, args.seed)
        assert torch.equal(x, want_x[rows]) and torch.equal(y, want_y[rows])
        batches.prefetch(step + 1)
    assert batches.ahead is None  # nothing past the last step


class FakeCopy:
    """A CUDA event after a non_blocking copy that is still reading its pinned buffer until finish()."""
    log = []

    def __init__(self):
        self.done = False

    def record(self):
        FakeCopy.log.append(("record", self))

    def query(self):
        return self.done

    def synchronize(self):
        FakeCopy.log.append(("synchronize", self))
        self.done = True


def test_batches_on_cuda_pin_copy_non_blocking_and_never_overwrite_a_buffer_in_flight(monkeypatch):
    """CUDA (faked): each batch goes through one of two pinned buffers and a non_blocking copy followed by an
    event; a buffer is written again only after its copy's event has passed (a wait when it has not: never
    in a loop, where the step's sync comes first), and get() returns the same rows as on CPU."""
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t)
    copies = []

    def copy_to_device(buffer):  # the device copy sees the buffer's bytes when the fake copy finishes
        copies.append((buffer, buffer.clone()))
        return buffer.clone()
    args, rows = _args(), slice(0, 4)
    batches = Batches(args, rows, torch.device("cuda"), event=FakeCopy)
    batches.copy_to_device = copy_to_device
    FakeCopy.log.clear()
    for step in range(args.max_iters):
        x, y = batches.get(step)
        want_x, want_y = get_batch("train", step, args.batch_size, args.block_size, args.seed)
        assert torch.equal(x, want_x[rows]) and torch.equal(y, want_y[rows])
        if step == 2:  # the copy into slot 1 (step 3's buffer) is still in flight: the host must wait
            batches.copies[1].done = False
            in_flight = batches.copies[1]
        batches.prefetch(step + 1)
        if step == 2:
            assert ("synchronize", in_flight) in FakeCopy.log  # waited, then wrote
            assert FakeCopy.log.index(("synchronize", in_flight)) < len(FakeCopy.log) - 1
        for event in batches.copies:
            if event is not None:
                event.done = True  # the step's host sync: every queued copy has run
    assert len(pinned) == 2 and all(b.dtype == torch.int64 for b in pinned)  # two buffers, made once
    assert len(copies) == args.max_iters and {id(b) for b, _ in copies} == {id(b) for b in batches.buffers}
    assert sum(kind == "synchronize" for kind, _ in FakeCopy.log) == 1  # only where a copy was in flight
    for step, (_, seen) in enumerate(copies):  # what each copy read: that step's batch, unchanged
        want_x, want_y = get_batch("train", step, args.batch_size, args.block_size, args.seed)
        assert torch.equal(seen[0], want_x[rows]) and torch.equal(seen[1], want_y[rows])
