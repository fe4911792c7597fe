"""fsdp_train.py: shards, gradients (tied weight, padding, accumulation), global norm, memory ledger,
gathered buffers freed between units, prefetch order, deferred init, checkpoint round trip, the sharded
checkpoint (a save that dies midway, mixed or mismatched sets), bad input (fsdp_hsdp_train.py's too)."""
import math
import os
import shutil
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import TINY, DeviceMemory, cpu_copies_only, launch, read_metrics, refusal, spawn, the_one_error
from common.config import gpt_config, parse_args
from common.data import get_batch
from common.distributed import all_gather_single, clip_grad_norm_, reduce_scatter_single, torch_name
from common.metrics import held_bytes
from common.model import GPT, GPTConfig, init_tensor
import common.sharded_checkpoint
import plan
import plan_report
from fsdp_train import FSDP, FlatParamUnit, FullyShardedGPT, ShardedAdamW, add_fsdp_flags, checkpoint, resume

CONFIG = GPTConfig(block_size=16, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
CONFIG_FLAGS = ["--block_size", "16", "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seed", "0",
                "--learning_rate", "1e-2"]  # CONFIG as flags (a sharded resume checks them)


def _sharded(config, rank, world_size, reshard=True, prefetch=True, deferred=False):
    model = GPT(config, seed=0, device="meta" if deferred else "cpu")
    keys = list(model.state_dict().keys())
    full = dict(model.named_parameters())
    value_of = (lambda n, s: init_tensor(n, s, config, 0)) if deferred else (lambda n, s: full[n].detach())
    fsdp = FullyShardedGPT(model, value_of, rank, world_size, torch.device("cpu"), torch.float32, reshard, prefetch)
    return model, fsdp, keys


def _strategy(flags=()):
    """fsdp_train.py's strategy object for CONFIG (seed 0), as main() builds it, and its optimizer."""
    args = parse_args("fsdp", add_fsdp_flags, [*CONFIG_FLAGS, *flags])
    strategy = FSDP(CONFIG, args, torch.device("cpu"))
    return strategy, strategy.configure_optimizer(args), args


def _gathered_bytes(fsdp):
    return sum(u.flat_param.untyped_storage().nbytes() for u in fsdp.units if u.flat_param is not None)


def _gather(shard):
    out = shard.new_empty(shard.numel() * dist.get_world_size())
    all_gather_single(out, shard.contiguous())
    return out


def _full_grads(fsdp):
    """{name: full gradient} from the reduce-scattered shards."""
    grads = {}
    for unit in fsdp.units:
        flat = _gather(unit.local_shard.grad)
        assert torch.all(flat[unit.numel:] == 0), "padding must carry no gradient"
        for (names, shape, _), piece in zip(unit.tensors, flat.split(unit.numels + [unit.padding])):
            grads[names[0]] = piece.view(shape)
    return grads


def _gradients_vs_reference(rank, world_size, accum):
    """FSDP.forward_backward on this rank's rows in `accum` micro-steps (its own loss scaling and reduce-scatters),
    against one process on the whole batch."""
    batch = 2 * world_size * accum
    x, y = get_batch("train", 0, batch, CONFIG.block_size, seed=0)
    rows = batch // world_size
    strategy, _, _ = _strategy(["--grad_accum_steps", str(accum)])
    xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    micro = rows // accum
    for j in range(accum):
        strategy.forward_backward(xs[j * micro:(j + 1) * micro], ys[j * micro:(j + 1) * micro], j == accum - 1)
    fsdp = strategy.sharded
    grads = _full_grads(fsdp)
    norm = strategy.clip_grad_norm_(0.0).item()  # 0: measure only

    reference = GPT(CONFIG, seed=0)  # the whole global batch in one process
    _, loss = reference(x, y)
    loss.backward()
    ref = dict(reference.named_parameters())
    ref_norm = torch.stack([(p.grad * p.grad).sum() for p in ref.values()]).sum().sqrt().item()
    diff = max((grads[n] - p.grad).abs().max().item() for n, p in ref.items())
    # untied copy: the head's and the lookup's gradients apart; the tied gradient must be their sum
    untied = GPT(CONFIG, seed=0)
    untied.lm_head.weight = torch.nn.Parameter(untied.transformer.wte.weight.detach().clone())
    untied(x, y)[1].backward()
    head, lookup = untied.lm_head.weight.grad, untied.transformer.wte.weight.grad
    wte = grads["transformer.wte.weight"]
    tied = ((wte - (head + lookup)).abs().max().item(), (wte - head).abs().max().item(), (wte - lookup).abs().max().item())
    return diff, tied, norm, ref_norm, [u.padding for u in fsdp.units]


# Starting gloo ranks costs seconds: each world size is spawned once per module, its checks below.
def _three_ranks(rank, world_size):
    return dict(gradients=_gradients_vs_reference(rank, world_size, 2), tiny=_tiny_unit(rank, world_size))


def _two_ranks(rank, world_size, path):
    return dict(ledgers=_ledgers(rank, world_size, LEDGER_RUNS), checkpoint=_checkpoint_round_trip(rank, world_size),
                sharded=_sharded_round_trip(rank, world_size, path))


@pytest.fixture(scope="module")
def three_ranks():
    return spawn(_three_ranks, 3)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    return spawn(_two_ranks, 2, str(path)), path


def test_gradients_tied_weight_and_global_norm_equal_the_reference(three_ranks):
    # 3 ranks pad the blocks (12704 values); 2 micro-steps accumulate into the sharded gradient
    for diff, tied, norm, ref_norm, padding in (r["gradients"] for r in three_ranks):
        assert padding[0] > 0
        assert diff <= 2e-6, diff  # every tensor, the tied wte/lm_head included
        assert tied[0] <= 2e-6 and min(tied[1:]) > 1e-4, tied  # both paths, summed
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)


LEDGER_CONFIG = GPTConfig(block_size=16, vocab_size=50304, n_layer=4, n_head=2, n_embd=32)  # 4 blocks
LEDGER_FLAGS = ["--block_size", "16", "--n_layer", "4", "--n_head", "2", "--n_embd", "32", "--dtype", "float32"]


def _ledger_and_freeing(rank, world_size, reshard, prefetch):
    model, fsdp, _ = _sharded(LEDGER_CONFIG, rank, world_size, reshard, prefetch)
    blocks = fsdp.blocks
    after_setup = _gathered_bytes(fsdp)
    events, views_in_buffer = [], []

    def gathered():
        return [i for i, u in enumerate(blocks) if u.is_gathered()]

    for i, block in enumerate(model.transformer.h):  # registered after fsdp's hooks: run after them
        def pre(module, args, i=i):
            views_in_buffer.append(all(
                p.untyped_storage().data_ptr() == blocks[i].flat_param.untyped_storage().data_ptr()
                for p in (module.ln_1.weight, module.attn.c_attn.weight, module.mlp.c_proj.bias)))
            events.append(("pre_forward", i, gathered()))

        def post(module, args, out, i=i):
            events.append(("post_forward", i, gathered()))
            out.register_hook(lambda g: events.append(("backward", i, gathered())))
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)

    names = torch_name("all_gather_single"), torch_name("reduce_scatter_single")
    calls, originals = [], [getattr(dist, name) for name in names]

    def count(name, original):
        def wrapper(*args, **kwargs):
            calls.append((name, args[1].numel()))
            return original(*args, **kwargs)
        return wrapper
    setattr(dist, names[0], count("gather", originals[0]))
    setattr(dist, names[1], count("scatter", originals[1]))
    try:
        optimizer = torch.optim.AdamW([u.local_shard for u in fsdp.units], lr=1e-3)
        x, y = get_batch("train", 0, 2 * world_size, LEDGER_CONFIG.block_size, seed=0)
        _, loss = model(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        loss.backward()
        fsdp.finish_backward()
        after_backward = _gathered_bytes(fsdp)
        optimizer.step()
    finally:
        for name, original in zip(names, originals):
            setattr(dist, name, original)
    shards = [u.local_shard for u in fsdp.units]  # the storages this rank really holds between steps
    held = dict(params=held_bytes(shards), grads=held_bytes(p.grad for p in shards),
                adamw=held_bytes(v for s in optimizer.state.values() for k, v in s.items() if k != "step"),
                shard_values=sum(u.shard_size for u in fsdp.units))
    n_params = sum(u.numel for u in fsdp.units)
    flat_grads_left = [u.flat_param.grad is None for u in fsdp.units]
    return dict(after_setup=after_setup, after_backward=after_backward, events=events, held=held,
                n_params=n_params, views_in_buffer=views_in_buffer, calls=calls, flat_grads_left=flat_grads_left,
                block_bytes=blocks[0].flat_param.numel() * 4)


def _ledgers(rank, world_size, configs):
    return [_ledger_and_freeing(rank, world_size, reshard, prefetch) for reshard, prefetch in configs]


LEDGER_RUNS = [(True, True), (True, False), (False, True)]  # (reshard_after_forward, prefetch)


def test_memory_ledger_freed_buffers_and_prefetch_order(two_ranks):
    for k, (reshard, prefetch) in enumerate(LEDGER_RUNS):
        for r in (results["ledgers"][k] for results in two_ranks[0]):
            _check_ledger(r, 2, reshard, prefetch)


def _check_ledger(r, world_size, reshard, prefetch):
    # params, grads, AdamW (exp_avg, exp_avg_sq) held per rank: fp32 shards, 4 + 4 + 8 bytes a shard value,
    # and that is 16 P / N bytes (padding within 5%)
    held, values = r["held"], r["held"]["shard_values"]
    assert (held["params"], held["grads"], held["adamw"]) == (4 * values, 4 * values, 8 * values), held
    assert abs(16 * values - 16 * r["n_params"] / world_size) <= 0.05 * 16 * r["n_params"] / world_size
    assert r["after_setup"] == 0 and r["after_backward"] == 0, "nothing stays gathered outside a step"
    assert all(r["flat_grads_left"]), "full flat gradients are dropped once reduce-scattered"
    assert all(r["views_in_buffer"]), "parameters must be views into the gathered flat buffer"
    events = r["events"]
    if reshard:  # at most two blocks gathered (+ the root); without reshard all stay until backward
        assert all(len(g) <= 2 for _, _, g in events), events
    n_blocks = LEDGER_CONFIG.n_layer
    assert [k for k, _, _ in events].count("backward") == n_blocks
    for kind, i, g in events:
        if kind == "pre_forward":
            assert i in g
            if prefetch and i + 1 < n_blocks:
                assert i + 1 in g, "the next block's all-gather must be in flight before this block runs"
            if not prefetch and reshard:
                assert g == [i], events
        if kind == "backward":
            assert i in g and (not prefetch or i == 0 or i - 1 in g), "block i - 1 is prefetched during block i's backward"
        if kind == "post_forward":
            assert (i in g) == (not reshard), "reshard after forward frees the block's buffer"
    gathers = [n for k, n in r["calls"] if k == "gather"]
    scatters = [n for k, n in r["calls"] if k == "scatter"]
    assert len(gathers) == 1 + n_blocks + (n_blocks if reshard else 0)  # root once; blocks again in backward
    assert len(scatters) == 1 + n_blocks  # one reduce-scatter per unit
    # each all-gather sends one shard; each reduce-scatter sends a whole flat gradient (N shards)
    expected = [n // world_size for n in scatters] + ([r["block_bytes"] // 4 // world_size] * n_blocks if reshard else [])
    assert sorted(gathers) == sorted(expected)
    # plan.py's bytes a step (fp32: 4 a value; one micro-step): the same totals
    flags = [*LEDGER_FLAGS, "--reshard_after_forward", str(reshard), "--prefetch", str(prefetch)]
    planned = plan.plan("fsdp_train.py", world_size, flags)[0].comm
    assert (4 * sum(gathers), 4 * sum(scatters)) == (planned["all_gather@world"], planned["reduce_scatter@world"])


class TensorBytes(TorchDispatchMode):
    """Counts the bytes of live CPU tensor storages allocated while active (outputs sharing an
    input's storage are views, not allocations), and the peak: tracemalloc for tensors."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in inputs:
                storage = t.untyped_storage()  # its Python object lives exactly as long as the storage
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, storage.nbytes())
        return out


def test_deferred_init_equals_sharding_the_whole_model_and_never_holds_it():
    # blocks large enough that the 50304-row embedding is not nearly the whole model
    config = GPTConfig(block_size=16, vocab_size=50304, n_layer=16, n_head=4, n_embd=128)
    rank, world_size = 3, 8  # construction alone needs no process group
    with TensorBytes() as deferred_meter:
        _, deferred, _ = _sharded(config, rank, world_size, deferred=True)
    with TensorBytes() as whole_meter:
        _, whole, _ = _sharded(config, rank, world_size, deferred=False)
    assert all(torch.equal(a.local_shard, b.local_shard) for a, b in zip(deferred.units, whole.units))
    full_bytes = 4 * sum(u.numel for u in whole.units)
    shard_bytes = 4 * sum(u.shard_size for u in whole.units)
    largest = 4 * config.vocab_size * config.n_embd
    assert whole_meter.peak >= full_bytes  # the meter sees the whole model being built
    assert deferred_meter.peak < 0.85 * full_bytes, (deferred_meter.peak, full_bytes)
    # at most one full tensor (drawn whole by init_tensor) beyond this rank's shards and their grads
    assert deferred_meter.peak <= largest + 2 * shard_bytes
    # and the small config, every rank of 3 (padding)
    for r in range(3):
        a = _sharded(CONFIG, r, 3, deferred=True)[1]
        b = _sharded(CONFIG, r, 3)[1]
        assert all(torch.equal(u.local_shard, v.local_shard) for u, v in zip(a.units, b.units))


def _checkpoint_round_trip(rank, world_size):
    strategy, optimizer, _ = _strategy()
    model, keys = strategy.model, list(GPT(CONFIG, device="meta").state_dict())
    x, y = get_batch("train", 0, 4, CONFIG.block_size, seed=0)
    strategy.forward_backward(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2], True)
    optimizer.step()  # so the weights differ from the init
    with DeviceMemory() as memory:  # on a GPU: what the gather holds on this rank's device
        model_state, optim_state = strategy.full_state(optimizer)
    unit = max(4 * (u.numel + u.padding) for u in strategy.units)  # the largest gathered unit's bytes
    with torch.no_grad():
        logits, _ = model(x)
    if rank != 0:
        return model_state, optim_state, memory.peak, unit
    plain = GPT(CONFIG, device="meta")  # ddp_train.py's model
    plain.load_state_dict(model_state, assign=True)
    plain.tie_weights()
    with torch.no_grad():
        plain_logits, _ = plain(x)
    moved = (model_state["transformer.h.0.attn.c_attn.weight"] - GPT(CONFIG, seed=0).transformer.h[0].attn.c_attn.weight).abs().max()
    return (torch.equal(logits, plain_logits), list(model_state) == keys, moved.item() > 0,
            sorted(optim_state) == sorted(n for n, _ in GPT(CONFIG, device="meta").named_parameters()),
            tuple(optim_state["transformer.wte.weight"]["exp_avg"].shape), memory.peak, unit,
            cpu_copies_only(memory, model_state, optim_state),
            model_state["lm_head.weight"] is model_state["transformer.wte.weight"])


def test_full_checkpoint_loads_into_the_plain_model_with_identical_logits(two_ranks):
    same_logits, same_keys, moved, optim_keys, shape, *_ = two_ranks[0][0]["checkpoint"]
    assert same_logits and same_keys and moved and optim_keys
    assert shape == (50304, 32)


def test_full_checkpoint_is_gathered_a_unit_at_a_time_into_rank_0s_cpu(two_ranks):
    """On a GPU (modelled: DeviceMemory) each unit's flat tensor is all-gathered on every rank's device, as forward
    gathers it, and rank 0 copies it to its CPU before the next: at most a gathered unit and the next one alive;
    the other rank keeps nothing (every rank kept a full CPU copy of everything)."""
    *_, peak, unit, cpu_only, tied = two_ranks[0][0]["checkpoint"]
    assert cpu_only and tied  # the tied names share one copy, as in the model
    model_state, optim_state, other, _ = two_ranks[0][1]["checkpoint"]
    assert model_state is None and optim_state is None
    assert peak <= 2 * unit and other <= 2 * unit, (peak, other, unit)


def _tiny_unit(rank, world_size):
    ln = torch.nn.LayerNorm(1)  # 2 values, fewer than the ranks
    names = (["weight"], torch.Size([1]), [(ln, "weight")]), (["bias"], torch.Size([1]), [(ln, "bias")])
    unit = FlatParamUnit(list(names), lambda n, s: torch.full(s, 2.0 if n == "weight" else 3.0), rank, world_size,
                         torch.device("cpu"), torch.float32)
    unit.post_backward = lambda flat_param: None  # keep flat_param.grad: reduce-scattered below
    unit.unshard()
    unit.work.wait()
    unit.use_views()
    values = ln.weight.item(), ln.bias.item()  # the gathered values, seen through the views
    out = ln(torch.tensor([[float(rank)]]))  # normalised over one value: 0, so out = bias
    (out.sum() * (rank + 1)).backward()
    shard = torch.empty(unit.shard_size)
    reduce_scatter_single(shard, unit.flat_param.grad, op=dist.ReduceOp.AVG)
    unit.local_shard.grad = shard
    unit.reshard()
    return unit.shard_size, unit.valid, unit.padding, values, \
        clip_grad_norm_([unit.local_shard.grad[:unit.valid]], [], 0.0).item()


def test_world_size_larger_than_a_unit_pads_and_works(three_ranks):
    results = [r["tiny"] for r in three_ranks]  # a unit of 2 values on 3 ranks: rank 2 holds only padding
    assert [r[:3] for r in results] == [(1, 1, 1), (1, 1, 1), (1, 0, 1)]
    assert all(r[3] == (2.0, 3.0) for r in results)
    # d(sum out * (rank + 1))/d bias = rank + 1, averaged over 3 ranks: 2; d/d weight = 0
    assert all(abs(r[4] - 2.0) <= 1e-6 for r in results)


def test_script_two_ranks_checkpoint_metrics_and_summary(tmp_path):
    result = launch("fsdp_train.py", 2, TINY + ["--max_iters", "3", "--eval_interval", "2", "--eval_iters", "1",
                                                 "--checkpoint_interval", "2", "--out_dir", str(tmp_path)],
                    torchrun=False)  # launched as torchrun does (test_reliability's sweep runs it under torchrun)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == [0, 1, 2]
    summary = records[-1]
    # each rank holds 1/N of every unit: fp32 param, grad, exp_avg, exp_avg_sq shards + AdamW's step (4 bytes a unit),
    # as plan.py counts it
    assert summary["model_state_bytes_per_rank"] == plan_report.per_rank(plan.plan("fsdp_train.py", 2, TINY), 2, "model_state")
    # the waits on communication were timed on every rank (their length is not asserted: no timing in tests)
    exposed = summary["exposed_comm_ms_per_rank"]
    assert len(exposed) == 2 and all(isinstance(ms, float) and math.isfinite(ms) for ms in exposed), exposed
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 3 and {"transformer.wte.weight", "lm_head.weight"} <= set(ckpt["model"])
    assert torch.equal(ckpt["model"]["transformer.wte.weight"], ckpt["model"]["lm_head.weight"])
    assert math.isfinite(ckpt["optimizer"]["transformer.h.1.mlp.c_fc.weight"]["exp_avg"].sum().item())


BAD_INPUT = [
    (["--implementation", "pytorch", "--prefetch", "false"], "--prefetch"),
    (["--implementation", "pytorch", "--deferred_init"], "--deferred_init"),
]


@pytest.mark.parametrize("flags,named", BAD_INPUT, ids=[" ".join(f) for f, _ in BAD_INPUT])
def test_flags_that_do_not_apply_give_one_clear_error(flags, named, tmp_path, monkeypatch, capsys):
    assert named in refusal("fsdp_train.py", None, TINY + ["--max_iters", "2", "--out_dir", str(tmp_path)] + flags,
                            monkeypatch, capsys)


class Killed(Exception):
    """A rank dying at a chosen point of a save (raised and caught, so the other rank does not hang)."""


SAVE_ATOMIC = common.sharded_checkpoint.save_atomic


def _dies_before_the_manifest(obj, path):
    if path.endswith("manifest.pt"):
        raise Killed(path)
    SAVE_ATOMIC(obj, path)


def _sharded_round_trip(rank, world_size, path):
    x, y = get_batch("train", 0, 4, CONFIG.block_size, seed=0)

    def one_step(strategy, optimizer):
        strategy.forward_backward(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2], True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    def resumed():  # main()'s way back: resume() gives the step, the strategy and its optimizer load this rank's file
        args = parse_args("fsdp", add_fsdp_flags, [*CONFIG_FLAGS, "--resume_sharded", f"{path}/sharded"])
        step = resume(args)["step"]
        strategy = FSDP(CONFIG, args, torch.device("cpu"))
        return step, strategy, strategy.configure_optimizer(args)

    def same(a, b):  # shards and AdamW state, bit for bit
        return all(torch.equal(u.local_shard, v.local_shard) and all(
            torch.equal(s, b[1].state[v.local_shard][k]) for k, s in a[1].state[u.local_shard].items())
            for u, v in zip(a[0].units, b[0].units))

    strategy, optimizer, args = _strategy(["--sharded_checkpoint", "--out_dir", str(path)])
    one_step(strategy, optimizer)
    checkpoint(1, strategy, optimizer, CONFIG, args)  # ckpt.pt, and sharded/ beside it
    one_step(strategy, optimizer)
    # the save of step 2 dies once every rank's file is written, just before rank 0 publishes it
    common.sharded_checkpoint.save_atomic = _dies_before_the_manifest
    try:
        checkpoint(2, strategy, optimizer, CONFIG, args)
    except Killed:
        pass
    finally:
        common.sharded_checkpoint.save_atomic = SAVE_ATOMIC
    dist.barrier()
    after_crash = sorted(os.listdir(os.path.join(path, "sharded")))
    step, fresh, fresh_optimizer = resumed()  # the published step-1 save, not the dead step-2 one
    one_step(fresh, fresh_optimizer)  # the second step again, from the loaded state
    result = dict(step=step, same=same((strategy, optimizer), (fresh, fresh_optimizer)), after_crash=after_crash)
    checkpoint(2, fresh, fresh_optimizer, CONFIG, args)  # replaces the dead step_2 and removes step_1
    checkpoint(2, fresh, fresh_optimizer, CONFIG, args)  # the same step again: a new folder, never the published one
    dist.barrier()
    step, again, again_optimizer = resumed()
    return dict(result, listing=sorted(os.listdir(os.path.join(path, "sharded"))), step_again=step,
                same_again=same((strategy, optimizer), (again, again_optimizer)))


def test_sharded_checkpoint_survives_a_save_that_dies_and_resumes_exactly(two_ranks):
    results, path = two_ranks
    for r in (r["sharded"] for r in results):
        assert r["after_crash"] == ["manifest.pt", "step_1", "step_2"]  # step_2 written, never published
        assert r["step"] == 1 and r["same"], r  # resumed from step 1: its second step equals the uninterrupted one
        assert r["listing"] == ["manifest.pt", "step_2_b"] and r["step_again"] == 2 and r["same_again"], r
    assert sorted(os.listdir(path / "sharded" / "step_2_b")) == ["rank0.pt", "rank1.pt"]


def _rank_file(sharded, rank):
    return sharded / torch.load(sharded / "manifest.pt", weights_only=True)["folder"] / f"rank{rank}.pt"


@pytest.fixture(scope="module")
def sharded_saves(tmp_path_factory):
    """Sharded checkpoints written by the script at 2 ranks: {(steps, seed): out_dir/sharded}."""
    saves = {}
    for steps, seed in ((1, 1337), (2, 1337), (2, 7)):
        out = tmp_path_factory.mktemp("saved")
        result = launch("fsdp_train.py", 2, TINY + ["--max_iters", str(steps), "--seed", str(seed), "--sharded_checkpoint",
                                                     "--out_dir", str(out)], torchrun=False)
        assert result.returncode == 0, result.stderr[-3000:]
        saves[steps, seed] = out / "sharded"
    return saves


def test_resume_sharded_puts_adamw_step_where_torch_does(sharded_saves, monkeypatch):
    """--resume_sharded through the script's own strategy and optimizer (its fused ShardedAdamW), on the meta device
    in the GPU's stead, as rank 0 of the 2 that saved: the shards and moments on the device, and AdamW's step where
    torch's own load_state_dict puts it for the same optimizer: on the device, as float32 (the fused CUDA kernel
    reads it there). load_sharded leaves the step on the CPU, as saved; set_adamw_state moves it."""
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    args = parse_args("fsdp", add_fsdp_flags, TINY + ["--resume_sharded", str(sharded_saves[1, 1337])])
    strategy = FSDP(gpt_config(args), args, torch.device("meta"))
    optimizer = strategy.configure_optimizer(args)
    assert isinstance(optimizer, ShardedAdamW) and optimizer.param_groups[0]["fused"]
    saved = torch.load(_rank_file(sharded_saves[1, 1337], 0), weights_only=True)["units"]  # as written
    assert all(u["step"].device == torch.device("cpu") for u in saved)
    reference = ShardedAdamW(strategy.units, args)  # torch's convention, on the same shards
    states = {i: {k: v for k, v in unit.items() if k != "local_shard"} for i, unit in enumerate(saved)}
    reference.load_state_dict({"state": states, "param_groups": reference.state_dict()["param_groups"]})
    for unit in strategy.units:
        ours, theirs = optimizer.state[unit.local_shard], reference.state[unit.local_shard]
        assert unit.local_shard.is_meta and list(ours) == list(theirs) == ["step", "exp_avg", "exp_avg_sq"]
        assert all((ours[k].device, ours[k].dtype) == (theirs[k].device, theirs[k].dtype) for k in ours), ours
        assert ours["step"].is_meta and ours["step"].dtype == torch.float32


def _mix(saves, sharded, other):  # rank 1's file of another save put into the published folder
    shutil.copy(_rank_file(saves[other], 1), _rank_file(sharded, 1))


SHARDED_BAD = [  # (damage to a copy of the 2-step save, flags, ranks, the error names)
    (lambda saves, sharded: _mix(saves, sharded, (1, 1337)), [], 2, "(step 1, not 2)"),
    (lambda saves, sharded: _mix(saves, sharded, (2, 7)), [], 2, "(save "),  # the same step, another run
    (lambda saves, sharded: os.remove(_rank_file(sharded, 1)), [], 2, "rank1.pt cannot be read (FileNotFoundError)"),
    (None, ["--n_head", "8"], 2, "saved with n_head=4, this run has --n_head 8"),  # the same shapes
    (None, [], None, "written by 2 ranks, this run has 1"),
]


@pytest.mark.parametrize("damage,flags,nproc,named", SHARDED_BAD,
                         ids=["mixed steps", "mixed saves", "missing file", "n_head", "world size"])
def test_a_sharded_checkpoint_that_does_not_fit_gives_one_clear_error(damage, flags, nproc, named, sharded_saves,
                                                                     tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(sharded_saves[2, 1337], sharded)
    if damage:
        damage(sharded_saves, sharded)
    error = the_one_error("fsdp_train.py", nproc, TINY + ["--max_iters", "4", "--resume_sharded", str(sharded),
                                                          "--out_dir", str(tmp_path / "out")] + flags)
    assert error.startswith("error: --resume_sharded: ") and named in error, error


# fsdp_hsdp_train.py's own checks: --replicate_size must divide the world; a sharded checkpoint cut for another
# shard group size (another --replicate_size at the same world size) stops with one line, not a shape error
@pytest.mark.parametrize("replicate_size", ["0", "3"])
def test_hsdp_replicate_size_must_divide_the_world(replicate_size, tmp_path, monkeypatch, capsys):
    line = refusal("fsdp_hsdp_train.py", 4, TINY + ["--replicate_size", replicate_size, "--out_dir", str(tmp_path)],
                   monkeypatch, capsys)
    assert line == f"error: --replicate_size: must be >= 1 and divide the world size 4, got {replicate_size}"


def test_hsdp_sharded_resume_of_another_shard_size_is_one_line(monkeypatch, capsys):
    import fsdp_hsdp_train
    args = parse_args("fsdp", fsdp_hsdp_train.add_fsdp_flags, [*CONFIG_FLAGS, "--resume_sharded", "somewhere"])
    saved = lambda path, rank, device: [{"local_shard": torch.zeros(7)}]  # noqa: E731 (a shard of 7 values)
    monkeypatch.setattr(fsdp_hsdp_train, "load_sharded", saved)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(SystemExit) as stop:
            fsdp_hsdp_train.FSDP(CONFIG, args, torch.device("cpu"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    blocks = sum(p.numel() for p in GPT(CONFIG).transformer.h[0].parameters())
    assert stop.value.code == 2 and capsys.readouterr().err.strip() == (
        f"error: --resume_sharded: saved with shards of 7 values, this run's have {blocks}: use its --replicate_size")
