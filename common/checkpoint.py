"""Atomic checkpoint files, one format for every script.

The full format (`ckpt.pt`, like nanoGPT's) is a dict gathered on rank 0:
  model:      the full GPT state_dict (both tied keys, transformer.wte.weight and lm_head.weight)
  optimizer:  {parameter name: {"step", "exp_avg", "exp_avg_sq"}} (full, unsharded tensors)
  step:       the number of optimizer steps taken (the next step to run)
  config:     GPTConfig fields
  args:       the run's flags
"""
import os

import torch


def save_atomic(obj, path):
    """Write to a temporary file, fsync, rename: `path` is never half-written."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def load(path):
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise SystemExit(f"error: cannot read checkpoint {path}: {type(e).__name__}: {e}")
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise SystemExit(f"error: {path} is not a nanodist checkpoint (no 'model' key)")
    return ckpt


def optimizer_state_by_name(named_params, optimizer):
    """AdamW state keyed by parameter name (the full format) instead of by position."""
    return {name: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
            for name, p in named_params if p in optimizer.state}
