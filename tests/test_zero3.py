"""zero3_train.py: partition, gradients equal to one process, memory and communication ledgers,
checkpoint round trip, more ranks than tensors, bad input."""
import re

import pytest
import torch
import torch.distributed as dist

from conftest import TINY, launch, read_metrics, spawn, step_losses, the_one_error
from common.data import get_batch
from common.metrics import held_bytes, model_state_bytes
from common.model import GPT, PRESETS, GPTConfig, configure_optimizer, init_tensor
from zero3_train import Zero3, gather_full_state, materialize_owned_, partition

CONFIG = GPTConfig(block_size=16, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)  # wte is 97% of P
BALANCED = GPTConfig(block_size=16, vocab_size=256, n_layer=4, n_head=2, n_embd=64)  # no dominant tensor
SMALL_TENSORS = 1000  # a --persistence_threshold that keeps CONFIG's biases, LayerNorms and wpe (512) replicated


def _shapes(config):
    return [(n, p.shape) for n, p in GPT(config, device="meta").named_parameters()]


def _build(rank, world_size, config, threshold, prefetch=True, reuse=0):
    model = GPT(config, device="meta")
    owner, _ = partition([(n, p.shape) for n, p in model.named_parameters()], world_size, threshold)
    materialize_owned_(model, owner, rank, lambda n, s: init_tensor(n, s, config, 0), torch.device("cpu"))
    return model, Zero3(model, owner, rank, world_size, prefetch, reuse)


def _rows(rank, world_size, config, batch=8, step=0):
    x, y = get_batch("train", step, batch, config.block_size, seed=0)
    x, y = x % config.vocab_size, y % config.vocab_size  # BALANCED's vocabulary is tiny
    n = batch // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _backward(model, zero3, x, y, accum, world_size):
    """One optimizer step's micro-steps, as ZeRO3.forward_backward runs them; leaves averaged owned gradients."""
    micro = x.size(0) // accum
    for j in range(accum):
        zero3.sync_persistent = j == accum - 1
        _, loss = model(x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro])
        (loss / accum).backward()
        zero3.finish_backward()
    for p in zero3.owned + zero3.persistent:
        p.grad.div_(world_size)


# ---- partition ---------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [CONFIG, BALANCED, PRESETS["small"], PRESETS["gpt2"]], ids=["tiny", "balanced", "small", "gpt2"])
@pytest.mark.parametrize("threshold", [0, SMALL_TENSORS])
def test_every_tensor_owned_by_exactly_one_rank_within_the_greedy_bound(config, threshold):
    shapes = _shapes(config)
    names = [n for n, _ in shapes]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # the tied tensor is one tensor
    for world_size in (1, 2, 3, 4, 8):
        owner, load = partition(shapes, world_size, threshold)
        assert sorted(owner) == sorted(names)  # a dict: each name exactly once
        sizes = {n: torch.Size(s).numel() for n, s in shapes}
        assert all((owner[n] is None) == (sizes[n] < threshold) for n in names)
        assert all(owner[n] is None or 0 <= owner[n] < world_size for n in names)
        for r in range(world_size):
            assert load[r] == sum(sizes[n] for n in names if owner[n] == r)
        partitioned = [sizes[n] for n in names if owner[n] is not None]
        assert max(load) <= sum(partitioned) / world_size + max(partitioned)  # the documented bound


def test_partition_worked_by_hand():
    owner, load = partition(_shapes(CONFIG), 2, 0)
    assert owner["transformer.wte.weight"] == 0 and load[0] == 50304 * 32  # the embedding alone
    assert all(r == 1 for n, r in owner.items() if n != "transformer.wte.weight")
    # largest first onto the least loaded: 4 ranks, three equal tensors of 3, one of 2, one of 1
    owner, load = partition([("a", (3,)), ("b", (2,)), ("c", (3,)), ("d", (1,)), ("e", (3,))], 4, 0)
    assert owner == {"a": 0, "c": 1, "e": 2, "b": 3, "d": 3} and load == [3, 3, 3, 3]
    owner, load = partition(_shapes(BALANCED), 2, 0)
    assert max(load) <= 1.1 * sum(load) / 2  # no dominant tensor: within 10% of the mean


# ---- every distributed check runs in one pair of spawned gloo ranks (starting them is the slow part)

KEEP = 10**9  # a --max_reuse_distance that keeps the tied wte from the embedding to the head
COMMUNICATION_CASES = [(0, 1, 0), (0, 2, KEEP), (SMALL_TENSORS, 1, 0), (SMALL_TENSORS, 3, KEEP)]
MEMORY_CASES = [(0, 0), (300, 0), (0, KEEP)]


def _all_checks(rank, world_size):
    return {"gradients": [_gradients_vs_one_process(rank, world_size, *case) for case in GRADIENT_CASES],
            "memory": {case: _memory_ledger(rank, world_size, *case) for case in MEMORY_CASES},
            "communication": {case: _communication(rank, world_size, *case) for case in COMMUNICATION_CASES},
            "checkpoint": _checkpoint(rank, world_size)}


@pytest.fixture(scope="module")
def ranks():
    return spawn(_all_checks, 2)


# ---- gradients: owners hold exactly the single-process gradient ------------------------------

def _gradients_vs_one_process(rank, world_size, threshold, prefetch, accum, reuse):
    model, zero3 = _build(rank, world_size, CONFIG, threshold, prefetch, reuse)
    x, y = _rows(rank, world_size, CONFIG)
    _backward(model, zero3, x, y, accum, world_size)
    reference = GPT(CONFIG, seed=0)
    xa, ya = get_batch("train", 0, 8, CONFIG.block_size, seed=0)
    reference(xa, ya)[1].backward()
    ref = dict(reference.named_parameters())
    names = {p: n for n, p in model.named_parameters()}
    weights = max((p - ref[names[p]]).abs().max().item() for p in zero3.owned + zero3.persistent)
    grads = max((p.grad - ref[names[p]].grad).abs().max().item() for p in zero3.owned + zero3.persistent)
    others = [p for p in names if zero3.owner[p] not in (None, rank)]
    leftovers = held_bytes(others) + sum(p.grad is not None for p in others)
    return weights, grads, leftovers, len(zero3.owned)


GRADIENT_CASES = [(0, True, 1, 0), (SMALL_TENSORS, False, 2, KEEP), (SMALL_TENSORS, True, 4, 0),
                  (0, True, 2, KEEP), (1_000_000, True, 1, KEEP)]  # last: only wte partitioned, rank 1 owns nothing


@pytest.mark.parametrize("case", range(len(GRADIENT_CASES)), ids=[f"threshold{t}-prefetch{p}-accum{a}-reuse{r}" for t, p, a, r in GRADIENT_CASES])
def test_owned_gradients_equal_one_process(ranks, case):
    results = [r["gradients"][case] for r in ranks]
    for weights, grads, leftovers, _ in results:
        assert weights == 0, "deferred init must give the owner the single-process weights"
        assert grads <= 1e-6, grads
        assert leftovers == 0, "after backward a rank holds no non-owned parameter or gradient"
    owned = [owned for *_, owned in results]
    assert owned == [1, 0] if GRADIENT_CASES[case][0] == 1_000_000 else min(owned) > 0


# ---- memory ledger ------------------------------------------------------------------------------

def _memory_ledger(rank, world_size, threshold, reuse):
    model, zero3 = _build(rank, world_size, BALANCED, threshold, reuse=reuse)
    nonowned = {p for p in zero3.owner if zero3.owner[p] not in (None, rank)}  # sets: tensors hash by identity
    held_at, expected_at = [], []

    def expect(units):  # the non-owned bytes of these units' tensors (a tensor in two units counts once)
        return sum(p.numel() * 4 for p in {q for u in units for q in zero3.units[u].parameters()} if p in nonowned)

    def record(units):  # returns None: a pre-hook that returns something would replace the inputs
        held_at.append(held_bytes(nonowned))
        expected_at.append(expect(units))

    n = len(zero3.units)
    for i, unit in enumerate(zero3.units):  # registered after Zero3's hooks: they see the fetched state
        # forward: this module and the prefetched next one; when kept, the embedding's wte until the head
        unit.register_forward_pre_hook(lambda m, a, units=[i] + ([i + 1] if i + 1 < n else []) + ([0] if reuse and i else []): record(units))
        if i in zero3.backward_order:
            k = zero3.backward_order.index(i)
            unit.register_full_backward_pre_hook(lambda m, g, units=[i] + zero3.backward_order[k + 1:k + 2]: record(units))
    optimizer = configure_optimizer([(n, p) for n, p in model.named_parameters() if zero3.owner[p] in (None, rank)],
                                    0.1, 1e-3, (0.9, 0.95))
    x, y = _rows(rank, world_size, BALANCED)
    _backward(model, zero3, x, y, 1, world_size)
    after_backward = held_bytes(nonowned)
    optimizer.step()
    state = model_state_bytes(optimizer)  # what the script reports: the optimizer's params, grads and state
    # the same count over every tensor of the model: a freed non-owned tensor (0-byte storage) counts 0
    params = list(zero3.owner)
    everything = (held_bytes(params) + held_bytes(p.grad for p in params)
                  + held_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)))
    freed = [held_bytes([p]) for p in nonowned] + [p.untyped_storage().nbytes() for p in nonowned]
    counts_held_only = state == everything and not any(freed) and all(p.numel() > 0 for p in nonowned)
    partitioned = sum(p.numel() for p in params if zero3.owner[p] is not None)
    persistent = sum(p.numel() for p in zero3.persistent)
    return (held_at, expected_at, after_backward, state, partitioned, persistent, sum(p.numel() * 4 for p in nonowned),
            counts_held_only)


@pytest.mark.parametrize("case", MEMORY_CASES, ids=[f"threshold{t}-reuse{r}" for t, r in MEMORY_CASES])
def test_memory_ledger(ranks, case):
    world_size, threshold = 2, case[0]
    for held_at, expected_at, after_backward, state, partitioned, persistent, nonowned, counts_held_only in (
            r["memory"][case] for r in ranks):
        assert counts_held_only, "model_state_bytes counts what is held: a freed non-owned tensor 0 bytes"
        # params + grads + AdamW (exp_avg, exp_avg_sq): 16 bytes per owned element (and a 4-byte step per
        # tensor), within 10% of 16P/N, plus 16 bytes per element of the persistent tensors every rank keeps
        share = 16 * partitioned / world_size + 16 * persistent
        assert abs(state - share) <= 0.1 * 16 * partitioned / world_size, (state, share)
        # measured before every module's forward and backward: only that module's (and the prefetched
        # next module's) non-owned tensors are held; everything else was released
        assert held_at == expected_at and len(held_at) == 2 * (4 + 4) - 2
        assert held_at[0] == expected_at[0] and max(held_at) < nonowned and after_backward == 0
        print(f"threshold {threshold}: state {state:,} B vs 16P/N + persistent {share:,.0f} B; "
              f"non-owned held peak {max(held_at):,} of {nonowned:,} B")


# ---- communication ledger -------------------------------------------------------------------------

def _communication(rank, world_size, threshold, accum, reuse):
    model, zero3 = _build(rank, world_size, CONFIG, threshold, reuse=reuse)
    sent = {"broadcast": [], "reduce": [], "all_reduce": []}
    originals = {name: getattr(dist, name) for name in sent}

    def counting(name):
        def call(tensor, *args, **kwargs):
            sent[name].append(tensor.numel() * tensor.element_size())
            return originals[name](tensor, *args, **kwargs)
        return call

    for name in sent:
        setattr(dist, name, counting(name))
    try:
        x, y = _rows(rank, world_size, CONFIG)
        _backward(model, zero3, x, y, accum, world_size)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    owner = {n: zero3.owner[p] for n, p in model.named_parameters()}
    # per module (wte, wpe, blocks, ln_f, lm_head): the owners of its partitioned tensors
    unit_owners = [{zero3.owner[p] for p in u.parameters()} - {None} for u in zero3.units]
    return sent, sizes, owner, unit_owners


@pytest.mark.parametrize("threshold,accum,reuse", COMMUNICATION_CASES)
def test_communication_ledger(ranks, threshold, accum, reuse):
    for sent, sizes, owner, unit_owners in (r["communication"][threshold, accum, reuse] for r in ranks):
        partitioned = [n for n in sizes if owner[n] is not None]
        persistent = [n for n in sizes if owner[n] is None]
        # per micro-step: every partitioned tensor broadcast twice (forward, backward), except wpe, whose
        # lookup backward reads no weight; the tied wte twice as one tensor (embedding, head), or once
        # when kept from the embedding to the head (--max_reuse_distance)
        once = ["transformer.wpe.weight"] + (["transformer.wte.weight"] if reuse else [])
        twice = [n for n in partitioned if n not in once]
        once = [n for n in partitioned if n in once]
        assert sum(sent["broadcast"]) == accum * (2 * sum(sizes[n] for n in twice) + sum(sizes[n] for n in once))
        # in one message per (module, owner): forward every module, less the head's kept wte; backward the
        # blocks and ln_f (the head's buffer stays from its forward, a lookup's backward needs no weight)
        messages = sum(map(len, unit_owners)) - (1 if reuse else 0) + sum(map(len, unit_owners[2:-1]))
        assert len(sent["broadcast"]) == accum * messages
        # one reduce of every partitioned gradient per micro-step (the tied one once), and one all-reduce
        # of every persistent gradient per optimizer step
        assert sorted(sent["reduce"]) == sorted(accum * [sizes[n] for n in partitioned])
        assert sorted(sent["all_reduce"]) == sorted(sizes[n] for n in persistent)
        if threshold and not reuse:
            assert not once, "wpe is persistent here: exactly 2 broadcasts + 1 reduce of every partitioned tensor"


# ---- checkpoint round trip -----------------------------------------------------------------------

def _checkpoint(rank, world_size):
    model, zero3 = _build(rank, world_size, CONFIG, SMALL_TENSORS)
    optimizer = configure_optimizer([(n, p) for n, p in model.named_parameters() if zero3.owner[p] in (None, rank)],
                                    0.1, 1e-3, (0.9, 0.95))
    x, y = _rows(rank, world_size, CONFIG)
    _backward(model, zero3, x, y, 1, world_size)
    optimizer.step()
    state, optim = gather_full_state(model, optimizer, zero3)
    xa, _ = get_batch("val", 0, 4, CONFIG.block_size, seed=0)
    with torch.no_grad():
        logits, _ = model(xa)  # the distributed forward: owners broadcast, as in training
    if rank != 0:
        return None
    loaded = GPT(CONFIG, device="meta")
    loaded.load_state_dict(state, assign=True)
    loaded.tie_weights()
    with torch.no_grad():
        logits_loaded, _ = loaded(xa)
    names = [n for n, _ in loaded.named_parameters()]
    return (torch.equal(logits, logits_loaded), sorted(state), sorted(optim), sorted(names),
            {k: sorted(v) for k, v in optim.items()}, torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]))


def test_checkpoint_round_trip_gives_identical_logits(ranks):
    same, keys, optim_keys, names, fields, tied = ranks[0]["checkpoint"]
    assert same, "the gathered checkpoint must reproduce the distributed model's logits exactly"
    assert "lm_head.weight" in keys and "transformer.wte.weight" in keys and tied
    assert optim_keys == names
    assert all(f == ["exp_avg", "exp_avg_sq", "step"] for f in fields.values())


# ---- the script: more ranks than tensors, checkpoint file, bad input ------------------------------

def test_ranks_owning_nothing_warn_and_still_train(tmp_path):
    # only the embedding (50304 x 64) has >= 3M elements: rank 1 owns nothing (its gradients are
    # checked against one process in test_owned_gradients_equal_one_process[threshold1000000...])
    result = launch("zero3_train.py", 2, TINY + ["--max_iters", "3", "--persistence_threshold", "3000000",
                                                 "--out_dir", str(tmp_path)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: some of the 2 ranks own no tensor" in result.stdout
    assert re.search(r"rank 1:\s+0 tensors", result.stdout)
    records = read_metrics(tmp_path)
    assert len(step_losses(tmp_path)) == 3 and records[-1]["summary"]
    per_rank = records[-1]["model_state_bytes_per_rank"]
    assert per_rank[0] == per_rank[1] + 16 * 50304 * 64 + 4  # the embedding, its grad, AdamW state and step
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    model = GPT(GPTConfig(**ckpt["config"]), device="meta")
    assert ckpt["step"] == 3 and set(ckpt["optimizer"]) == {n for n, _ in model.named_parameters()}
    assert set(ckpt["model"]) == set(model.state_dict()) and "lm_head.weight" in ckpt["model"]
    model.load_state_dict(ckpt["model"], assign=True)


@pytest.mark.parametrize("flag", ["--persistence_threshold", "--max_reuse_distance"])
def test_negative_sizes_give_one_clear_error(flag, tmp_path):
    error = the_one_error("zero3_train.py", None, TINY + ["--max_iters", "2", flag, "-1", "--out_dir", str(tmp_path)])
    assert error == f"error: {flag}: must be >= 0, got -1"
