"""--activation_checkpointing none|full|selective: keep fewer activations for backward and compute
them again there (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"). The same in every script: each applies checkpoint_blocks() to the blocks it runs (all of
them, or its stages' or chunks'), and its PyTorch peer torch_checkpoint_blocks().

  none       autograd keeps what each op saves for backward
  full       each block's forward runs under torch.utils.checkpoint: only the block's input is kept,
             and backward runs the block's forward once more before the block's backward (one more
             forward per step: about 4/3 of the compute)
  selective  only the attention core, softmax(q k^T / sqrt(hs)) v with its dropout (GPT's attend()),
             is run again: its (B, nh, T, T) probabilities and dropout mask, the only activations
             that grow with T^2, are not kept; the linear layers' inputs and outputs are

Bytes kept per layer (docs/activation-checkpointing.md; tests/test_recompute.py counts them): with
s = T, b = rows, h = n_embd, a = heads, the paper's s*b*h*(34 + 5*a*s/h) for none, 34*s*b*h for
selective and 2*s*b*h for full count 2-byte activations and 1-byte dropout masks.

Dropout: torch.utils.checkpoint stashes the random generators' states (the CPU's, and the device's
of the inputs) when the forward runs and restores them for the recompute (preserve_rng_state), so
the masks drawn again are the masks drawn the first time: a step equals the step without
checkpointing, bit for bit.
"""
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from common.metrics import SavedActivations

MODES = ("none", "full", "selective")


def recomputed(function):
    """function(*inputs), run under torch.utils.checkpoint: autograd keeps its inputs and nothing it
    computes; backward runs it again (with the same random numbers) to get what its ops saved."""
    def run(*inputs):
        SavedActivations.hold(*inputs)  # kept for the recompute (a meter cannot see inside)
        return checkpoint(function, *inputs, use_reentrant=False, preserve_rng_state=True)
    return run


def checkpoint_blocks(blocks, mode):
    """The hand-written modes, on `blocks`: GPT Blocks, whose attention has an attend(q, k, v)."""
    for block in blocks:
        if mode == "full":  # the block's forward, called by the module's __call__ (and its hooks)
            block.forward = recomputed(block.forward)
        elif mode == "selective":
            block.attn.attend = recomputed(block.attn.attend)


# ---- PyTorch's own, for --implementation pytorch ------------------------------------------

# SDPA's fused kernels: each is one op that the selective policy recomputes whole
FUSED_ATTENTION = ("_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def is_score_matrix(t):
    return isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-1] == t.shape[-2]


def attention_core_policy(ctx, op, *args, **kwargs):
    """Selective activation checkpointing's op policy: recompute the attention core, save the rest.
    The core is one fused SDPA op; or, in SDPA's math path (CPU with dropout), its two bmm's and
    every op on the (..., T, T) scores: mask, softmax, dropout."""
    fused = op.__name__.split(".")[0] in FUSED_ATTENTION
    scores = op is torch.ops.aten.bmm.default or any(map(is_score_matrix, args))
    if fused or scores:
        return torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE
    return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE


def torch_checkpoint_blocks(blocks, mode):
    """PyTorch's modes, on `blocks`: torch.distributed._composable.checkpoint(block), the machinery
    under checkpoint_wrapper and apply_activation_checkpointing (torch.utils.checkpoint, non-
    reentrant, from module hooks) without their wrapper module, whose name in every parameter's
    (`_checkpoint_wrapped_module.`) no GPT-keyed checkpoint or optimizer state knows. selective
    adds torch's selective checkpointing (create_selective_checkpoint_contexts) with the policy
    above."""
    from torch.distributed._composable import checkpoint as checkpoint_module
    for block in blocks:
        if mode == "full":
            checkpoint_module(block)
        elif mode == "selective":
            # CPU's dropout fills its mask in place (bernoulli_, div_ on an empty_like): the saved
            # tensor is mutated after it is saved, and what the recompute gets is the final mask
            contexts = partial(create_selective_checkpoint_contexts, attention_core_policy,
                               allow_cache_entry_mutation=True)
            checkpoint_module(block, context_fn=contexts)
