"""common/: the model's per-name initialisation, the presets, the data and the flags."""
import os

import numpy as np
import pytest
import torch

from common import data
from common.config import get_lr, parse_args
from common.model import GPT, PRESETS, GPTConfig, init_tensor, materialize_, num_params

SMALL = GPTConfig(block_size=16, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)


def test_init_is_identical_whole_or_materialised_block_by_block():
    whole = GPT(SMALL, seed=7)
    pieces = GPT(SMALL, seed=7, device="meta")
    assert all(p.is_meta for p in pieces.parameters())
    for i, block in enumerate(pieces.transformer.h):  # one block at a time, as sharded strategies do
        materialize_(block, f"transformer.h.{i}.", SMALL, seed=7)
    for name in ("wte", "wpe", "ln_f"):
        materialize_(pieces.transformer[name], f"transformer.{name}.", SMALL, seed=7)
    pieces.tie_weights()
    whole_state, piece_state = whole.state_dict(), pieces.state_dict()
    assert whole_state.keys() == piece_state.keys()
    for k in whole_state:
        assert torch.equal(whole_state[k], piece_state[k]), k
    # and a single tensor drawn alone equals the same slice of the model
    assert torch.equal(init_tensor("transformer.h.1.mlp.c_fc.weight", (128, 32), SMALL, 7),
                       whole.transformer.h[1].mlp.c_fc.weight)


def test_init_depends_on_seed_and_name_only():
    a, b, c = GPT(SMALL, seed=1), GPT(SMALL, seed=1), GPT(SMALL, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)
    assert not torch.equal(a.transformer.h[0].attn.c_attn.weight, a.transformer.h[1].attn.c_attn.weight)


def test_nanogpt_init_statistics_and_tied_head():
    config = GPTConfig(block_size=16, vocab_size=50304, n_layer=4, n_head=4, n_embd=128)
    model = GPT(config, seed=0)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 5e-4
    assert abs(model.transformer.h[0].mlp.c_proj.weight.std().item() - 0.02 / (2 * 4) ** 0.5) < 5e-4
    assert torch.equal(model.transformer.h[0].ln_1.weight, torch.ones(128))
    assert torch.equal(model.transformer.h[0].attn.c_attn.bias, torch.zeros(3 * 128))


def test_presets():
    gpt2 = GPT(PRESETS["gpt2"], device="meta")
    assert PRESETS["gpt2"].vocab_size == 50304
    assert num_params(gpt2) == 124_475_904  # GPT-2 124M with the padded vocabulary, tied head counted once
    small = GPT(PRESETS["small"], seed=0)
    logits, loss = small(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, 50304) and loss.ndim == 0


def test_no_bias_model_and_causality():
    config = GPTConfig(block_size=16, vocab_size=50304, n_layer=2, n_head=2, n_embd=32, bias=False)
    model = GPT(config, seed=0)
    assert all(not n.endswith(".bias") for n, _ in model.named_parameters())
    x = torch.randint(0, 50257, (1, 10))
    y = x.clone()
    y[0, 7:] = (y[0, 7:] + 1) % 50257
    # changing tokens 7.. must not change the logits of positions 0..6
    assert torch.allclose(model(x)[0][0, :7], model(y)[0][0, :7])


def test_shakespeare_tokens():
    assert len(data.tokens("train")) == 301_966
    assert len(data.tokens("val")) == 36_059
    assert int(np.max(data.tokens("train"))) < data.GPT2_VOCAB


def test_get_batch_is_deterministic_and_shifted():
    x1, y1 = data.get_batch("train", 5, 8, 32, seed=1)
    x2, y2 = data.get_batch("train", 5, 8, 32, seed=1)
    x3, _ = data.get_batch("train", 6, 8, 32, seed=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert x1.shape == (8, 32) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_user_text_file(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "DATA_ROOT", str(tmp_path / "data"))
    text = tmp_path / "mine.txt"
    text.write_text("To be, or not to be, that is the question. " * 200)
    assert data.prepare("mine", str(text)) is None
    assert len(data.tokens("train", "mine")) > 1000
    assert "no such file" in data.prepare("other", str(tmp_path / "missing.txt"))
    assert "--dataset nothing" in data.prepare("nothing")


def test_offline_dir_holds_the_text_and_the_tokenizer(tmp_path, monkeypatch):
    """NANODIST_OFFLINE_DIR: prepare() copies the text from the folder and tiktoken reads its BPE files there, with
    no network (both faked away); a folder without either file is refused in one line naming the variable."""
    import shutil
    import tempfile
    import urllib.request
    import tiktoken
    tiktoken.get_encoding("gpt2")  # its BPE files are in tiktoken's cache (downloaded if need be), as follows:
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") \
        or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    offline = tmp_path / "offline"
    shutil.copytree(cache, offline / "tiktoken_cache")
    (offline / "data" / "tinyshakespeare").mkdir(parents=True)
    (offline / "data" / "tinyshakespeare" / "input.txt").write_text("To be, or not to be: that is the question. " * 200)

    def offline_only(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline_only)  # the text's download
    monkeypatch.setattr(tiktoken.load, "read_file", offline_only)  # the BPE files' download (tiktoken 0.x)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # gpt2 is loaded again, from the cache
    monkeypatch.setattr(data, "DATA_ROOT", str(tmp_path / "data"))
    monkeypatch.setattr(data, "_tokens", {})  # the session's memmaps of the real data stay apart
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.delenv(data.OFFLINE_DIR, raising=False)
    assert "offline, set NANODIST_OFFLINE_DIR" in data.prepare("shakespeare")  # unset: the download, which fails
    monkeypatch.setenv(data.OFFLINE_DIR, str(offline))
    assert data.prepare("shakespeare") is None
    assert (tmp_path / "data" / "shakespeare" / "input.txt").read_text().startswith("To be, or not to be")
    assert 1000 < len(data.tokens("train")) + len(data.tokens("val")) < 5000  # this text's tokens
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(offline / "tiktoken_cache")
    for missing in ("tiktoken_cache", "data"):
        shutil.rmtree(offline / missing)
        assert data.prepare("shakespeare") == (
            f"NANODIST_OFFLINE_DIR: {offline} has no {os.path.join('data', 'tinyshakespeare', 'input.txt')}"
            if missing == "data" else f"NANODIST_OFFLINE_DIR: {offline} has no tiktoken_cache"
        ) + "; the folder must hold data/tinyshakespeare/input.txt and tiktoken_cache/ (docs/offline.md)"


def test_flags_bool_forms_and_presets():
    args = parse_args("test", argv=["--decay_lr=false", "--bias", "--preset", "gpt2", "--n_layer", "2"])
    assert args.decay_lr is False and args.bias is True
    assert (args.n_layer, args.n_embd, args.block_size) == (2, 768, 1024)
    assert args.lr_decay_iters == args.max_iters
    assert parse_args("test", argv=["--decay_lr"]).decay_lr is True


def test_lr_schedule():
    args = parse_args("test", argv=["--learning_rate", "1e-3", "--min_lr", "1e-4", "--warmup_iters", "10",
                                    "--max_iters", "100"])
    assert get_lr(0, args) == pytest.approx(1e-3 / 11)
    assert get_lr(10, args) == pytest.approx(1e-3)
    assert get_lr(100, args) == pytest.approx(1e-4)
    assert get_lr(55, args) == pytest.approx(1e-4 + 0.5 * 9e-4)
    args.decay_lr = False
    assert get_lr(0, args) == get_lr(99, args) == 1e-3


@pytest.fixture
def numerics(monkeypatch):
    """Runs set_numerics and restores torch's global switches afterwards (they outlive a test)."""
    from common.distributed import set_numerics
    backends = torch.backends
    saved = (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32, backends.cudnn.benchmark,
             backends.cuda.flash_sdp_enabled(), backends.cuda.mem_efficient_sdp_enabled(),
             backends.cuda.cudnn_sdp_enabled(), torch.are_deterministic_algorithms_enabled())
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield lambda argv, use_cuda: set_numerics(parse_args("test", argv=argv), use_cuda)
    backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32, backends.cudnn.benchmark = saved[:3]
    backends.cuda.enable_flash_sdp(saved[3])
    backends.cuda.enable_mem_efficient_sdp(saved[4])
    backends.cuda.enable_cudnn_sdp(saved[5])
    torch.use_deterministic_algorithms(saved[6])


def test_tf32_is_on_for_cuda_by_default_and_off_with_the_flag(numerics):
    """nanoGPT's TF32 on CUDA; `--tf32 false` and CPU runs leave fp32 matmuls alone."""
    numerics([], use_cuda=True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    numerics(["--tf32", "false"], use_cuda=True)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    numerics([], use_cuda=False)  # the CPU path changes nothing
    assert not torch.backends.cuda.matmul.allow_tf32
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_sets_torch_cublas_and_sdpa_math(numerics, monkeypatch):
    """--deterministic: torch's deterministic mode, cuBLAS's fixed workspace, and on CUDA
    only SDPA's math backend (the fused backwards sum with atomics); a user's own workspace is kept."""
    import os
    numerics(["--deterministic"], use_cuda=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not (torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()
                or torch.backends.cuda.cudnn_sdp_enabled())
    assert torch.backends.cuda.math_sdp_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    numerics(["--deterministic"], use_cuda=False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_clip_is_the_pinned_norm_in_a_few_kernels(monkeypatch):
    """common.distributed.clip_grad_norm_: sqrt of the sum of every gradient's squares (within 1e-7 of fp64's: CPU's
    fp32 (g * g).sum() per tensor is 3e-8 off at 3.2M numbers, its fp32 foreach norm 6e-5), every gradient scaled by
    min(1, max_norm / (norm + 1e-6)) in one foreach multiply; on CUDA from one foreach norm per list (its branch run
    here on CPU tensors: the calls, and the value within that kernel's serial CPU sum)."""
    import torch.distributed as dist
    from common.distributed import clip_grad_norm_, sum_of_squares
    torch.manual_seed(0)
    grads = [torch.randn(50304, 64), torch.randn(64) * 1e-3, torch.randn(192, 64)]
    exact = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()
    calls = {"_foreach_norm": 0, "_foreach_mul_": 0}
    for name in calls:
        def counted(*args, name=name, original=getattr(torch, name), **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(torch, name, counted)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        clipped = [g.clone() for g in grads]
        norm = clip_grad_norm_(clipped[:1], clipped[1:], 1.0)  # a sharded list (all-reduced) and a replicated one
    finally:
        dist.destroy_process_group()
    assert norm.dtype == torch.float32 and abs(norm.item() - exact.item()) <= 1e-7 * exact.item()
    assert calls == {"_foreach_norm": 0, "_foreach_mul_": 1}
    on_cuda = sum_of_squares(grads, torch.device("cuda")).sqrt()  # CUDA's branch
    assert calls["_foreach_norm"] == 1 and abs(on_cuda.item() - exact.item()) <= 1e-4 * exact.item()
    for g, c in zip(grads, clipped):
        assert torch.allclose(c, g * (1.0 / (norm + 1e-6)), rtol=1e-6, atol=0)
    measured = [g.clone() for g in grads]
    assert clip_grad_norm_(None, measured, 0).item() == pytest.approx(exact.item(), rel=1e-7)  # 0: only measures
    assert all(torch.equal(g, m) for g, m in zip(grads, measured))


@pytest.mark.parametrize("recompute", [False, True])  # backward: CPU's route, CUDA's (fused log-softmax kernels)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_equals_the_plain_form(dtype, recompute, monkeypatch):
    """common.model.cross_entropy, chunk by chunk, against F.cross_entropy on fp32 copies: the loss and the
    gradient (in the logits' dtype), with chunks that do not divide the rows, by both backward routes."""
    import common.model
    from common.model import ChunkedCrossEntropy
    monkeypatch.setattr(common.model, "RECOMPUTE_LOG_SOFTMAX", recompute)
    torch.manual_seed(0)
    logits = (3 * torch.randn(300, 1000)).to(dtype).requires_grad_()
    targets = torch.randint(0, 1000, (300,))
    targets[::7] = -1  # ignored, as nanoGPT's ignore_index=-1
    loss = ChunkedCrossEntropy.apply(logits, targets, 64)  # 4 chunks of 64 rows and one of 44
    loss.backward()
    grad, logits.grad = logits.grad, None
    plain = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-1)
    plain.backward()
    assert grad.dtype == dtype and abs(loss.item() - plain.item()) <= 1e-6 * plain.item()
    reference = logits.grad.float()  # fp32; ours is written in the logits' dtype
    # fp32: both hold the log-sum-exp (about 10 here) to a unit or a few in the last place, 9.5e-7 each, and each
    # softmax element is exp(z - lse): relative errors of that size (ours derives lse as loss + z_target: 3.8e-6
    # measured); bf16: one unit in its last place
    rel = 1e-5 if dtype == torch.float32 else 2 ** -7
    close = (grad.float() - reference).abs() <= rel * reference.abs() + 1e-6 * reference.abs().max()
    assert close.all()
    logits.grad = None  # a negative upstream gradient (a negated loss)
    (-3 * ChunkedCrossEntropy.apply(logits, targets, 64)).backward()
    reference = -3 * reference
    close = (logits.grad.float() - reference).abs() <= rel * reference.abs() + 1e-6 * reference.abs().max()
    assert close.all()


def _vocab_parallel_losses(rank, world_size):
    """Each script's VocabParallelCrossEntropy on this rank's vocabulary slice, in chunks of 7 rows, against
    F.cross_entropy of the whole logits: per-token losses and this slice's gradient, under upstream gradients of
    either sign and zero (a weighted sum of the losses)."""
    import torch.distributed as dist
    import hybrid_train
    import pp_vocab_train
    import tp_train
    torch.manual_seed(0)
    logits = 3 * torch.randn(50, 64)
    targets = torch.randint(0, 64, (50,))
    weights = torch.randn(50)
    weights[::9] = 0.0
    whole = logits.clone().requires_grad_()
    plain = torch.nn.functional.cross_entropy(whole, targets, reduction="none")
    (plain * weights).sum().backward()
    cols = slice(rank * 32, (rank + 1) * 32)
    out = []
    for module in (tp_train, pp_vocab_train, hybrid_train):
        module.LOSS_CHUNK_ROWS = 7
        mine = logits[:, cols].clone().requires_grad_()
        losses = module.VocabParallelCrossEntropy.apply(mine, targets, rank * 32, dist.group.WORLD)
        (losses * weights).sum().backward()
        dloss = (losses - plain).abs().max() / plain.abs().max()  # relative to the largest
        dgrad = (mine.grad - whole.grad[:, cols]).abs().max() / whole.grad.abs().max()
        out.append((dloss.item(), dgrad.item()))
    return out


def test_vocab_parallel_cross_entropy_in_chunks_equals_the_plain_form():
    from conftest import spawn
    for rank in spawn(_vocab_parallel_losses, 2):
        for dloss, dgrad in rank:  # tp, pp_vocab, hybrid
            assert dloss <= 1e-6 and dgrad <= 1e-6, rank


def loss_peak_bytes(chunked, rows, vocab, chunk_rows=1024):
    """The most bytes the loss path holds at once beyond its bf16 (rows, vocab) logits, forward and backward
    (conftest.DeviceMemory counts every tensor an op makes): ours, or the old form, F.cross_entropy of an fp32
    copy (what a `.float()` before the loss did)."""
    from conftest import DeviceMemory
    from common.model import ChunkedCrossEntropy
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))
    with DeviceMemory() as memory:
        if chunked:
            loss = ChunkedCrossEntropy.apply(logits, targets, chunk_rows)
        else:
            loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        loss.backward()
    return memory.peak


@pytest.mark.parametrize("recompute", [False, True])
def test_the_chunked_loss_never_holds_fp32_logits_for_the_whole_batch(recompute, monkeypatch):
    """Forward and backward: ours peaks at the bf16 gradient (2 bytes a logit) plus an fp32 chunk or two; the
    old form at 8 bytes a logit (the fp32 copy and its log-probs in forward; two fp32 gradients in backward)."""
    import common.model
    monkeypatch.setattr(common.model, "RECOMPUTE_LOG_SOFTMAX", recompute)
    rows, vocab, chunk = 512, 2048, 64
    ours, old = loss_peak_bytes(True, rows, vocab, chunk), loss_peak_bytes(False, rows, vocab, chunk)
    assert 2 * rows * vocab <= ours <= 2 * rows * vocab + 3 * 4 * chunk * vocab + 64 * rows, ours
    assert old >= 8 * rows * vocab, old


if __name__ == "__main__":  # PYTHONPATH=. python tests/test_model.py: the figures at --preset gpt2's 12 x 1024 rows
    import common.model
    for name, chunked, recompute in (("fp32 copy", False, None), ("chunked, CPU's backward", True, False),
                                     ("chunked, CUDA's backward", True, True)):
        common.model.RECOMPUTE_LOG_SOFTMAX = recompute
        peak = loss_peak_bytes(chunked, 12 * 1024, 50304)
        print(f"{name}: loss peak {peak / 2**30:.2f} GiB beyond the logits")
