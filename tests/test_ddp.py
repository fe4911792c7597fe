"""ddp_train.py: the strategy's gradients equal to one process and to torch DDP, buckets, overlap bookkeeping,
no_sync, the single-process contract.
(Bad input for every script: tests/test_reliability.py.)"""
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from conftest import TINY, DeviceMemory, cpu_copies_only, launch, probe, read_metrics, spawn
from common.config import parse_args
from common.data import get_batch
from common.distributed import all_gather_single
from common.model import GPT, GPTConfig, configure_optimizer
from cp_train import ContextParallel
from ddp_train import DDP, GradientBuckets, add_ddp_flags

CONFIG = GPTConfig(block_size=16, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
CAP_MB = 0.05  # small enough for several buckets in CONFIG


def _rows(rank, world_size, batch=8, step=0):
    x, y = get_batch("train", step, batch, CONFIG.block_size, seed=0)
    n = batch // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _strategy(accum):
    """ddp_train.py's strategy for CONFIG (seed 0), as main() builds it."""
    args = parse_args("ddp", add_ddp_flags, ["--device", "cpu", "--seed", "0", "--bucket_cap_mb", str(CAP_MB),
                                              "--grad_accum_steps", str(accum)])  # cpu: fp32 by default
    return DDP(CONFIG, args, torch.device("cpu"))


def _train_custom(strategy, x, y):
    """One optimizer step's micro-steps on this rank's rows, through the strategy's own forward_backward (its
    loss scaling and its buckets), as main() runs them."""
    accum = strategy.args.grad_accum_steps
    micro = x.size(0) // accum
    for j in range(accum):
        strategy.forward_backward(x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro], sync=j == accum - 1)


def _one_process_grads(batch=8):
    """The gradients of one process: the whole model, the whole global batch that _rows() splits, one backward."""
    reference = GPT(CONFIG, seed=0)
    reference(*get_batch("train", 0, batch, CONFIG.block_size, seed=0))[1].backward()
    return [p.grad for p in reference.parameters()]


def _custom_vs_torch_ddp(rank, world_size, accum):
    x, y = _rows(rank, world_size)
    strategy = _strategy(accum)
    custom = strategy.model
    # identical init on every rank, without a broadcast: gather every rank's weights and compare
    flat = torch.cat([p.detach().flatten() for p in custom.parameters()])
    gathered = torch.empty(world_size * flat.numel())
    all_gather_single(gathered, flat)
    same_init = all(torch.equal(chunk, flat) for chunk in gathered.chunk(world_size))
    _train_custom(strategy, x, y)
    one_process = max((p.grad - g).abs().max().item() for p, g in zip(custom.parameters(), _one_process_grads()))

    reference = DistributedDataParallel(GPT(CONFIG, seed=0), bucket_cap_mb=CAP_MB)
    micro = x.size(0) // accum
    for j in range(accum):
        with reference.no_sync() if j < accum - 1 else nullcontext():
            _, loss = reference(x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro])
            (loss / accum).backward()
    diff = max((p.grad - q.grad).abs().max().item()
               for p, q in zip(custom.parameters(), reference.module.parameters()))
    buckets = strategy.buckets
    in_buffers = all(any(b.buffer.data_ptr() <= p.grad.data_ptr() < b.buffer.data_ptr() + b.buffer.numel() * 4
                         for b in buckets.buckets) for p in custom.parameters())
    return same_init, one_process, diff, in_buffers, len(buckets.buckets)


def _all_checks(rank, world_size):
    """Every 2-rank check of this file on one spawn (each spawn costs seconds of start-up)."""
    return {"vs_torch_ddp": {accum: _custom_vs_torch_ddp(rank, world_size, accum) for accum in (1, 4)},
            "all_reduces": _count_all_reduces(rank, world_size, 3),
            "accumulation": _accumulation_equals_full_batch(rank, world_size),
            "unused": _unused_parameter(rank, world_size),
            "rebuilt": _rebuilt_in_ready_order(rank, world_size)}


def _rebuilt_in_ready_order(rank, world_size):
    model = GPT(CONFIG, seed=0)
    names = {p: n for n, p in model.named_parameters()}
    buckets = GradientBuckets(model, CAP_MB)
    first = [names[p] for b in buckets.buckets for p in b.params]
    ready = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: ready.append(names[p]))
    x, y = _rows(rank, world_size)
    _, loss = model(x, y)
    (loss / world_size).backward()
    if rank == 1:  # another autograd order on one rank: every rank must still build rank 0's buckets
        buckets.ready_order.reverse()
    buckets.finish_backward()
    after = [names[p] for b in buckets.buckets for p in b.params]
    plain = GPT(CONFIG, seed=0)  # what the buckets must have produced: each gradient's mean over ranks
    plain(x, y)[1].backward()
    expected = [p.grad for p in plain.parameters()]
    for g in expected:
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
    kept = all(torch.equal(a, p.grad) for a, p in zip(expected, model.parameters()))
    in_buffers = all(any(b.buffer.data_ptr() <= p.grad.data_ptr() < b.buffer.data_ptr() + b.buffer.numel() * 4
                         for b in buckets.buckets) for p in model.parameters())
    return first, ready, after, kept, in_buffers


@pytest.fixture(scope="module")
def ranks():
    return spawn(_all_checks, 2)


@pytest.mark.parametrize("accum", [1, 4])
def test_custom_gradients_equal_one_process_and_torch_ddp(accum, ranks):
    """DDP.forward_backward on each rank's rows (A micro-steps): every gradient equals one process's on the whole
    batch, and torch DDP's. A gradient N or A times off (the loss divided by A only, or by N only) fails here."""
    for same_init, one_process, diff, in_buffers, n_buckets in (r["vs_torch_ddp"][accum] for r in ranks):
        assert same_init, "ranks must start from identical weights"
        assert one_process <= 1e-6, one_process
        assert diff <= 1e-6, diff
        assert in_buffers, "after backward every .grad must still be a view into its bucket"
        assert n_buckets > 2


def _count_all_reduces(rank, world_size, accum):
    model = GPT(CONFIG, seed=0)
    buckets = GradientBuckets(model, CAP_MB)
    calls, original = [], dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        x, y = _rows(rank, world_size)
        micro = x.size(0) // accum
        per_micro_step = []
        for j in range(accum):
            buckets.require_sync = j == accum - 1
            _, loss = model(x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro])
            (loss / accum).backward()
            launched_in_backward = len(calls)  # before the wait: fired from the hooks, i.e. overlapped
            buckets.finish_backward()
            per_micro_step.append((launched_in_backward, list(calls)))
            calls.clear()
    finally:
        dist.all_reduce = original
    return per_micro_step, [b.buffer.numel() for b in buckets.buckets]


def test_all_reduce_count_per_step_is_bucket_count_and_zero_on_no_sync_micro_steps(ranks):
    for per_micro_step, bucket_sizes in (r["all_reduces"] for r in ranks):  # 3 micro-steps
        assert [len(calls) for _, calls in per_micro_step] == [0, 0, len(bucket_sizes)]
        launched_in_backward, calls = per_micro_step[-1]
        assert launched_in_backward == len(bucket_sizes), "every bucket must be launched from a hook, during backward"
        # buckets go on the wire in index order (the same order on every rank); after the first
        # backward they follow the ready order, so the tied wte/lm_head, complete only once the
        # embedding lookup's backward (the last op) has run, is the last bucket
        assert calls == bucket_sizes
        assert calls[-1] == 50304 * 32 and 50304 * 32 not in calls[:-1]


def _accumulation_equals_full_batch(rank, world_size):
    x, y = _rows(rank, world_size, batch=16)
    grads = []
    for accum in (1, 4):
        strategy = _strategy(accum)
        _train_custom(strategy, x, y)
        grads.append([p.grad.clone() for p in strategy.model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


def test_buckets_are_rebuilt_in_rank_0s_ready_order_after_the_first_backward(ranks):
    (first, ready0, after0, kept0, in0), (_, _, after1, kept1, in1) = (r["rebuilt"] for r in ranks)
    assert after0 == after1 == ready0 != first  # rank 1's order was reversed: rank 0's wins
    assert ready0[-1] == "transformer.wte.weight"  # the tied weight is complete last
    assert in0 and in1, "after the rebuild every .grad must be a view into its new bucket"
    assert kept0 and kept1, "the reduced gradients must move into the new buffers"


def test_gradient_accumulation_equals_one_full_batch_step(ranks):
    assert max(r["accumulation"] for r in ranks) <= 1e-6


def _unused_parameter(rank, world_size):
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(4, 4)
            self.unused = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x).sum()

    torch.manual_seed(0)
    model = TwoHeads()
    buckets = GradientBuckets(model, bucket_cap_mb=1e-5)  # one bucket per tensor
    x = torch.full((2, 4), float(rank + 1))
    (model(x) / world_size).backward()
    buckets.finish_backward()  # must not hang on the buckets whose gradients never arrive
    return model.used.weight.grad.clone(), model.unused.weight.grad.clone()


def test_unused_parameters_get_zero_gradient_and_no_hang(ranks):
    (used0, unused0), (used1, _) = (r["unused"] for r in ranks)
    assert torch.equal(unused0, torch.zeros(4, 4))
    assert torch.allclose(used0, torch.full((4, 4), 3.0))  # mean over ranks of 2 rows of 1s and 2 rows of 2s
    assert torch.equal(used0, used1)


def test_compile_default_is_off_where_torch_ddp_refuses_it():
    """torch DDP with buckets under dynamo's first one (1 MiB) refuses --compile (test_reliability's BAD): there
    the default (None: on with CUDA) turns off; elsewhere it stays for common.distributed.setup to resolve."""
    from common.config import parse_args
    from ddp_train import add_ddp_flags, check_ddp_args
    for implementation, cap, resolved in (("pytorch", "0.5", False), ("pytorch", "1", None), ("custom", "0.5", None)):
        args = parse_args("ddp", add_ddp_flags, TINY + ["--implementation", implementation, "--bucket_cap_mb", cap])
        check_ddp_args(args, 2)
        assert args.compile is resolved, (implementation, cap)


def test_bucket_layout_for_a_cap():
    model = GPT(CONFIG, seed=0)
    params = list(model.parameters())[::-1]
    cap = int(CAP_MB * 2**20)
    buckets = GradientBuckets(model, CAP_MB).buckets
    assert [p for b in buckets for p in b.params] == params  # reverse registration order, each once
    for i, b in enumerate(buckets):
        nbytes = b.buffer.numel() * 4
        assert nbytes == sum(p.numel() * 4 for p in b.params)
        assert nbytes <= cap or len(b.params) == 1  # only a tensor larger than the cap overflows it
        if i + 1 < len(buckets):  # greedy: the next tensor did not fit
            assert nbytes + buckets[i + 1].params[0].numel() * 4 > cap
    sizes = [b.buffer.numel() for b in buckets]
    # cap = 13107 fp32 values; a block holds 12704. Worked by hand: [ln_f + block 1 + block 0's
    # mlp.c_proj.bias], [the rest of block 0], [wpe], [wte, which also carries the tied head, alone]
    assert sizes == [64 + 12704 + 32, 12704 - 32, 16 * 32, 50304 * 32]
    assert len(GradientBuckets(GPT(CONFIG, seed=0), 1e-9).buckets) == len(params)
    assert len(GradientBuckets(GPT(CONFIG, seed=0), 1000).buckets) == 1


@pytest.mark.parametrize("strategy", [DDP, ContextParallel], ids=["ddp", "cp"])  # cp's full_state: ddp's text
def test_checkpoint_state_is_rank_0s_cpu_copy_one_tensor_at_a_time(strategy, monkeypatch):
    """full_state on a GPU (modelled: DeviceMemory): rank 0 copies each tensor straight into its CPU memory, so the
    device holds nothing more; the other ranks return nothing and copy nothing (they cloned the whole AdamW state
    on their device, 8P bytes, and dropped it)."""
    model = GPT(CONFIG, seed=0)
    optimizer = configure_optimizer(model.named_parameters(), 0.1, 1e-3, (0.9, 0.95))
    x, y = get_batch("train", 0, 2, CONFIG.block_size, seed=0)
    model(x, y)[1].backward()
    optimizer.step()
    for rank in (1, 0):
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        with DeviceMemory() as memory:
            state, optim = strategy.full_state(SimpleNamespace(model=model), optimizer)
        assert memory.peak == 0, f"rank {rank} held {memory.peak:,} B more on its device"
        assert rank == 0 or (state, optim) == (None, None)
    assert cpu_copies_only(memory, state, optim)
    assert state["lm_head.weight"] is state["transformer.wte.weight"]  # tied: one copy, as in the model
    assert all(torch.equal(state[n], v) for n, v in model.state_dict().items())
    named = dict(model.named_parameters())
    assert all(torch.equal(optim[n][k], v) for n, s in optim.items() for k, v in optimizer.state[named[n]].items())
    assert len(optim) == len(named)


def test_single_process_run_writes_the_contract(tmp_path):
    result = launch("ddp_train.py", None, TINY + ["--max_iters", "3", "--eval_interval", "2", "--eval_iters", "1",
                                                  "--out_dir", str(tmp_path), "--tensorboard", "true"])
    assert result.returncode == 0, result.stderr
    records = read_metrics(tmp_path)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(set(r) == {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_ms", "peak_mem_bytes", "mfu"}
               for r in steps)
    assert all(r["mfu"] is None for r in steps)  # a CPU: no known peak (tests/test_metrics.py: the GPUs')
    assert sum("mfu -" in line for line in result.stdout.splitlines() if line.startswith("iter ")) == 3
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 3] and all("loss" not in r and "train_loss" in r for r in evals)
    summary = records[-1]
    params = list(GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, bias=True), device="meta").parameters())
    # params + grads + AdamW exp_avg and exp_avg_sq (4 bytes each per element) + AdamW's fp32 step per tensor
    assert summary["model_state_bytes"] == 16 * sum(p.numel() for p in params) + 4 * len(params)
    assert summary["summary"] is True and summary["peak_mem_bytes"] > 0 and summary["tokens_per_sec"] > 0
    assert summary["mfu"] is None  # at the median tokens/s: none on a CPU
    # the summary's peak is the training's, measured at the last step; the final checkpoint's apart, after it
    assert summary["peak_mem_bytes"] == steps[-1]["peak_mem_bytes"]
    assert summary["checkpoint_peak_mem_bytes_per_rank"][0] >= summary["peak_mem_bytes"]
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 3 and "transformer.wte.weight" in ckpt["optimizer"]
    model = GPT(GPTConfig(**ckpt["config"]), device="meta")
    model.load_state_dict(ckpt["model"], assign=True)
    model.tie_weights()
    # The checkpoint is the model evaluated after the last step: its loss on the eval batch is the logged one.
    x, y = get_batch("val", 0, 8, 32, 1337 + 1)
    with torch.no_grad():
        assert model.eval()(x, y)[1].item() == pytest.approx(evals[-1]["val_loss"], abs=1e-6)


@pytest.mark.parametrize("implementation", ["custom", "pytorch"])
def test_each_rank_trains_its_own_rows_on_a_bit_identical_replica(implementation, tmp_path):
    """The real main() at 2 ranks, 2 micro-steps (tests/probe.py): the micro-steps of rank r are rows
    [r B/N, (r+1) B/N) of the global batch, B / N / A rows each, and before every forward the two
    replicas are bit-identical."""
    ranks = probe("ddp_train.py", 2, [*TINY, "--max_iters", "3", "--grad_accum_steps", "2",
                                      "--implementation", implementation, "--out_dir", str(tmp_path)], tmp_path)
    assert [r["train_rows"] for r in ranks] == [[8 // 2 // 2] * 3 * 2] * 2
    for step in range(3):
        x, _ = get_batch("train", step, 8, 32, 1337)
        assert sum((r["train_x"][2 * step] + r["train_x"][2 * step + 1] for r in ranks), []) == x.tolist()
    assert ranks[0]["digests"] == ranks[1]["digests"] and len(set(ranks[0]["digests"])) == 3  # changed by each step
