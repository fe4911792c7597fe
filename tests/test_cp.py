"""cp_train.py: each attention mode equals full causal attention (output, dq, dk, dv) at cp 2 and 4, ring and
allgather also with their blocks by the fused flash kernel (its CPU op here; the CUDA op's arguments on fake CUDA
tensors); the causal balance counted from the windows the code computes (zigzag equal, contiguous at the
formula's ratio); the bytes each mode sends per layer per rank against the docstring's formulas; saved
activations per rank at cp=2 against one process; bad input. Loss parity (every mode, zigzag or not, T/cp = 12,
DP 2 x CP 2) is in tests/test_parity.py."""
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch._subclasses.fake_tensor import FakeTensorMode

import cp_train
import plan
from conftest import TINY, refusal, spawn
from common import flash
from common.distributed import torch_name
from common.metrics import SavedActivations
from common.model import GPT, GPTConfig
from cp_train import (AllGatherAttention, CPGroup, CPGPT, RingAttention, block_backward, block_forward, causal_window,
                      positions, ulysses_attention)

MODES = [("allgather", True), ("ring", True), ("ring", False), ("ulysses", False)]
MODES_FUSED = [(m, z, False) for m, z in MODES] + [(m, z, True) for m, z in MODES if m != "ulysses"]
B, H, D = 2, 4, 8  # rows, heads, head_dim of the attention tests


def attention(mode, q, k, v, cp):
    if mode == "ulysses":
        return ulysses_attention(q, k, v, cp, 0.0)
    return (RingAttention if mode == "ring" else AllGatherAttention).apply(q, k, v, cp)


def _max_relative_diff(got, expected):
    """Max |difference|, relative where the reference exceeds 1 (fp32 sums of T products of O(1) values)."""
    return max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(got, expected))


def _groups(rank, world_size):
    """{cp: this rank's CP group}: cp=4 all ranks, cp=2 ranks (0, 1) and (2, 3); every rank creates every group."""
    pairs, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    return {4: dist.group.WORLD, 2: pairs}


def _layer_equals_full_attention(groups, T=24):
    """Max |difference| of out, dq, dk, dv (this rank's positions) from full causal SDPA, per (cp, mode, zigzag,
    fused): ring and allgather also with common.flash.FUSED forced on (the CPU flash kernel, fp32)."""
    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v, dout = (torch.randn(B, H, T, D) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=True)
    out.backward(dout)
    diffs = {}
    for cp_size, group in groups.items():
        for mode, zigzag, fused in MODES_FUSED:
            flash.FUSED = fused
            cp = CPGroup(group, T, zigzag, torch.device("cpu"))
            local = [t[:, :, cp.owned].clone().requires_grad_() for t in (q, k, v)]
            y = attention(mode, *local, cp)
            y.backward(dout[:, :, cp.owned])
            flash.FUSED = None
            got, expected = [y] + [t.grad for t in local], [out.detach()] + [t.grad for t in full]
            diffs[cp_size, mode, zigzag, fused] = _max_relative_diff(got, [b[:, :, cp.owned] for b in expected])
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
            out = blocks(x.detach()[:, cp.owned].requires_grad_())
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
        assert sorted(r["layers"]) == sorted((cp, m, z, f) for cp in (2, 4) for m, z, f in MODES_FUSED)
        for key, diff in r["layers"].items():
            assert diff <= 1e-6, (r, key, diff)


def _windows(T, cp, r, zigzag):
    """Every rank's positions and rank r's window on each key block, as CPGroup computes them."""
    pos = [positions(T, cp, j, zigzag) for j in range(cp)]
    return pos, [causal_window(pos[r], p) for p in pos]


def _blocks_of_rank(q, dout, blocks, windows):
    """One rank's out, lse, dq, and its [dK; dV] share of every key block, by cp_train's block_forward and
    block_backward over all the blocks, called as ring and allgather call them (all blocks given: no ranks).
    q, dout: (B, H, T/cp, D) of this rank's positions; blocks: every rank's (2, B, H, T/cp, D) [K; V]."""
    scale = q.size(-1) ** -0.5
    out = torch.zeros_like(q, dtype=torch.float32)
    lse = torch.full(out.shape[:-1] + (1,), float("-inf"), device=q.device)
    rests = [block_forward(q, kv, w, out, lse, scale) for kv, w in zip(blocks, windows)]
    dq = torch.zeros_like(out)
    dkv = [block_backward(q, kv, w, dout, out, lse, dq, scale, rest) for kv, w, rest in zip(blocks, windows, rests)]
    return out, lse, dq, dkv, rests


@pytest.mark.parametrize("cp,zigzag", [(2, True), (2, False), (3, True)])
def test_fused_blocks_equal_the_math_and_full_attention(cp, zigzag, monkeypatch):
    """Each rank's blocks (whole windows, windows cut to a suffix of queries or a prefix of keys, the causal one on
    its own block, skipped ones) by the CPU flash kernel (common.flash.FUSED forced on) and by the explicit math: out,
    lse, dq and its share of every block's dK,dV, against full causal SDPA on this rank's queries. Backward is
    given the final (merged) out and lse: fed a block's own, it would miss the other blocks' share of the softmax
    (checked: this fails then). Tolerance 2e-6; measured at most 7.9e-7 (math), 5.8e-7 (fused)."""
    T, scale = 24, D ** -0.5
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D) for _ in range(4))
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True: key after query
    full_lse = (q @ k.transpose(-2, -1) * scale).masked_fill(causal, float("-inf")).logsumexp(-1, keepdim=True)
    for r in range(cp):
        pos, windows = _windows(T, cp, r, zigzag)
        owned = pos[r]
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        full_out = F.scaled_dot_product_attention(*full, is_causal=True)
        full_out.backward(torch.zeros_like(dout).index_copy(2, owned, dout[:, :, owned]))  # from rank r's rows only
        expected = [full_out[:, :, owned].detach(), full_lse[:, :, owned], full[0].grad[:, :, owned]]
        expected += [torch.stack([full[1].grad[:, :, p], full[2].grad[:, :, p]]) for p in pos]
        blocks = [torch.stack([k[:, :, p], v[:, :, p]]) for p in pos]  # every rank's [K; V]
        for fused in (False, True):
            monkeypatch.setattr(flash, "FUSED", fused)
            out, lse, dq, dkv, _ = _blocks_of_rank(q[:, :, owned], dout[:, :, owned], blocks, windows)
            diff = _max_relative_diff([out, lse, dq] + dkv, expected)
            print(f"cp={cp} zigzag={zigzag} rank {r} fused={fused}: max relative difference {diff:.2e}")
            assert diff <= 2e-6, (cp, zigzag, r, fused, diff)


def test_fused_kernel_only_on_cuda_bf16_fp16_and_its_cuda_ops_arguments(monkeypatch):
    """The CUDA branch on fake CUDA tensors (FakeTensorMode: torch's meta kernels check each op's arguments and
    give its outputs): which blocks take the fused kernel, and the calls of the CUDA flash ops, with what the
    forward returned for cum_seq_q/k, max_q/k and the philox state passed back to backward."""
    called = []

    class Aten:  # common.flash.aten, recording the ops called
        def __getattr__(self, name):
            called.append(name)
            return getattr(torch.ops.aten, name)
    monkeypatch.setattr(flash, "aten", Aten())
    capability = [(9, 0)]  # an H100's; a V100's (7, 0) has no flash kernel
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[0])
    with FakeTensorMode():
        kinds = [("cuda", torch.bfloat16), ("cuda", torch.float16), ("cuda", torch.float32), ("cpu", torch.bfloat16)]
        assert [flash.fused(torch.empty(1, D, device=d, dtype=t)) for d, t in kinds] == [True, True, False, False]
        assert not flash.fused(torch.empty(1, 512, device="cuda", dtype=torch.bfloat16))  # head size over 256
        capability[0] = (7, 0)
        assert not flash.fused(torch.empty(1, D, device="cuda", dtype=torch.bfloat16))
        capability[0] = (9, 0)
        torch.use_deterministic_algorithms(True)  # --deterministic: the math path
        try:
            assert not flash.fused(torch.empty(1, D, device="cuda", dtype=torch.bfloat16))
        finally:
            torch.use_deterministic_algorithms(False)
        q, dout = torch.empty(2, B, H, 6, D, device="cuda", dtype=torch.bfloat16).unbind(0)  # a window's 6 queries
        k, v = torch.empty(2, B, H, 12, D, device="cuda", dtype=torch.bfloat16).unbind(0)  # and 12 keys
        out, lse, rest = flash.block_attention(q, k, v, False, D ** -0.5)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (B, H, 6, 1), torch.float32)
        assert len(rest) == 6 and rest[2:4] == [6, 12]  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed, offset
        grads = flash.block_backward(dout, q, k, v, out.float(), lse, False, D ** -0.5, rest)
        assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in (q, k, v)]
    assert called == ["_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"]


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
    assert len(set(computed)) == 1 and computed[0] == (T // cp) ** 2 * (cp + 1) // 2  # the diagonal + half of the rest
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
            elif mode == "allgather":  # one all-gather; backward: it again, and the reduce-scatter of dK,dV
                assert (forward, backward) == ((cp - 1) * kv, 2 * (cp - 1) * kv), (cp, mode, zigzag, forward, backward)
            else:  # cp-1 ring steps; backward: K,V again, and each dK,dV accumulator's cp steps home
                assert (forward, backward) == ((cp - 1) * kv, (2 * cp - 1) * kv), (cp, mode, zigzag, forward, backward)


def test_plan_predicts_the_bytes_each_layer_sends(unit):
    """plan.py's figures for cp_train.py at one layer, one micro-step, fp32 (what the rank hands each collective)
    equal the numbers measured above, once each collective's hand-over is turned into what leaves the rank."""
    T, C = 32, H * D
    for r in unit:
        for (cp, mode, zigzag), (forward, backward) in r["sent"].items():
            flags = ["--n_layer", "1", "--n_head", str(H), "--n_embd", str(C), "--block_size", str(T), "--batch_size",
                     str(B * 4 // cp), "--dropout", "0", "--dtype", "float32", "--cp_mode", mode,
                     "--context_parallel_size", str(cp)] + (["--load_balance", "false"] if mode == "ring" and not zigzag
                                                            else [])
            leaves = {"send": 1, "all_gather": cp - 1, "reduce_scatter": Fraction(cp - 1, cp),
                      "all_to_all": Fraction(cp - 1, cp)}  # of the bytes handed over
            comm = plan.plan("cp_train.py", 4, flags)[0].comm
            sent = sum(leaves[key.split("@")[0]] * nbytes for key, nbytes in comm.items() if key.endswith("@cp"))
            assert sent == 4 * (forward + backward), (cp, mode, zigzag, comm, forward, backward)


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


def test_torch_ddp_under_compile_needs_buckets_of_a_mib(tmp_path, monkeypatch, capsys):
    """dynamo splits torch DDP's compiled graph at its buckets (the first: 1 MiB): smaller ones are one line, as in
    ddp_train.py (test_reliability's BAD); checked before the CUDA-only peer is built (a GPU faked)."""
    monkeypatch.setattr(cp_train, "uses_cuda", lambda args: True)
    flags = ["--implementation", "pytorch", "--bucket_cap_mb", "0.5", "--out_dir", str(tmp_path)]
    error = refusal("cp_train.py", 2, TINY + flags + ["--compile"], monkeypatch, capsys)
    assert error.startswith("error: --compile:") and "--bucket_cap_mb" in error


def test_pytorch_implementation_on_cpu_is_one_clear_error(tmp_path, monkeypatch, capsys):
    """torch's context_parallel has sharding rules for CUDA's SDPA kernels only (CPU: NotImplementedError)."""
    error = refusal("cp_train.py", 2, TINY + ["--device", "cpu", "--implementation", "pytorch",
                                               "--out_dir", str(tmp_path)], monkeypatch, capsys)
    assert error.startswith("error: --implementation:") and "CUDA" in error
