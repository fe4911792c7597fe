"""--activation_checkpointing's memory (common/recompute.py): the bytes each mode keeps per layer, counted by the
saved-activation meter (common.metrics.SavedActivations), equal the expressions derived from common/model.py's
ops exactly, since both count the same tensors; and torch's selective policy recomputes the attention core only.

Per layer, s = T positions, b = rows, h = n_embd, a = heads, fp32 on CPU. Korthikanti et al. 2022 count 2-byte
activations and 1-byte dropout masks: s*b*h*(34 + 5*a*s/h) for none, 34*s*b*h for selective, 2*s*b*h for full.
That is 16 activations of s*b*h elements, 2 masks of s*b*h and, in attention, 2 of a*s*s*b and a mask of a*s*s*b.
Here every element is 4 bytes, the masks too (CPU's dropout keeps a float mask, scaled by 1/(1-p); CUDA's fused
dropout keeps bytes), and each LayerNorm keeps its mean and 1/std (2 x 4 bytes per position, s*b), which the paper
leaves out:
  none       4*(18*s*b*h + 3*a*s*s*b) + 16*s*b     SDPA's math path: CPU with dropout
  selective  4*18*s*b*h + 16*s*b                   (the core's q, k, v: c_attn's output, 12*s*b*h)
  full       4*s*b*h                               the block's input
Without dropout CPU's SDPA is a fused kernel (flash): it keeps q, k, v (c_attn's output), its output (c_proj's
input) and a log-sum-exp of a*s*b floats, never the s x s probabilities, and the masks are gone:
  none       64*s*b*h + 4*a*s*b + 16*s*b,  selective 64*s*b*h + 16*s*b: selective saves only the log-sum-exp.
With TP over t ranks (Korthikanti's s*b*h*(10 + 24/t + 5*a*s/(h*t))): the LayerNorms' inputs and outputs and the
residual dropouts' masks stay whole on every rank (24*s*b*h), the rest is split by heads or hidden units:
  none       24*s*b*h + 48*s*b*h/t + 12*a*s*s*b/t + 16*s*b
With SP the whole parts are split by sequence too, except the LayerNorms' outputs: the column-parallel linear
keeps its all-gathered input (2 x 4*s*b*h), which Megatron keeps sharded and all-gathers again in backward
(the paper's s*b*h*(34/t + 5*a*s/(h*t))):
  none       8*s*b*h + 64*s*b*h/t + 12*a*s*s*b/t + 16*s*b/t
selective drops the attention term in both; full keeps the block input, 4*s*b*h (SP: 4*s*b*h/t).
"""
import itertools
import json
import os
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY, launch
import plan
import common.recompute as recompute
from common.metrics import SavedActivations
from common.model import GPT, GPTConfig
from common.recompute import checkpoint_blocks, torch_checkpoint_blocks

S, B, H, A = 32, 3, 48, 4  # distinct, so that each term of an expression is visible
SBH = S * B * H
CPU_BYTES = {(dropout, mode): plan.layer_activations(S, B, H, A, mode, dropout)  # (dropout, mode) -> bytes a layer
             for dropout in (0.1, 0.0) for mode in recompute.MODES}


def saved_bytes(n_layer, mode, dropout):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=S, vocab_size=64, n_layer=n_layer, n_head=A, n_embd=H, dropout=dropout))
    checkpoint_blocks(model.transformer.h, mode)
    idx = torch.randint(0, 64, (B, S))
    with SavedActivations() as meter:
        _, loss = model(idx, idx)
    loss.backward()  # the recompute runs, and finds what it kept
    return meter.bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_whole_models_bytes_equal_plans_formula(dtype):
    """plan.model_activations: a forward of the whole model, embedding, blocks, head and loss, in fp32 and under
    bf16 autocast (its copies of the weights, the matmuls' bf16 outputs), each mode, with and without dropout."""
    for n_layer, vocab, mode, dropout in itertools.product((1, 2), (64, 1000), recompute.MODES, (0.1, 0.0)):
        torch.manual_seed(0)
        config = GPTConfig(block_size=S, vocab_size=vocab, n_layer=n_layer, n_head=A, n_embd=H, dropout=dropout)
        model = GPT(config)
        checkpoint_blocks(model.transformer.h, mode)
        idx = torch.randint(0, vocab, (B, S))
        with SavedActivations() as meter, torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
            model(idx, idx.clone())  # targets: their own storage, as a batch's are
        args = SimpleNamespace(dtype=dtype, activation_checkpointing=mode)
        assert meter.bytes == plan.model_activations(config, args, B, S, n_layer), (n_layer, vocab, mode, dropout)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_peaks_at_the_saved_bytes_and_the_loss_backward(dtype, monkeypatch):
    """plan.loss_backward: a forward and backward of the whole model (its gradients already held, as after a first
    step), with CUDA's loss path forced, peaks at plan's saved activations plus the logits' gradient and one loss
    chunk's fp32 work, less the few small tensors backward has freed by then (under 8 bytes a row): chunks of fewer
    rows than the batch's 96 and of more. Every storage counts while anything holds it (DeviceMemory's whole_run):
    the logits, whose Python tensor is gone, live on in the view the loss saved."""
    import common.model
    from conftest import DeviceMemory
    monkeypatch.setattr(common.model, "RECOMPUTE_LOG_SOFTMAX", True)
    for chunk, vocab in itertools.product((64, 4096), (2048, 4096)):
        monkeypatch.setattr(common.model, "LOSS_CHUNK_ROWS", chunk)
        monkeypatch.setattr(plan, "LOSS_CHUNK_ROWS", chunk)
        torch.manual_seed(0)
        config = GPTConfig(block_size=S, vocab_size=vocab, n_layer=2, n_head=A, n_embd=H, dropout=0.0)
        model = GPT(config)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        idx = torch.randint(0, vocab, (B, S))
        with DeviceMemory(whole_run=True) as memory:
            with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
                _, loss = model(idx, idx.clone())
            loss.backward()
        args = SimpleNamespace(dtype=dtype, activation_checkpointing="none")
        e = plan.compute_bytes(args)
        planned = plan.model_activations(config, args, B, S, 2) + plan.loss_backward(config, B * S, e)
        assert 0 <= planned - memory.peak <= 8 * B * S, (chunk, vocab, planned - memory.peak)


@pytest.mark.parametrize("dropout,mode", list(CPU_BYTES))
def test_bytes_per_layer_equal_the_formula(dropout, mode):
    """One layer more adds exactly the formula's bytes (the embedding, head and loss cancel)."""
    per_layer = saved_bytes(2, mode, dropout) - saved_bytes(1, mode, dropout)
    assert per_layer == CPU_BYTES[(dropout, mode)]


def test_tp_bytes_per_layer_equal_the_divided_formulas(tmp_path):
    """tp_train.py at t = 2, SP off and on, dropout 0.1: each rank's bytes per layer, in one launch of 12 runs."""
    t = 2
    whole = {mode: plan.layer_activations(S, B, H, A, mode, 0.1, t) for mode in recompute.MODES}
    sp = {mode: plan.layer_activations(S, B, H, A, mode, 0.1, t, sp=True) for mode in recompute.MODES}
    # the docstring's expressions, term by term: plan.py's are these
    assert whole["none"] == 24 * SBH + 48 * SBH // t + 12 * A * S * S * B // t + 16 * S * B
    assert sp["none"] == 8 * SBH + 64 * SBH // t + 12 * A * S * S * B // t + 16 * S * B // t
    flags = TINY + ["--n_head", str(A), "--n_embd", str(H), "--block_size", str(S), "--batch_size", str(B),
                    "--dropout", "0.1", "--max_iters", "1"]
    runs = {}
    argv = ["tp_train.py"]
    for sequence_parallel in ("false", "true"):
        for n_layer in (1, 2):
            for mode in recompute.MODES:
                out_dir = tmp_path / f"{sequence_parallel}-{n_layer}-{mode}"
                runs[(sequence_parallel, n_layer, mode)] = out_dir
                argv += flags + ["--n_layer", str(n_layer), "--sequence_parallel", sequence_parallel,
                                 "--activation_checkpointing", mode, "--out_dir", str(out_dir), "---"]
    result = launch("tests/runs.py", t, argv[:-1], torchrun=False)
    assert result.returncode == 0, result.stderr[-3000:]

    def per_rank(key):
        rows = [json.loads(line) for line in open(os.path.join(runs[key], "metrics.jsonl"))]
        return next(r for r in rows if r.get("summary"))["saved_activation_bytes_per_rank"]
    for sequence_parallel, expected in (("false", whole), ("true", sp)):
        for mode in recompute.MODES:
            one, two = per_rank((sequence_parallel, 1, mode)), per_rank((sequence_parallel, 2, mode))
            assert [b - a for a, b in zip(one, two)] == [expected[mode]] * t, (sequence_parallel, mode)


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_torch_selective_policy_recomputes_the_attention_core_only(dropout, monkeypatch):
    """PyTorch's selective (create_selective_checkpoint_contexts with attention_core_policy) on a block: the ops
    it recomputes are SDPA's (the fused kernel; or the math path's bmm's, softmax and dropout on the scores), no
    linear, LayerNorm or GELU; and the gradients are those without checkpointing, bit for bit."""
    decisions = []
    policy_fn = recompute.attention_core_policy

    def recording(ctx, op, *args, **kwargs):
        policy = policy_fn(ctx, op, *args, **kwargs)
        decisions.append((op.__name__.split(".")[0], policy))
        return policy
    monkeypatch.setattr(recompute, "attention_core_policy", recording)
    grads = []
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=S, vocab_size=64, n_layer=1, n_head=A, n_embd=H, dropout=dropout))
        torch_checkpoint_blocks(model.transformer.h, mode)
        idx = torch.randint(0, 64, (B, S))
        model(idx, idx)[1].backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    recomputed = {op for op, policy in decisions if policy == torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE}
    saved = {op for op, policy in decisions if policy == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE}
    if dropout:
        assert {"bmm", "_safe_softmax", "bernoulli_"} <= recomputed, recomputed
    else:
        assert recomputed == {"_scaled_dot_product_flash_attention_for_cpu"}, recomputed
    assert {"addmm", "native_layer_norm", "gelu"} <= saved and not recomputed & {"addmm", "native_layer_norm", "gelu"}
