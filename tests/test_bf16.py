"""--dtype bfloat16 for every script, custom and pytorch, at 2 ranks: the loss tracks the fp32
single-process reference, and the custom strategies move what they say in bf16 (fsdp's all-gather of
parameters, zero3's broadcast of parameters, tp's all-reduce of activations, cp's ring of K/V), with gradients reduced
in fp32 everywhere.

Tolerance. bf16 keeps 8 significant bits, a relative rounding of 2^-9 = 0.2% per value. The weights,
gradients and AdamW state stay fp32; bf16 enters through the inputs of the matmuls and attention of
each forward and backward, and the loss is a mean over B*T = 256 tokens, over which those roundings
largely average out. Measured here (the parity config: 15 steps, 2 ranks, CPU; each run prints its
figure), the largest |loss_bf16 - loss_fp32| of the 10 runs was 6e-4 (fsdp and zero3), 1e-4 to 2e-4
for the others. TOL = 5e-3 is 8 times that, room for other CPUs' bf16 kernels, and far below what a
wrong strategy does: the loss falls by 0.17 a step on average here, so a step trained on the wrong
rows, shards or learning rate moves it by 1e-2 or more. What the loss cannot show (a sum of
gradients over ranks rounded to bf16 would differ by about 1e-4 at 2 ranks) the collective counts do,
and for ddp's and cp's buckets, whose all-reduce also carries the logged loss, what the buckets send.
"""
import pytest
import torch
import torch.distributed as dist

from conftest import PARITY, PARITY_STEPS, TINY, paired, peer_needs, probe_runs, runs_here, spawn, step_losses, worst
from common.config import gpt_config, parse_args
from common.data import get_batch
from cp_train import ContextParallel, add_cp_flags, check_cp_args
from ddp_train import DDP, add_ddp_flags, check_ddp_args

FLAGS = PARITY + ["--max_iters", str(PARITY_STEPS)]
TOL = 5e-3
RUNS = [(s, i) for s in ["ddp_train.py", "fsdp_train.py", "zero3_train.py", "tp_train.py", "pp_train.py"]
        for i in ("custom", "pytorch") if (s, i) != ("zero3_train.py", "pytorch")] + [("cp_train.py", "custom")]
# Not zero3's pytorch: it is FSDP2 with fsdp's MixedPrecisionPolicy, run as fsdp's. cp's pytorch: CUDA only.
# What each custom strategy must send in bf16: "collective:dtype" keys of tests/probe.py's counts.
BF16_TRAFFIC = {"fsdp_train.py": "all_gather_single:torch.bfloat16", "zero3_train.py": "broadcast:torch.bfloat16",
                "tp_train.py": "all_reduce:torch.bfloat16", "cp_train.py": "batch_isend_irecv:torch.bfloat16"}  # ring's K/V
# Gradients are reduced in fp32 by every script (no bf16 rounding of a sum over ranks): fsdp's and zero3's collectives
# here carry gradients only. ddp's and cp's all_reduce also carries the logged loss, an fp32 scalar, so a count of fp32
# all-reduces cannot see their buckets: none of theirs may be bf16, and test_buckets_all_reduce_every_gradient_in_fp32
# checks what the buckets send.
FP32_GRADIENTS = {"fsdp_train.py": "reduce_scatter_single:torch.float32", "zero3_train.py": "reduce:torch.float32"}
NO_BF16 = {"ddp_train.py": "all_reduce:torch.bfloat16", "cp_train.py": "all_reduce:torch.bfloat16"}


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    """Every row of RUNS that this torch runs, probed in one launch at 2 ranks: {(script, implementation): (its
    out_dir, its ranks' probe records)}."""
    rows = [row for row in RUNS if runs_here(*row, "bfloat16")]
    out_dirs = [tmp_path_factory.mktemp("bf16") for _ in rows]
    runs = [(script, [*FLAGS, "--dtype", "bfloat16", "--implementation", implementation, "--out_dir", str(out)])
            for (script, implementation), out in zip(rows, out_dirs)]
    return dict(zip(rows, zip(out_dirs, probe_runs(2, runs, tmp_path_factory.mktemp("probe")))))


@pytest.mark.parametrize("script,implementation", [pytest.param(*r, marks=peer_needs(*r, "bfloat16")) for r in RUNS],
                         ids=[f"{s[:-9]}-{i}" for s, i in RUNS])
def test_bf16_tracks_fp32_and_sends_bf16(script, implementation, references, bf16_runs):
    reference = references()[0]["loss"]  # test_parity.py's fp32 one-process reference: FLAGS
    out_dir, ranks = bf16_runs[(script, implementation)]
    losses = step_losses(out_dir)
    delta = worst(abs(a - b) for a, b in paired(losses, reference[:len(losses)], f"{script} bf16 losses"))
    print(f"{script} {implementation} bf16: max |loss - fp32 reference| over {len(losses)} steps = {delta:.4f}")
    assert len(losses) == PARITY_STEPS and delta <= TOL
    sent = [r["collectives"] for r in ranks]
    if implementation == "custom" and script in BF16_TRAFFIC:
        assert all(s.get(BF16_TRAFFIC[script], 0) > 0 for s in sent), sent
    if implementation == "custom" and script in FP32_GRADIENTS:
        assert all(s.get(FP32_GRADIENTS[script], 0) > 0 for s in sent), sent
    if implementation == "custom" and script in NO_BF16:
        assert all(s.get(NO_BF16[script], 0) == 0 for s in sent), sent
    if script == "ddp_train.py":  # the replicas stay bit-identical under bf16 too
        assert ranks[0]["digests"] and ranks[0]["digests"] == ranks[1]["digests"], ranks[0]["digests"]


# ---- what ddp's and cp's buckets send, in bf16 ------------------------------------------------------------

def _strategy(script, world_size):
    """ddp's or cp's strategy (cp over all ranks) in bf16 at the tiny config, as main() builds it; its DP size."""
    flags = TINY + ["--dtype", "bfloat16", "--grad_accum_steps", "2", "--bucket_cap_mb", "0.5"]
    if script == "ddp_train.py":
        args = parse_args("ddp", add_ddp_flags, flags)
        D = check_ddp_args(args, world_size)
        return DDP(gpt_config(args), args, torch.device("cpu")), D
    args = parse_args("cp", add_cp_flags, flags)
    D = check_cp_args(args, world_size)
    return ContextParallel(gpt_config(args), args, torch.device("cpu")), D


def _bucket_traffic(rank, world_size, script):
    """One optimizer step (2 micro-steps) of the strategy in bf16, with dist.all_reduce wrapped: per micro-step, the
    (dtype, numel) of each tensor handed to it; then the buckets' (dtype, numel), the gradients' dtypes and the
    number of gradient elements."""
    strategy, D = _strategy(script, world_size)
    args = strategy.args
    x, y = get_batch("train", 0, args.batch_size, args.block_size, args.seed)
    rows = args.batch_size // D
    micro = rows // args.grad_accum_steps
    start = rank * D // world_size * rows  # this rank's rows, as main() takes them
    calls, per_micro_step, original = [], [], dist.all_reduce

    def recording_all_reduce(tensor, *a, **kw):
        calls.append((str(tensor.dtype), tensor.numel()))
        return original(tensor, *a, **kw)

    dist.all_reduce = recording_all_reduce
    try:
        for j in range(args.grad_accum_steps):
            part = slice(start + j * micro, start + (j + 1) * micro)
            strategy.forward_backward(x[part], y[part], sync=j == args.grad_accum_steps - 1)
            per_micro_step.append(list(calls))
            calls.clear()
    finally:
        dist.all_reduce = original
    if script == "ddp_train.py":
        flats = [bucket.buffer for bucket in strategy.buckets.buckets]
    else:  # cp's buckets are their flat buffers
        flats = strategy.buckets.buffers
    buckets = [(str(flat.dtype), flat.numel()) for flat in flats]
    params = list(strategy.model.parameters())
    return per_micro_step, buckets, {str(p.grad.dtype) for p in params}, sum(p.numel() for p in params)


def _traffic(rank, world_size):
    return {script: _bucket_traffic(rank, world_size, script) for script in NO_BF16}


@pytest.fixture(scope="module")
def traffic():
    return spawn(_traffic, 2)


@pytest.mark.parametrize("script", list(NO_BF16), ids=[s[:-9] for s in NO_BF16])
def test_buckets_all_reduce_every_gradient_in_fp32(traffic, script):
    """Under --dtype bfloat16 the gradients stay fp32 and the buckets all-reduce them in fp32: on the syncing
    micro-step exactly the buckets go out, in order, each fp32, together every gradient element once; the first
    micro-step (no sync) sends nothing. A bucket sent in bf16 (a compressed all-reduce) fails here."""
    for per_micro_step, buckets, grad_dtypes, numel in (r[script] for r in traffic):
        assert per_micro_step[0] == [], per_micro_step[0]
        assert per_micro_step[1] == buckets, (per_micro_step[1], buckets)
        assert {dtype for dtype, _ in buckets} == {"torch.float32"} and len(buckets) > 1, buckets
        assert sum(n for _, n in buckets) == numel
        assert grad_dtypes == {"torch.float32"}, grad_dtypes
