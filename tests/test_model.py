"""common/: the model's per-name initialisation, the presets, the data and the flags."""
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
    """nanoGPT's TF32 on CUDA (#28 item 10); `--tf32 false` and CPU runs leave fp32 matmuls alone."""
    numerics([], use_cuda=True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    numerics(["--tf32", "false"], use_cuda=True)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    numerics([], use_cuda=False)  # the CPU path changes nothing
    assert not torch.backends.cuda.matmul.allow_tf32
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_sets_torch_cublas_and_sdpa_math(numerics, monkeypatch):
    """--deterministic (#28 item 2): torch's deterministic mode, cuBLAS's fixed workspace, and on CUDA
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
