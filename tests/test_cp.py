"""cp_train.py: each attention mode equals full causal attention (output, dq, dk, dv) at cp 2 and 4; the
causal balance counted from the windows the code computes (zigzag equal, contiguous at the formula's ratio);
the bytes each mode sends per layer per rank against the docstring's formulas; saved activations per rank at
cp=2 against one process; bad input. Loss parity (every mode, zigzag or not, T/cp = 12, DP 2 x CP 2) is in
tests/test_parity.py."""
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import TINY, refusal, spawn
from common.distributed import torch_name
from common.metrics import SavedActivations
from common.model import GPT, GPTConfig
from cp_train import AllGatherAttention, CPGroup, CPGPT, RingAttention, causal_window, positions, ulysses_attention

MODES = [("allgather", True), ("ring", True), ("ring", False), ("ulysses", False)]
B, H, D = 2, 4, 8  # rows, heads, head_dim of the attention tests


def attention(mode, q, k, v, cp):
    if mode == "ulysses":
        return ulysses_attention(q, k, v, cp, 0.0)
    return (RingAttention if mode == "ring" else AllGatherAttention).apply(q, k, v, cp)


def _groups(rank, world_size):
    """{cp: this rank's CP group}: cp=4 all ranks, cp=2 ranks (0, 1) and (2, 3); every rank creates every group."""
    pairs, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    return {4: dist.group.WORLD, 2: pairs}


def _layer_equals_full_attention(groups, T=24):
    """Max |difference| of out, dq, dk, dv (this rank's positions) from full causal SDPA, per (cp, mode, zigzag)."""
    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v, dout = (torch.randn(B, H, T, D) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=True)
    out.backward(dout)
    diffs = {}
    for cp_size, group in groups.items():
        for mode, zigzag in MODES:
            cp = CPGroup(group, T, zigzag, torch.device("cpu"))
            local = [t[:, :, cp.mine].clone().requires_grad_() for t in (q, k, v)]
            y = attention(mode, *local, cp)
            y.backward(dout[:, :, cp.mine])
            # relative where the reference exceeds 1 (fp32 sums of T products of O(1) values)
            diffs[cp_size, mode, zigzag] = max(((a - b[:, :, cp.mine]).abs().max() / b.abs().max().clamp(min=1)).item()
                                               for a, b in zip(
                [y] + [t.grad for t in local], [out.detach()] + [t.grad for t in full]))
    return diffs


def _sent_per_layer(groups):
    """Numbers each rank sends in one attention forward and backward, per (cp, mode): every collective is
    wrapped and charged what it sends from this rank (an all-gather its input to cp-1 ranks, a
    reduce-scatter and an all-to-all the (cp-1)/cp of their input going elsewhere, a send its tensor)."""
    names = {n: torch_name(n) for n in ("batch_isend_irecv", "all_gather_single", "reduce_scatter_single",
                                             "all_to_all_single")}  # this torch's function for each
    originals = {n: getattr(dist, name) for n, name in names.items()}
    sent = []

    def charge(name, numbers):
        def wrapped(*args, **kwargs):
            sent.append(numbers(*args, **kwargs))
            return originals[name](*args, **kwargs)
        setattr(dist, names[name], wrapped)
    charge("batch_isend_irecv", lambda ops: sum(op.tensor.numel() for op in ops if op.op is dist.isend))
    charge("all_gather_single", lambda out, x, group, **_: x.numel() * (dist.get_world_size(group) - 1))
    charge("reduce_scatter_single", lambda out, x, group, **_: Fraction(x.numel() * (dist.get_world_size(group) - 1),
                                                                   dist.get_world_size(group)))
    charge("all_to_all_single", lambda out, x, group: Fraction(x.numel() * (dist.get_world_size(group) - 1),
                                                               dist.get_world_size(group)))
    result, T = {}, 32
    try:
        for cp_size, group in groups.items():
            for mode, zigzag in MODES:
                cp = CPGroup(group, T, zigzag, torch.device("cpu"))
                local = [torch.randn(B, H, T // cp_size, D, requires_grad=True) for _ in range(3)]
                sent.clear()
                y = attention(mode, *local, cp)
                forward = sum(sent)
                sent.clear()
                y.backward(torch.randn_like(y))
                result[cp_size, mode, zigzag] = forward, sum(sent)
    finally:
        for name, fn in originals.items():
            setattr(dist, names[name], fn)
    return result


def _saved_activations(groups):
    """Bytes autograd saves in one forward of 2 blocks per rank at cp=2, and in one process on the whole (B, T)."""
    config = GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=4, n_embd=128)
    x = torch.randn(4, 64, config.n_embd)
    with SavedActivations() as one:
        out = torch.nn.Sequential(*GPT(config, seed=0).transformer.h)(x.requires_grad_())
    out.sum().backward()
    result = {"one process": one.bytes}
    for mode, zigzag in MODES:
        cp = CPGroup(groups[2], 64, zigzag, torch.device("cpu"))
        blocks = torch.nn.Sequential(*CPGPT(config, 0, "cpu", cp, mode).transformer.h)
        with SavedActivations() as saved:
            out = blocks(x.detach()[:, cp.mine].requires_grad_())
        out.sum().backward()
        result[mode, zigzag] = saved.bytes
    return result


def _unit_checks(rank, world_size):
    """Every in-process check on 4 gloo ranks in one spawn (starting ranks costs seconds)."""
    groups = _groups(rank, world_size)
    return dict(layers=_layer_equals_full_attention(groups), sent=_sent_per_layer(groups),
                saved=_saved_activations(groups))


@pytest.fixture(scope="module")
def unit():
    return spawn(_unit_checks, 4)


def test_each_mode_equals_full_causal_attention(unit):
    for r in unit:  # T = 24: cp 2 holds 12 positions (zigzag: chunks of 6), cp 4 holds 6 (zigzag: chunks of 3)
        assert sorted(r["layers"]) == sorted((cp, m, z) for cp in (2, 4) for m, z in MODES)
        for key, diff in r["layers"].items():
            assert diff <= 1e-6, (r, key, diff)


def pairs_kept_and_computed(T, cp, zigzag):
    """Per CP rank, over the cp key blocks: (query, key) pairs the causal mask keeps, and score entries the
    ring/allgather code computes (its windows), from cp_train's own positions() and causal_window()."""
    kept, computed = [], []
    for r in range(cp):
        windows = [causal_window(positions(T, cp, r, zigzag), positions(T, cp, j, zigzag)) for j in range(cp)]
        entries = [(T // cp - first) * keys for first, keys, _ in windows]
        computed.append(sum(entries))
        kept.append(sum(n - (0 if mask is None else int(mask.sum())) for n, (_, _, mask) in zip(entries, windows)))
    return kept, computed


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_causal_balance_counted(cp):
    T = 48
    kept, computed = pairs_kept_and_computed(T, cp, zigzag=True)
    assert kept == [T * (T + 1) // (2 * cp)] * cp  # exactly equal, and all of the causal pairs between them
    assert len(set(computed)) == 1 and computed[0] == (T // cp) ** 2 * (cp + 1) // 2  # the diagonal + half of each other
    kept, computed = pairs_kept_and_computed(T, cp, zigzag=False)
    m = T // cp
    assert kept == [r * m * m + m * (m + 1) // 2 for r in range(cp)]
    assert Fraction(kept[-1], kept[0]) == Fraction((2 * cp - 1) * m + 1, m + 1)  # about 2cp-1
    assert computed == [(r + 1) * m * m for r in range(cp)]  # later key blocks skipped whole
    print(f"cp={cp} T={T}: contiguous last/first = {kept[-1] / kept[0]:.3f}, zigzag 1.000")


def test_communication_per_layer_equals_the_formulas(unit):
    """Numbers sent per rank (x 4 bytes in fp32) by one attention layer, B x T x C = 2 x 32 x 32."""
    T, C = 32, H * D
    for r in unit:
        for (cp, mode, zigzag), (forward, backward) in r["sent"].items():
            kv = 2 * B * T * C // cp  # this rank's K and V
            if mode == "ulysses":
                assert forward == backward == Fraction((cp - 1) * 4 * B * T * C, cp * cp), (cp, mode, r["sent"])
            else:  # one all-gather, or cp-1 ring steps; backward twice that (K,V again + dK,dV)
                assert (forward, backward) == ((cp - 1) * kv, 2 * (cp - 1) * kv), (cp, mode, zigzag, forward, backward)


def test_saved_activations_at_cp2_are_at_most_055_of_one_process(unit):
    for r in unit:
        saved = r["saved"]
        print(f"rank {unit.index(r)}: saved activation bytes of 2 blocks (batch 4 x 64, 128 wide): {saved}")
        for key, nbytes in saved.items():
            if key != "one process":
                assert nbytes <= 0.55 * saved["one process"], (key, nbytes, saved["one process"])


BAD_INPUT = [
    (2, ["--block_size", "30"], "--block_size"),  # zigzag: 2cp = 4 chunks
    (2, ["--block_size", "31", "--load_balance", "false"], "--block_size"),
    (2, ["--cp_mode", "ulysses", "--n_head", "3", "--n_embd", "48"], "--n_head"),
    (2, ["--cp_mode", "ulysses", "--load_balance", "true"], "--load_balance"),
    (None, ["--context_parallel_size", "2"], "--context_parallel_size"),
    (2, ["--dropout", "0.1"], "--dropout"),
]


@pytest.mark.parametrize("nproc,flags,named", BAD_INPUT, ids=[" ".join(f) + f"-{n or 1}r" for n, f, _ in BAD_INPUT])
def test_bad_input(nproc, flags, named, tmp_path, monkeypatch, capsys):
    assert named in refusal("cp_train.py", nproc, TINY + ["--max_iters", "2", "--out_dir", str(tmp_path)] + flags,
                            monkeypatch, capsys)


def test_pytorch_implementation_on_cpu_is_one_clear_error(tmp_path, monkeypatch, capsys):
    """torch's context_parallel has sharding rules for CUDA's SDPA kernels only (CPU: NotImplementedError)."""
    error = refusal("cp_train.py", 2, TINY + ["--device", "cpu", "--implementation", "pytorch",
                                               "--out_dir", str(tmp_path)], monkeypatch, capsys)
    assert error.startswith("error: --implementation:") and "CUDA" in error
