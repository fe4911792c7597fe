"""tp_train.py: each parallel layer equals its unsharded layer (forward and grads, SP off/on), shards
equal slices of the reference init, the Megatron communication counts, activation memory with SP (in
the blocks and in the script's summary), the strategy's gradients and clipping norm, the full
checkpoint, dropout's streams (own per TP rank in the TP region, shared outside it; resume with dropout bit
for bit), each rank's shards and rows in the real main() (tests/probe.py), bad input.
tp_overlap_train.py (tier 2): its overlapped layers equal the unsharded ones and send the same numbers in
pieces, and its bad input (its diff against tp_train.py is bounded in tests/test_tiers.py)."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import (TINY, TP_DROPOUT, TP_DROPOUT_STEPS, DeviceMemory, assert_alone_is_batched_prefix, cpu_copies_only,
                      launch, probe, read_metrics, refusal, run_record, spawn, tp_dropout_args)
from common.data import get_batch
from common.distributed import torch_name
from common.model import GPT, GPTConfig
from common.metrics import SavedActivations
import plan
import tp_overlap_train
import tp_train
from tp_overlap_train import OVERLAP_CHUNKS
from tp_train import TPGroup, TPGPT, TensorParallel, all_reduce_grads, shard, shard_dim, unshard

CONFIG = GPTConfig(block_size=16, vocab_size=50304, n_layer=2, n_head=4, n_embd=32)
B, T, C = 2, CONFIG.block_size, CONFIG.n_embd


def _seq(t, tp):  # this rank's sequence shard of a (B, T, ...) tensor, or all of it without SP
    return t.chunk(tp.size, dim=1)[tp.rank] if tp.sp else t


def _max_diff(pairs):
    """Largest |a - b|, relative where the reference exceeds 1 (fp32 sums of ~100 products of O(1) values)."""
    return max(((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item() for a, b in pairs)


def _layers_equal_unsharded(rank, world_size):
    return {(sp, overlap): _layers_equal_unsharded_sp(sp, overlap) for sp in (False, True) for overlap in (False, True)}


def _tp_group(sp, overlap):
    """tp_train.py's TPGroup, or with overlap tp_overlap_train.py's (--tp_overlap on), and the script's module."""
    if overlap:
        return tp_overlap_train.TPGroup(dist.group.WORLD, sp, overlap=True), tp_overlap_train
    return TPGroup(dist.group.WORLD, sp), tp_train


def _layers_equal_unsharded_sp(sp, overlap=False):
    """Each parallel layer vs its unsharded counterpart on the same input and output gradient (overlap:
    tp_overlap_train.py's Functions, whose collectives travel in pieces under the matmuls)."""
    tp, script = _tp_group(sp, overlap)
    torch.manual_seed(0)  # the same full tensors on every rank
    diffs = {}

    # column-parallel (c_attn: fused q, k, v) and row-parallel linears
    for kind, name, in_f, out_f in (("column", "h.0.attn.c_attn", C, 3 * C), ("column", "h.0.mlp.c_fc", C, 4 * C),
                                    ("row", "h.0.mlp.c_proj", 4 * C, C)):
        full = torch.nn.Linear(in_f, out_f)
        x = torch.randn(B, T, in_f, requires_grad=True)
        grad_out = torch.randn(B, T, out_f)
        y = full(x)
        y.backward(grad_out)
        layer = (script.ColumnParallelLinear if kind == "column" else script.RowParallelLinear)(tp, in_f, out_f, True)
        with torch.no_grad():
            layer.weight.copy_(shard(name + ".weight", full.weight, tp.rank, tp.size))
            layer.bias.copy_(shard(name + ".bias", full.bias, tp.rank, tp.size))
        if kind == "column":  # input: whole (or this rank's sequence shard); output: this rank's features
            x_local = _seq(x.detach(), tp).clone().requires_grad_()
            y_local = layer(x_local)
            y_local.backward(shard(name + ".weight", grad_out.transpose(0, 2), tp.rank, tp.size).transpose(0, 2))
            y_ref = shard(name + ".weight", y.detach().transpose(0, 2), tp.rank, tp.size).transpose(0, 2)
            x_grad_ref = _seq(x.grad, tp)
        else:  # input: this rank's features; output: whole (or this rank's sequence shard)
            x_local = x.detach().chunk(tp.size, dim=2)[tp.rank].clone().requires_grad_()
            y_local = layer(x_local)
            y_local.backward(_seq(grad_out, tp))
            y_ref, x_grad_ref = _seq(y.detach(), tp), x.grad.chunk(tp.size, dim=2)[tp.rank]
            if sp:  # the replicated bias saw only this rank's sequence shard
                all_reduce_grads([layer.bias.grad], tp.group)
        diffs[f"{kind} {name}"] = _max_diff([
            (y_local, y_ref), (x_local.grad, x_grad_ref),
            (layer.weight.grad, shard(name + ".weight", full.weight.grad, tp.rank, tp.size)),
            (layer.bias.grad, shard(name + ".bias", full.bias.grad, tp.rank, tp.size))])

    # vocab-parallel embedding
    full = torch.nn.Embedding(CONFIG.vocab_size, C)
    idx = torch.randint(0, CONFIG.vocab_size, (B, T))
    idx[0, :4] = torch.tensor([0, CONFIG.vocab_size // 2 - 1, CONFIG.vocab_size // 2, CONFIG.vocab_size - 1])  # edges
    grad_out = torch.randn(B, T, C)
    full(idx).backward(grad_out)
    emb = script.VocabParallelEmbedding(tp, CONFIG.vocab_size, C)
    with torch.no_grad():
        emb.weight.copy_(shard("transformer.wte.weight", full.weight, tp.rank, tp.size))
    out = emb(idx)
    out.backward(_seq(grad_out, tp))
    diffs["vocab embedding"] = _max_diff([(out, _seq(full(idx).detach(), tp)),
                                          (emb.weight.grad, shard("transformer.wte.weight", full.weight.grad, tp.rank, tp.size))])

    # vocab-parallel cross-entropy (no SP involved: it sees the whole sequence)
    logits = (3 * torch.randn(B * T, CONFIG.vocab_size)).requires_grad_()
    targets = torch.randint(0, CONFIG.vocab_size, (B * T,))
    targets[:2] = torch.tensor([0, CONFIG.vocab_size - 1])
    F.cross_entropy(logits, targets).backward()
    logits_local = logits.detach().chunk(tp.size, dim=1)[tp.rank].clone().requires_grad_()
    loss = script.VocabParallelCrossEntropy.apply(logits_local, targets, emb.vocab_start, tp.group).mean()
    loss.backward()
    diffs["vocab-parallel cross-entropy"] = _max_diff([(loss, F.cross_entropy(logits.detach(), targets)),
                                                        (logits_local.grad, logits.grad.chunk(tp.size, dim=1)[tp.rank])])
    return diffs


def _unit_checks(rank, world_size):
    """Every in-process check on 2 gloo ranks in one spawn (starting ranks costs seconds)."""
    return dict(layers=_layers_equal_unsharded(rank, world_size), model=_model_equals_reference(rank, world_size),
                counts=_count_all(rank, world_size), activations=_activation_bytes(rank, world_size),
                checkpoint=_full_state_memory(rank, world_size), step=_step_bytes(rank, world_size))


@pytest.fixture(scope="module")
def unit():
    return spawn(_unit_checks, 2)


def test_each_parallel_layer_equals_the_unsharded_layer(unit):
    for by_sp in (r["layers"] for r in unit):
        assert len(by_sp) == 4  # SP off and on, --tp_overlap off and on
        for sp, diffs in by_sp.items():
            assert len(diffs) == 5
            for layer, diff in diffs.items():
                assert diff <= 1e-6, (sp, layer, diff)


BALANCED = GPTConfig(block_size=16, vocab_size=256, n_layer=4, n_head=4, n_embd=64)  # no dominant tensor


def _full_state_memory(rank, world_size):
    """full_state after one step on BALANCED, under DeviceMemory; for reference, every full tensor gathered."""
    args = SimpleNamespace(activation_checkpointing="none", compile=False,
                           tensor_parallel_size=2, sequence_parallel=False, loss_parallel=True,
                           seed=0, grad_accum_steps=1, dtype="float32", weight_decay=0.1, learning_rate=1e-3,
                           beta1=0.9, beta2=0.95)
    strategy = TensorParallel(BALANCED, args, torch.device("cpu"))
    optimizer = strategy.configure_optimizer(args)
    x, y = get_batch("train", 0, B, T, seed=0)
    strategy.forward_backward(x % BALANCED.vocab_size, y % BALANCED.vocab_size, sync=True)
    optimizer.step()
    with DeviceMemory() as memory:
        state, optim = strategy.full_state(optimizer)
    reference = {n: strategy.full_tensor(n, p.detach()) for n, p in strategy.model.named_parameters()}
    largest = max(4 * t.numel() for t in reference.values())
    if rank != 0:
        return state, optim, memory.peak, largest
    same = all(torch.equal(state[n], t) for n, t in reference.items())
    return same, cpu_copies_only(memory, state, optim), memory.peak, largest, sum(4 * t.numel() for t in reference.values())


def test_full_state_gathers_a_tensor_at_a_time_into_rank_0s_cpu(unit):
    """On a GPU (modelled: DeviceMemory) each tensor is all-gathered from the TP group and rank 0 copies it to its
    CPU before the next: a few tensors alive at most, never the model (every rank kept every gathered tensor, and
    the AdamW state's, on its device); the other rank keeps nothing."""
    same, cpu_only, peak, largest, total = unit[0]["checkpoint"]
    assert same and cpu_only
    state, optim, other, _ = unit[1]["checkpoint"]
    assert state is None and optim is None
    assert max(peak, other) <= 3 * largest < total, (peak, other, largest, total)
    print(f"device bytes alive at most: rank 0 {peak:,}, rank 1 {other:,}; largest tensor {largest:,} of {total:,}")


def _model_equals_reference(rank, world_size):
    return [_model_equals_reference_sp(sp) for sp in (False, True)]


def _strategy(sp):
    """tp_train's TensorParallel on the 2 ranks (TP=2, D=1), as main() builds it."""
    args = SimpleNamespace(activation_checkpointing="none", compile=False,
                           tensor_parallel_size=2, sequence_parallel=sp, loss_parallel=True, seed=0,
                           grad_accum_steps=1, dtype="float32")
    return TensorParallel(CONFIG, args, torch.device("cpu"))


def _model_equals_reference_sp(sp):
    """Init shards = slices of the reference; loss, gradients (after forward_backward's SP all-reduce) and
    the pinned norm of clip_grad_norm_ = the reference's."""
    strategy = _strategy(sp)
    model, tp = strategy.model, strategy.model.tp
    ref = GPT(CONFIG, seed=0)
    reference = dict(ref.named_parameters())
    init_equal = all(torch.equal(p, shard(n, reference[n], tp.rank, tp.size)) for n, p in model.named_parameters())
    roundtrip = all(torch.equal(unshard(n, [shard(n, reference[n], r, 3) for r in range(3)]), reference[n])
                    for n in reference if shard_dim(n) is not None and reference[n].size(0) % 3 == 0)
    x, y = get_batch("train", 0, B, T, seed=0)
    _, loss = ref(x, y)
    loss.backward()
    tp_loss = strategy.forward_backward(x, y, sync=True)
    grad_diff = _max_diff((p.grad, shard(n, reference[n].grad, tp.rank, tp.size)) for n, p in model.named_parameters())
    norm = strategy.clip_grad_norm_(0.0)  # max_norm 0: measures only
    ref_norm = torch.stack([(p.grad * p.grad).sum() for p in ref.parameters()]).sum().sqrt()
    # the norm counting every parameter on every rank would be too large: replicated ones count once
    wrong = torch.stack([(p.grad * p.grad).sum() for p in model.parameters()]).sum()
    dist.all_reduce(wrong)
    return init_equal, roundtrip, abs(tp_loss.item() - loss.item()), grad_diff, norm.item(), ref_norm.item(), wrong.sqrt().item()


def test_shards_gradients_and_clipping_norm_equal_the_reference(unit):
    for init_equal, roundtrip, dloss, grad_diff, norm, ref_norm, wrong in sum((r["model"] for r in unit), []):
        assert init_equal, "each rank's shards must equal slices of the reference init"
        assert roundtrip
        assert dloss <= 1e-6 and grad_diff <= 1e-6, (dloss, grad_diff)
        assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (norm, ref_norm)
        assert wrong > ref_norm * (1 + 1e-4)  # the check would notice replicated params counted twice


COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single")


def _count_all(rank, world_size):
    counts = {(sp, whole): _count_collectives(sp, whole) for sp in (False, True) for whole in (False, True)}
    return counts | {(sp, "overlap"): _count_collectives(sp, False, overlap=True) for sp in (False, True)}


def _count_collectives(sp, whole_model, overlap=False):
    """Calls of each collective (and their sizes; for batch_isend_irecv, each isend's) in one forward and one
    backward."""
    tp, script = _tp_group(sp, overlap)
    calls, originals = [], {name: getattr(dist, torch_name(name)) for name in COLLECTIVES + ("batch_isend_irecv",)}

    def counting(name):
        def collective(tensor, *args, **kwargs):
            if name == "batch_isend_irecv":  # tensor: the list of P2POps
                calls.extend(("isend", op.tensor.numel()) for op in tensor if op.op is dist.isend)
            else:
                calls.append((name, tensor.numel()))
            return originals[name](tensor, *args, **kwargs)
        return collective

    if whole_model:
        module = script.TPGPT(tp, CONFIG, seed=0, device="cpu")
        x, y = get_batch("train", 0, B, T, seed=0)
        run = lambda: module(x, y)[1]
    else:
        module = script.TPGPT(tp, CONFIG, seed=0, device="cpu").transformer.h[0]
        x = torch.randn(B, T // tp.size if sp else T, C, requires_grad=True)
        run = lambda: module(x).square().sum()
    for name in originals:
        setattr(dist, torch_name(name), counting(name))
    try:
        out = run()
        forward = list(calls)
        calls.clear()
        out.backward()
        backward = list(calls)
    finally:
        for name, fn in originals.items():
            setattr(dist, torch_name(name), fn)

    def count(phase):
        return {name: sum(1 for n, _ in phase if n == name) for name in COLLECTIVES}
    if overlap:  # every call, with its size
        return forward, backward
    return count(forward), count(backward), sorted(set(n for _, n in forward + backward))


@pytest.fixture(scope="module")
def counts(unit):
    return unit[0]["counts"]


def test_megatron_communication_per_block(counts):
    # one block: without SP, g after attn.c_proj and mlp.c_proj (forward), f before c_attn and c_fc (backward)
    fwd, bwd, sizes = counts[False, False]
    assert fwd == {"all_reduce": 2, "all_gather_single": 0, "reduce_scatter_single": 0}
    assert bwd == {"all_reduce": 2, "all_gather_single": 0, "reduce_scatter_single": 0}
    assert sizes == [B * T * C]  # every one moves the whole (B, T, C) activation
    # with SP: an all-gather before each column-parallel linear and a reduce-scatter after each
    # row-parallel one, and the reverse in backward; the same bytes, no all-reduce
    fwd, bwd, sizes = counts[True, False]
    assert fwd == {"all_reduce": 0, "all_gather_single": 2, "reduce_scatter_single": 2}
    assert bwd == {"all_reduce": 0, "all_gather_single": 2, "reduce_scatter_single": 2}
    assert sizes == [B * T * C // 2, B * T * C]  # shard in, whole out (or the reverse)


def test_tp_overlap_sends_the_same_numbers_in_pieces(counts):
    # without SP: g's all-reduce after each row-parallel matmul in OVERLAP_CHUNKS pieces (forward); f's after
    # each column-parallel one whole (backward, under the weight gradient)
    forward, backward = counts[False, "overlap"]
    assert forward == 2 * OVERLAP_CHUNKS * [("all_reduce", B * T * C // OVERLAP_CHUNKS)]
    assert backward == 2 * [("all_reduce", B * T * C)]
    # with SP, 2 ranks: each all-gather and reduce-scatter is one ring pass of a sequence shard, what each
    # rank sends in the collective it replaces; nothing else
    forward, backward = counts[True, "overlap"]
    assert forward == backward == 4 * [("isend", B * T * C // 2)]


def test_megatron_communication_whole_model(counts):
    L = CONFIG.n_layer
    # + the embedding's g, the two loss all-reduces (max; sums of exp and target logits) in forward; the f
    # in front of lm_head in backward. Never a (B, T, V) collective: the logits are not gathered.
    fwd, bwd, sizes = counts[False, True]
    assert fwd["all_reduce"] == 2 * L + 1 + 2 and bwd["all_reduce"] == 2 * L + 1
    assert max(sizes) == B * T * C and 2 * B * T in sizes
    fwd, bwd, sizes = counts[True, True]
    assert fwd == {"all_reduce": 2, "all_gather_single": 2 * L + 1, "reduce_scatter_single": 2 * L + 1}
    assert bwd == {"all_reduce": 0, "all_gather_single": 2 * L + 1, "reduce_scatter_single": 2 * L + 1}


def _step_bytes(rank, world_size):
    """Bytes TensorParallel hands to each collective in one step at TP=2, D=1 (main()'s forward_backward(sync) and
    clip_grad_norm_; no loss average over one DP rank): an all-reduce's tensor, the others' input. SP off and on."""
    originals = {name: getattr(dist, torch_name(name)) for name in COLLECTIVES}
    handed = {}

    def counting(name):
        def collective(*args, **kwargs):
            x = args[0] if name == "all_reduce" else args[1]
            handed[name] = handed.get(name, 0) + x.numel() * x.element_size()
            return originals[name](*args, **kwargs)
        return collective

    result = {}
    for sp in (False, True):
        strategy, x, y = _strategy(sp), *get_batch("train", 0, B, T, seed=0)
        handed.clear()
        for name in originals:
            setattr(dist, torch_name(name), counting(name))
        try:
            strategy.forward_backward(x, y, sync=True)
            strategy.clip_grad_norm_(0.0)
        finally:
            for name, fn in originals.items():
                setattr(dist, torch_name(name), fn)
        result[sp] = dict(handed)
    return result


def test_plan_predicts_the_bytes_of_a_step(unit):
    """plan.py's figures for tp_train.py equal the bytes a step hands to each collective on the TP group."""
    keys = {"all_reduce": "all_reduce@tp", "all_gather_single": "all_gather@tp",
            "reduce_scatter_single": "reduce_scatter@tp"}
    flags = ["--n_layer", str(CONFIG.n_layer), "--n_head", str(CONFIG.n_head), "--n_embd", str(C), "--block_size",
             str(T), "--vocab_size", str(CONFIG.vocab_size), "--batch_size", str(B), "--dropout", "0", "--bias", "true",
             "--dtype", "float32"]
    for r in unit:
        for sp, handed in r["step"].items():
            predicted = plan.plan("tp_train.py", 2, flags + ["--sequence_parallel", str(sp)])[0].comm
            assert predicted == {keys[name]: nbytes for name, nbytes in handed.items()}, (sp, predicted, handed)


def _activation_bytes(rank, world_size):
    """Bytes autograd saves for backward in one forward of a stack of blocks, per rank, by storage."""
    config = GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=4, n_embd=128)
    result = {}
    for sp in (False, True):
        tp = TPGroup(dist.group.WORLD, sp)
        blocks = torch.nn.Sequential(*TPGPT(tp, config, seed=0, device="cpu").transformer.h)
        x = torch.randn(4, 64 // tp.size if sp else 64, config.n_embd, requires_grad=True)
        with SavedActivations() as saved:  # the meter behind the summary's saved_activation_bytes_per_rank
            out = blocks(x)
        out.sum().backward()
        result[sp] = saved.bytes
    return result


def test_sequence_parallel_saves_activation_memory(unit):
    sizes = unit[0]["activations"]
    print(f"activation bytes per rank saved by 2 blocks (TP=2, 128 wide, batch 4 x 64): SP off {sizes[False]}, "
          f"SP on {sizes[True]}")
    # SP shards what the LayerNorms save (input, per-row mean and rstd): each saves (B T/2 C + B T) fp32 less
    assert sizes[False] - sizes[True] == 2 * 2 * (4 * 64 // 2 * 128 + 4 * 64) * 4, sizes


def _ckpt(path):
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """3 steps at 2 ranks: custom with and without SP, pytorch; {(implementation, sp): out_dir}."""
    out = {}
    for impl, sp in (("custom", True), ("custom", False), ("pytorch", False)):
        out[impl, sp] = tmp_path_factory.mktemp(f"tp-{impl}-sp{sp}")
        flags = TINY + ["--max_iters", "3", "--implementation", impl, "--out_dir", str(out[impl, sp])]
        result = launch("tp_train.py", 2, flags + (["--sequence_parallel"] if sp else []), torchrun=False)
        assert result.returncode == 0, result.stderr[-3000:]
    return out


def _loaded(ckpt):
    """The plain GPT with the checkpoint's state loaded."""
    model = GPT(GPTConfig(**ckpt["config"]), device="meta")
    model.load_state_dict(ckpt["model"], assign=True)
    return model


def test_checkpoint_is_the_full_format_and_equals_single_process_training(runs, shared_run):
    reference = _ckpt(shared_run("ddp_train.py", None, TINY + ["--max_iters", "3"])[0] / "ckpt.pt")
    x, y = get_batch("train", 0, 8, 32, seed=0)
    ref_logits, ref_loss = _loaded(reference)(x, y)
    for (impl, sp), out in runs.items():
        ckpt = _ckpt(out / "ckpt.pt")
        assert ckpt["step"] == 3 and list(ckpt["model"]) == list(reference["model"])
        assert set(ckpt["optimizer"]) == set(reference["optimizer"])
        for name, t in reference["model"].items():
            assert ckpt["model"][name].shape == t.shape and torch.allclose(ckpt["model"][name], t, atol=1e-5), name
        for name, state in reference["optimizer"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(ckpt["optimizer"][name][key], state[key], atol=1e-6, rtol=1e-3), (impl, name, key)
        logits, loss = _loaded(ckpt)(x, y)  # the plain model computes what the single-process run's does
        assert (logits - ref_logits).abs().max().item() <= 1e-5 and abs(loss.item() - ref_loss.item()) <= 1e-5, impl


def test_the_script_measures_saved_activations_and_sp_shrinks_them(runs):
    """The summary's saved_activation_bytes_per_rank (the first micro-step, activations.first()) in both
    implementations, equal on the TP ranks; SP saves less by exactly its sharded LayerNorm activations."""
    saved = {key: [r for r in read_metrics(out) if r.get("summary")][-1]["saved_activation_bytes_per_rank"]
             for key, out in runs.items()}
    print(f"saved activation bytes per rank: {saved}")
    assert all(len(v) == 2 and v[0] == v[1] for v in saved.values()), saved
    B, T, C, L = 8, 32, 64, 2  # TINY's; 2 LayerNorms per block and ln_f, as in the block-level test above
    assert saved["custom", False][0] - saved["custom", True][0] == (2 * L + 1) * (B * T // 2 * C + B * T) * 4, saved


BAD_INPUT = [
    ("tp_train.py", None, ["--tensor_parallel_size", "2", "--n_head", "3", "--n_embd", "48"], "--n_head"),
    ("tp_train.py", None, ["--tensor_parallel_size", "2", "--vocab_size", "50305"], "--vocab_size"),
    ("tp_train.py", None, ["--tensor_parallel_size", "2"], "--tensor_parallel_size"),  # 2 x 1 != 1 rank
    ("tp_train.py", 2, ["--sequence_parallel", "--block_size", "31"], "--block_size"),
    ("tp_train.py", 2, ["--tensor_parallel_size", "3"], "--tensor_parallel_size"),
    ("tp_train.py", 4, ["--tensor_parallel_size", "2", "--batch_size", "6", "--grad_accum_steps", "2"], "--batch_size"),
    # the flag that moved names the script that has it, whatever its value
    ("tp_train.py", 2, ["--tp_overlap"], "--tp_overlap: the collectives overlapped with the matmuls are in tp_overlap_train.py"),
    ("tp_train.py", 2, ["--tp_overlap", "false"], "tp_overlap_train.py"),
    # torch's async TP needs compile and CUDA's symmetric memory: no PyTorch peer here (tp_train.py has DTensor's)
    ("tp_overlap_train.py", 2, ["--implementation", "pytorch"], "--implementation"),
    ("tp_overlap_train.py", 2, ["--implementation", "pytorch", "--tp_overlap", "false"], "--implementation"),
    ("tp_overlap_train.py", 2, ["--tensor_parallel_size", "3"], "--tensor_parallel_size"),
]


@pytest.mark.parametrize("script,nproc,flags,named", BAD_INPUT,
                         ids=[f"{s[:-9]}-" + " ".join(f) + f"-{n or 1}r" for s, n, f, _ in BAD_INPUT])
def test_bad_input(script, nproc, flags, named, tmp_path, monkeypatch, capsys):
    assert named in refusal(script, nproc, TINY + ["--max_iters", "2", "--out_dir", str(tmp_path)] + flags,
                            monkeypatch, capsys)


# ---- dropout: each TP rank its own stream inside the TP region, one shared stream outside it -----

def _paired_heads_state(config):
    """A full GPT state whose heads H/2.. have the weights of heads 0..: with 2 TP ranks, head h on rank 0 and
    head h on rank 1 compute the same thing, so their attention outputs are equal exactly when their
    dropout masks are."""
    state = GPT(config, seed=0).state_dict()
    for name in state:
        if "c_attn" in name:
            pairs = state[name].unflatten(0, (3, 2, -1))  # [q; k; v] x rank x this rank's rows
            pairs[:, 1] = pairs[:, 0]
    return state


def _dropout_streams(rank, world_size):
    from torch.distributed.tensor import DTensor
    from tp_train import TorchTP
    config = GPTConfig(**{**CONFIG.__dict__, "dropout": 0.5})
    x, y = get_batch("train", 0, B, T, seed=0)
    sdpa, result = F.scaled_dot_product_attention, {}
    for impl in ("custom", "pytorch"):
        for sp in (False, True):
            args = SimpleNamespace(activation_checkpointing="none", compile=False,
                                   tensor_parallel_size=2, sequence_parallel=sp, loss_parallel=True, seed=0,
                                   grad_accum_steps=1, dtype="float32")
            torch.manual_seed(100 + rank)  # unequal, as resume() leaves them from a checkpoint of another world size
            strategy = (TensorParallel if impl == "custom" else TorchTP)(config, args, torch.device("cpu"),
                                                                          _paired_heads_state(config))
            heads, dropouts = [], []

            def recording(*a, **kw):
                out = sdpa(*a, **kw)
                heads.append(out.detach().clone())
                return out
            F.scaled_dot_product_attention = recording
            hooks = [m.register_forward_hook(lambda m, i, out: dropouts.append(out.detach().clone()))
                     for m in strategy.model.modules() if isinstance(m, torch.nn.Dropout)]
            try:
                strategy.eval_loss(x, y)
                eval_heads = list(heads)
                heads.clear()
                strategy.forward_backward(x, y, sync=True)
            finally:
                F.scaled_dot_product_attention = sdpa
                for h in hooks:
                    h.remove()
            assert not any(isinstance(t, DTensor) for t in heads + dropouts)
            result[impl, sp] = eval_heads, heads, dropouts[len(dropouts) // 2:]  # the training forward's
    return result


def test_dropout_masks_differ_between_tp_ranks_heads_and_agree_where_activations_are_replicated():
    """--dropout 0.5 at TP=2. The attention-probability dropout on a rank's own heads (and, with SP, the
    embedding and residual dropouts on its sequence shard) must draw from the rank's own stream; the
    embedding and residual dropouts on the activations every TP rank holds whole (no SP) must drop the same
    units on every rank, or the replicated activations diverge. Built resumed from unequal RNG states."""
    r0, r1 = spawn(_dropout_streams, 2)
    for key in r0:
        (eval0, heads0, drop0), (eval1, heads1, drop1) = r0[key], r1[key]
        assert len(eval0) == len(heads0) == CONFIG.n_layer and len(drop0) == 1 + 2 * CONFIG.n_layer, key
        assert all(torch.equal(a, b) for a, b in zip(eval0, eval1)), key  # without dropout, paired heads agree
        assert all(not torch.equal(a, b) for a, b in zip(heads0, heads1)), key  # a rank's heads: its own masks
        assert all((a == 0).any() and (b == 0).any() for a, b in zip(drop0, drop1)), key
        _, sp = key
        masks_equal = [torch.equal(a == 0, b == 0) for a, b in zip(drop0, drop1)]
        if sp:  # sequence shards: each rank its own masks
            assert not any(masks_equal), key
        else:  # replicated: the same activations, the same masks, the same results on every TP rank
            assert all(masks_equal) and all(torch.equal(a, b) for a, b in zip(drop0, drop1)), key


RESUME_STEPS, RESUME_CUT = TP_DROPOUT_STEPS, 2


@pytest.mark.parametrize("impl,sp", TP_DROPOUT)  # SP: every fork; no SP: the shared stream
def test_resume_with_dropout_is_bit_identical(impl, sp, shared_run, tmp_path):
    """--dropout 0.5: RESUME_CUT steps, then --resume to RESUME_STEPS, equals the uninterrupted run bit for bit
    (losses, grad norms, evaluations and final state): the checkpoint's RNG states restore the shared and the forked
    streams. The evals (at the cut, in both the cut and the resumed run) draw nothing. The uninterrupted run is
    batched (tests/test_parity.py's 2-rank launch, after every run of it), the cut run's first steps a launch of
    their own: they must repeat it bit for bit, dropout included (a batched run is the run alone)."""
    from test_parity import launch_group
    shared_run.batch(2, launch_group(2))
    flags = tp_dropout_args(impl, sp)
    whole_dir = shared_run("tp_train.py", 2, flags + ["--max_iters", str(RESUME_STEPS)])[0]
    for steps in (RESUME_CUT, RESUME_STEPS):
        resume = ["--resume"] if steps == RESUME_STEPS else []
        result = launch("tp_train.py", 2, flags + ["--max_iters", str(steps), "--out_dir", str(tmp_path)] + resume,
                        torchrun=False)
        assert result.returncode == 0, result.stderr[-3000:]
        if steps == RESUME_CUT:  # alone: the batched run's first steps and its evaluation at step 0, bit for bit
            assert_alone_is_batched_prefix(run_record(tmp_path), run_record(whole_dir), RESUME_CUT)
    whole, cut = (_ckpt(folder / "ckpt.pt") for folder in (whole_dir, tmp_path))
    assert cut["step"] == RESUME_STEPS
    assert run_record(tmp_path) == run_record(whole_dir)  # every step, the evaluations too
    assert all(torch.equal(cut["model"][name], t) for name, t in whole["model"].items())


# Which dimension of each GPT weight TP splits over its ranks (all others: replicated, whole on every rank).
SHARDED = {"wte.weight": 0, "c_attn.weight": 0, "c_attn.bias": 0, "c_fc.weight": 0, "c_fc.bias": 0,
           "attn.c_proj.weight": 1, "mlp.c_proj.weight": 1}


@pytest.mark.parametrize("implementation", ["custom", "pytorch"])
def test_a_tp_rank_holds_one_tp_th_of_every_sharded_weight(implementation, tmp_path):
    """The real main() on a 2 (DP) x 2 (TP) grid, 2 micro-steps (tests/probe.py): each rank's local parameters
    are the full shapes with the sharded dimension halved, the replicated ones whole, and each training
    forward sees B / D / A rows."""
    ranks = probe("tp_train.py", 4, [*TINY, "--max_iters", "2", "--grad_accum_steps", "2", "--tensor_parallel_size", "2",
                                     "--implementation", implementation, "--out_dir", str(tmp_path)], tmp_path)
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32)  # TINY's
    full = {n: list(p.shape) for n, p in GPT(config, device="meta").named_parameters()}
    expected = {}
    for name, shape in full.items():
        dim = next((d for suffix, d in SHARDED.items() if name.endswith(suffix)), None)
        expected[name] = shape if dim is None else [s // 2 if d == dim else s for d, s in enumerate(shape)]
    assert sum(expected[n] != full[n] for n in full) == 1 + 6 * config.n_layer
    for r in ranks:
        assert r["params"] == expected, r["rank"]
        assert r["train_rows"] == [8 // 2 // 2] * 2 * 2, r["rank"]
