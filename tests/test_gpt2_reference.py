"""common.model.GPT against Hugging Face transformers' GPT2LMHeadModel, an implementation written elsewhere.

Every other numeric test (parity rows, the plain loop, the reference run) runs common.model.GPT, so a bug in the
model itself would agree with itself everywhere. Here our randomly initialised weights are loaded into a
GPT2LMHeadModel built from a GPT2Config (random init, nothing downloaded), with nanoGPT's from_pretrained mapping
(the same names; the Conv1D weights transposed), and the logits, the loss and every parameter's gradient must match
in fp32. transformers is a test dependency only: nothing under common/ or *_train.py imports it.
"""
import torch
# Only these two names: the package's import is the slow part of this test. Not importorskip: requirements-test.txt
# makes transformers a dependency of the suite, so a missing install fails here rather than skipping the check.
from transformers import GPT2Config, GPT2LMHeadModel

from common.data import get_batch
from common.model import GPT, GPTConfig

# TINY's shape (conftest); the vocabulary is GPT-2's padded one, which the real batch's token ids need
CONFIG = GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True)
# Relative to each tensor's largest magnitude: max|ours - theirs| / max|theirs| (loss: |ours - theirs| / |theirs|).
# Measured here: logits 3.1e-7, loss 0, gradients at most 2.9e-7 (the same fp32 math, summed in other orders).
TOL = 1e-5
# HF's Conv1D stores its weight as (in, out), nn.Linear as (out, in): nanoGPT's from_pretrained transposes these
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def to_hf(state):
    """Our state dict under GPT2LMHeadModel's names (the same as ours, as in nanoGPT), Conv1D weights transposed."""
    return {name: tensor.t() if name.endswith(CONV1D) else tensor for name, tensor in state.items()}


def hf_gpt2(config):
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd, n_layer=config.n_layer,
        n_head=config.n_head, n_inner=None,  # None: 4 * n_embd, as our MLP
        activation_function="gelu",  # the exact (erf) GELU, nn.GELU(); GPT2Config's default is the tanh gelu_new
        layer_norm_epsilon=1e-5,  # our LayerNorm passes 1e-5; the config's default is also 1e-5, stated to pin it
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=True,  # lm_head is wte, as ours
        # eager: softmax(q k^T * hs^-0.5 + mask) v written out in matmuls, not the scaled_dot_product_attention
        # kernel that ours calls, so the reference does not share the attention code it checks
        attn_implementation="eager",
    ))


def rel(ours, theirs):
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def test_gpt_matches_transformers_gpt2():
    ours = GPT(CONFIG, seed=1337)
    # Our init leaves biases 0 and LayerNorm weights 1, where a bias left out or two LayerNorms swapped by the
    # mapping would go unseen: give every one of them random values (a fixed generator) before the copy
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=g))
    theirs = hf_gpt2(CONFIG)
    # GPT2LMHeadModel's name does not tell transformers its loss (it warns, then takes this one): named, to pin it
    theirs.loss_type = "ForCausalLM"

    # The mapping covers every tensor on both sides, no leftovers; strict loading checks the same from HF's side
    mapped = to_hf(ours.state_dict())
    assert mapped.keys() == theirs.state_dict().keys(), mapped.keys() ^ theirs.state_dict().keys()
    theirs.load_state_dict(mapped, strict=True)
    assert theirs.lm_head.weight is theirs.transformer.wte.weight  # still tied after loading: one gradient
    ours_params, theirs_params = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert ours_params.keys() == theirs_params.keys()  # the tied head once on each side (named under wte)
    for name, p in ours_params.items():
        assert torch.equal(to_hf({name: p})[name], theirs_params[name]), name

    x, y = get_batch("train", 0, 8, 32, 1337)
    # HF shifts its labels inside (position t predicts labels[t + 1]) and has no target for the last position;
    # ours takes y = x shifted by 1: ignoring our last column (-1, nanoGPT's ignore index) gives both the same
    # B * (T - 1) terms of the mean, so HF's own loss code is the reference, not a cross-entropy written here
    targets = y.clone()
    targets[:, -1] = -1
    assert torch.equal(y[:, :-1], x[:, 1:])
    logits, loss = ours(x, targets)
    out = theirs(input_ids=x, labels=x, use_cache=False)
    loss.backward()
    out.loss.backward()

    diffs = {"logits": rel(logits, out.logits), "loss": abs(loss.item() - out.loss.item()) / out.loss.item()}
    for name, p in ours_params.items():
        assert p.grad is not None and theirs_params[name].grad is not None, name
        diffs[name] = rel(to_hf({name: p.grad})[name], theirs_params[name].grad)
    grads = max(v for k, v in diffs.items() if k not in ("logits", "loss"))
    print(f"relative differences: logits {diffs['logits']:.1e}, loss {diffs['loss']:.1e}, gradients <= {grads:.1e}")
    assert logits.shape == out.logits.shape == (8, 32, CONFIG.vocab_size)  # ours: every position's logits
    bad = {k: v for k, v in diffs.items() if not v <= TOL}  # `not <=`: a NaN fails
    assert not bad, bad
