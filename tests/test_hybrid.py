"""hybrid_train.py: the grid without a model, bad grids, every gradient of one step at dp 2 x tp 2 against one
process, and the ledgers (model state and the bytes each axis moves) on 8 ranks. Parity with single-process
training, at 4 and 8 ranks, custom and PyTorch's, and the checkpoint resumed at another grid: tests/test_parity.py
(test_hybrid_parity)."""
import itertools
import math
import os

import pytest
import torch
import torch.distributed as dist

import plan
import plan_report
from conftest import TINY, refusal, spawn
from hybrid_train import (AXES, GROUPS, Hybrid, add_hybrid_flags, axis_groups, check_hybrid_args, grid_error,
                          rank_grid, shard, tied_pairs)
from common.config import gpt_config, parse_args
from common.data import get_batch
from common.distributed import BEFORE_2_13, torch_name
from common.metrics import model_state_bytes
from common.model import GPT

SHAPES = [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1), (2, 2, 2, 2), (3, 1, 2, 2), (1, 4, 1, 2), (2, 3, 1, 1)]


def expected_rank(d, s, c, t, pp, cp, tp):
    return ((d * pp + s) * cp + c) * tp + t  # view(dp, pp, cp, tp): TP fastest-varying


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_every_rank_has_its_coordinates_and_groups(shape):
    dp, pp, cp, tp = shape
    grid = rank_grid(*shape)
    coords = {}
    for d, s, c, t in itertools.product(range(dp), range(pp), range(cp), range(tp)):
        rank = expected_rank(d, s, c, t, pp, cp, tp)
        assert int(grid[d, s, c, t]) == rank
        coords[rank] = dict(dp=d, pp=s, cp=c, tp=t)
    assert sorted(coords) == list(range(math.prod(shape)))
    for axes in GROUPS:
        groups = axis_groups(grid, axes)
        assert sorted(r for g in groups for r in g) == list(range(math.prod(shape)))  # a partition
        for group in groups:
            assert len(group) == math.prod(grid.shape[AXES.index(a)] for a in axes)
            assert group == sorted(group)  # in grid order: group rank i is the i-th along the axes
            first = coords[group[0]]
            for rank in range(math.prod(shape)):  # members: the ranks equal to it off the group's axes
                same = all(coords[rank][a] == first[a] for a in AXES if a not in axes)
                assert (rank in group) == same, (axes, group, rank)
    for first, last in tied_pairs(grid):  # the two ends of one (dp, cp, tp) place
        a, b = coords[first], coords[last]
        assert (a["pp"], b["pp"]) == (0, pp - 1)
        assert all(a[x] == b[x] for x in ("dp", "cp", "tp"))
    assert len(tied_pairs(grid)) == dp * cp * tp


BAD_GRIDS = [
    (8, dict(dp=None, tp=3, pp=None, cp=None), "--data_parallel_size: 2 x --tensor_parallel_size 3"),
    (8, dict(dp=4, tp=2, pp=2, cp=None), "must equal the world size (8)"),
    (4, dict(dp=None, tp=0, pp=None, cp=None), "--tensor_parallel_size: must be > 0, got 0"),
    (4, dict(dp=None, tp=None, pp=-1, cp=None), "--pipeline_parallel_size: must be > 0"),
    (4, dict(dp=None, tp=2, pp=2, cp=2), "--data_parallel_size: 0 x"),
]


@pytest.mark.parametrize("world_size,sizes,message", BAD_GRIDS)
def test_bad_grid_is_one_line(world_size, sizes, message):
    error = grid_error(sizes, world_size)
    assert error is not None and message in error and "\n" not in error, error


def test_good_grids_pass():
    for shape in SHAPES:
        assert grid_error(dict(zip(AXES, shape)), math.prod(shape)) is None
    assert grid_error(dict(dp=None, tp=2, pp=None, cp=None), 8) is None  # dp: what is left


BAD_INPUT = [
    (4, ["--tensor_parallel_size", "2", "--pipeline_parallel_size", "3"], "--data_parallel_size"),
    (4, ["--tensor_parallel_size", "2", "--n_head", "3", "--n_embd", "48"], "--n_head"),
    (2, ["--pipeline_parallel_size", "2", "--n_layer", "3"], "--n_layer"),
    (2, ["--context_parallel_size", "2", "--block_size", "30"], "--block_size"),
    (8, ["--context_parallel_size", "2", "--tensor_parallel_size", "4", "--sequence_parallel",
         "--block_size", "36"], "--block_size"),
    (2, ["--tensor_parallel_size", "2", "--dropout", "0.1"], "--dropout"),
    (2, ["--data_parallel_size", "2", "--n_microbatches", "8"], "--batch_size"),
    (1, ["--n_microbatches", "0"], "--n_microbatches"),
    (4, ["--implementation", "pytorch", "--context_parallel_size", "2"], "--context_parallel_size"),  # CUDA only
]


@pytest.mark.parametrize("nproc,flags,named", BAD_INPUT, ids=[" ".join(f) + f"-{n}r" for n, f, _ in BAD_INPUT])
def test_bad_input(nproc, flags, named, tmp_path, monkeypatch, capsys):
    line = refusal("hybrid_train.py", nproc, TINY + ["--max_iters", "2", "--out_dir", str(tmp_path)] + flags,
                   monkeypatch, capsys)
    assert named in line, line


# ---- the gradients: one optimizer step of the real Hybrid at dp 2 x tp 2, against one process ------------------

# 2 micro-steps of 2 micro-batches: the loss scale 1/(M*A*dp*cp) has every factor but cp's (1 here) at 2
GRADIENT_FLAGS = TINY + ["--device", "cpu", "--data_parallel_size", "2", "--tensor_parallel_size", "2",
                         "--grad_accum_steps", "2", "--n_microbatches", "2"]  # cpu: fp32 by default


def _gradients(rank, world_size):
    return {sp: _gradients_vs_one_process(rank, world_size, sp) for sp in (False, True)}


def _gradients_vs_one_process(rank, world_size, sequence_parallel):
    """Hybrid.forward_backward on this rank's rows in A micro-steps, as main() splits the batch; returns the largest
    difference of each of this rank's gradients from its slice (shard()) of one process's gradient on the whole
    batch, and the strategy's global norm beside one process's."""
    args = parse_args("hybrid", add_hybrid_flags, GRADIENT_FLAGS + ["--sequence_parallel", str(sequence_parallel)])
    D = check_hybrid_args(args, world_size)
    config = gpt_config(args)
    strategy = Hybrid(config, args, torch.device("cpu"))
    B, A = args.batch_size, args.grad_accum_steps
    x, y = get_batch("train", 0, B, args.block_size, args.seed)
    dp_rank, rows = rank * D // world_size, B // D
    micro = rows // A
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    for j in range(A):
        part = slice(mine.start + j * micro, mine.start + (j + 1) * micro)
        strategy.forward_backward(x[part], y[part], sync=j == A - 1)
    norm = strategy.clip_grad_norm_(0).item()  # 0: measure only

    reference = GPT(config, seed=args.seed)
    reference(x, y)[1].backward()
    full = dict(reference.named_parameters())  # the tied wte/lm_head once
    tp = strategy.tp
    diffs, whole = {}, {}
    for name, p in strategy.model.named_parameters():
        expected = shard(name, full[name].grad, tp.rank, tp.size)
        diffs[name] = (p.grad - expected).abs().max().item()
        whole[name] = torch.equal(strategy.full_tensor(name, p.detach()), full[name].detach())  # the checkpoint's
    ref_norm = torch.stack([p.grad.square().sum() for p in full.values()]).sum().sqrt().item()
    return diffs, sorted(full), norm, ref_norm, whole


@pytest.fixture(scope="module")
def gradients():
    return spawn(_gradients, 4)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sequence_parallel"])
def test_gradients_equal_one_process(gradients, sequence_parallel):
    """Every rank holds its TP slice of every gradient of one process on the whole batch (the tied wte/lm_head: its
    vocabulary rows of both paths' sum): the dp x cp sum, with SP the replicated parameters' TP sum. A gradient off
    by a factor of the loss scale's M*A*dp*cp fails here, as the losses of a clipped AdamW run cannot. And
    full_tensor(), which the checkpoint gathers with, gives back every whole parameter (c_attn's q, k, v in order)."""
    for rank, r in enumerate(gradients):
        diffs, names, norm, ref_norm, whole = r[sequence_parallel]
        assert all(whole.values()), (rank, [name for name, same in whole.items() if not same])
        assert sorted(diffs) == names, (rank, sorted(diffs))  # a single stage: every gradient, nothing more
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= 1e-6, (rank, worst, diffs[worst])
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (rank, norm, ref_norm)


def _ring(rank, world_size, T=24, B=2, H=2, D=8):
    """hybrid's RingAttention at cp = world_size (zigzag), by the fp32 math and by the flash kernel (common.flash
    forced on: the CPU's, in fp32), against full causal SDPA on this rank's positions: the largest relative
    difference of out, dq, dk, dv for each."""
    from common import flash
    from hybrid_train import CPGroup, RingAttention
    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v, dout = (torch.randn(B, H, T, D) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True)
    out.backward(dout)
    cp = CPGroup(dist.group.WORLD, T, torch.device("cpu"))
    diffs = {}
    for fused in (False, True):
        flash.FUSED = fused
        local = [t[:, :, cp.positions].clone().requires_grad_() for t in (q, k, v)]
        y = RingAttention.apply(*local, cp)
        y.backward(dout[:, :, cp.positions])
        flash.FUSED = None
        got = [y] + [t.grad for t in local]
        expected = [out.detach()] + [t.grad for t in full]
        diffs[fused] = max(((a - b[:, :, cp.positions]).abs().max() / b[:, :, cp.positions].abs().max()).item()
                           for a, b in zip(got, expected))
    return diffs


@pytest.mark.parametrize("cp", [2, 3])
def test_ring_attention_math_and_flash_kernel_equal_full_attention(cp):
    """The CP ring inside hybrid's TP heads takes cp_train.py's two block paths: the fp32 math, and on CUDA in bf16
    the flash kernel (common/flash.py), checked here with the CPU's flash kernel in fp32. Tolerance 2e-6, as
    tests/test_cp.py's for the same blocks."""
    for rank, diffs in enumerate(spawn(_ring, cp)):
        assert max(diffs.values()) <= 2e-6, (cp, rank, diffs)


# ---- the ledgers: per rank, one micro-step of the real Hybrid at tp 2 x pp 2 x cp 2 ------------------------

LEDGER_FLAGS = TINY + ["--tensor_parallel_size", "2", "--pipeline_parallel_size", "2", "--context_parallel_size", "2",
                       "--n_microbatches", "2", "--max_iters", "1"]


def ledger_flags(sequence_parallel):
    return LEDGER_FLAGS + ["--sequence_parallel", str(sequence_parallel)]


def _ledgers(rank, world_size):
    """_ledger without and with SP, on one set of ranks."""
    return [_ledger(world_size, sequence_parallel) for sequence_parallel in (False, True)]


def _ledger(world_size, sequence_parallel):
    """The numbers each collective of one micro-step (and one optimizer step) moved, by the axis of its group, and
    this rank's model-state bytes."""
    os.environ["WORLD_SIZE"] = str(world_size)
    import hybrid_train
    args = parse_args("hybrid", add_hybrid_flags, ledger_flags(sequence_parallel))
    check_hybrid_args(args, world_size)
    config = gpt_config(args)
    model = hybrid_train.Hybrid(config, args, torch.device("cpu"))
    optimizer = model.configure_optimizer(args)
    axis_of = {id(group): name for name, group in model.grid.groups.items()}
    axis_of[id(model.grid.tied_group)] = "pp ends"
    moved = []  # (axis, op, numel of the tensor the rank passes in)

    def counting(name, function):
        def call(tensor, *args, **kwargs):
            if name == "batch_isend_irecv":
                moved.extend((axis_of[id(op.group)], "send", op.tensor.numel()) for op in tensor if op.op is dist.isend)
            else:
                source = args[0] if name in BEFORE_2_13 else tensor  # a gather's or scatter's input
                moved.append((axis_of[id(kwargs["group"])], name, source.numel()))
            return function(tensor, *args, **kwargs)
        return call

    names = ["all_reduce", "batch_isend_irecv", *BEFORE_2_13]
    originals = {name: getattr(dist, torch_name(name)) for name in names}
    for name in names:
        setattr(dist, torch_name(name), counting(name, originals[name]))
    try:
        x, y = get_batch("train", 0, args.batch_size, args.block_size, args.seed)
        model.forward_backward(x, y, sync=True)
    finally:
        for name in names:
            setattr(dist, torch_name(name), originals[name])
    optimizer.step()
    place = dict(model.grid.coords, first=model.model.first, last=model.model.last)
    return place, moved, model_state_bytes(optimizer)


@pytest.fixture(scope="module")
def ledgers():
    ranks = spawn(_ledgers, 8)
    return {sp: [rank[sp] for rank in ranks] for sp in (False, True)}


@pytest.fixture(params=[False, True], ids=["plain", "sequence_parallel"])
def ledger(request, ledgers):
    return request.param, ledgers[request.param]


def test_model_state_is_16_bytes_a_parameter_of_this_ranks_shard_of_its_stage(ledger):
    sp, ranks = ledger
    config = gpt_config(parse_args("hybrid", add_hybrid_flags, LEDGER_FLAGS))
    tp, pp, V, C = 2, 2, config.vocab_size, config.n_embd
    total = sum(p.numel() for p in GPT(config, device="meta").parameters())  # P: the tied wte/lm_head once
    planned = plan_report.per_rank(plan.plan("hybrid_train.py", 8, ledger_flags(sp)), 8, "model_state")
    for rank, (place, _, state_bytes) in enumerate(ranks):
        # plan.py's: its stage's TP shards, the replicated tensors, the head's copy; + AdamW's step a tensor
        assert state_bytes == planned[rank], (place, state_bytes, planned[rank])
        # against the ideal 16P/(tp*pp): the replicated small tensors and the head's copy are the excess
        excess = state_bytes - 16 * total / (tp * pp)
        assert 0 < excess <= 16 * (V * C / tp + total / (tp * pp) * 0.05), (place, excess)


def test_collective_bytes_per_axis_follow_the_docstring(ledger):
    sp, ranks = ledger
    config = gpt_config(parse_args("hybrid", add_hybrid_flags, LEDGER_FLAGS))
    tp, pp, cp, M = 2, 2, 2, 2
    C, V, L = config.n_embd, config.vocab_size, config.n_layer // pp
    b, Tc = 8 // M, config.block_size // cp  # rows a micro-batch (dp 1, one micro-step); positions a CP rank
    act = b * Tc * C  # one activation at my CP positions, whole over TP
    planned = plan_report.per_rank(plan.plan("hybrid_train.py", 8, ledger_flags(sp)), 8, "comm")
    for rank, (place, moved, _) in enumerate(ranks):
        first, last = place["first"], place["last"]
        by_axis = {}
        for axis, op, numel in moved:
            by_axis.setdefault(axis, []).append((op, numel))
        tp_ops = sorted(by_axis["tp"])
        n_pairs = M * (4 * L + first + last)  # f and g: 4 a block, the embedding's g, the head's f
        loss = M * last * [("all_reduce", b * Tc), ("all_reduce", 2 * b * Tc)]  # the max; sums of exp, targets
        if sp:  # each f or g an all-gather of a sequence shard or a reduce-scatter of the whole: the same bytes
            replicated = [op for op in by_axis["tp"] if op[0] == "all_reduce" and op not in loss]
            assert len(replicated) == 1  # the replicated parameters' partial gradients, summed once
            expected = n_pairs * [("all_gather_single", act // tp), ("reduce_scatter_single", act)] + loss
            assert tp_ops == sorted(expected + replicated), place
        else:
            assert tp_ops == sorted(n_pairs * [("all_reduce", act)] + loss), place
        # cp: per block and micro-batch, cp-1 ring sends of my heads' K, V forward, cp-1 backward, and cp of the dK, dV
        # accumulators (each block's from its rank round the ring and home)
        assert by_axis["cp"] == M * L * (3 * cp - 2) * [("send", 2 * act // tp)], place
        # pp: one activation to the next stage and one gradient to the one before, per micro-batch
        message = act // tp if sp else act
        assert by_axis["pp"] == M * (int(not last) + int(not first)) * [("send", message)], place
        # dp x cp: the stage's gradients once; pp ends: the tied wte/lm_head rows once
        assert [op for op, _ in by_axis["dpxcp"]] == ["all_reduce"]
        assert by_axis["pp ends"] == [("all_reduce", V // tp * C)], place
        assert "ppxtp" not in by_axis  # the norm's group: not in a micro-step
        # plan.py's bytes by collective and group (fp32: 4 a number) are these calls', less the norm's
        totals = {}
        for axis, op, numel in moved:
            key = f"{op.removesuffix('_single')}@{'tied' if axis == 'pp ends' else axis}"
            totals[key] = totals.get(key, 0) + 4 * numel
        assert totals == {k: v for k, v in planned[rank].items() if k != "all_reduce@ppxtp"}, place
