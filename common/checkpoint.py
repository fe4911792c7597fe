"""Checkpoints: one on-disk format for every script, atomic writes, and resume.

The full format, `<out_dir>/ckpt.pt` (like nanoGPT's), is one dict gathered on rank 0:
  model:      the full GPT state_dict (both tied keys, transformer.wte.weight and lm_head.weight)
  optimizer:  {parameter name: {"step", "exp_avg", "exp_avg_sq"}}: unsharded AdamW state
  step:       optimizer steps taken = the next step to run; the lr schedule position is get_lr(step)
  rng:        [{"cpu", "cuda"} RNG states of rank r, for r in range(world_size)] (dropout; the data
              is a function of the step)
  config:     GPTConfig fields
  args:       the run's flags
  format:     "nanodist-full-v1"
Every script writes it and every script resumes from it, re-sharding model and optimizer state to
its own layout: a checkpoint written by fsdp_train.py resumes in tp_train.py. fsdp_train.py can
also write a sharded format (a file per rank + a manifest; see its docstring).
"""
import os
import sys

import torch
import torch.distributed as dist

from common.config import die, gpt_config

FORMAT = "nanodist-full-v1"


def save_atomic(obj, path):
    """Write to a temporary file, fsync, rename: `path` is never half-written, even if this
    process dies mid-save (the old checkpoint stays in place until the rename)."""
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


def save_checkpoint(model_state, optimizer_state, step, config, args):
    """Collective: every rank calls it. Gathers every rank's RNG state to rank 0, which writes
    the full format to <out_dir>/ckpt.pt. model_state/optimizer_state are read on rank 0 only
    (the other ranks may pass None)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rng = [None] * world_size if rank == 0 else None
    cuda_rng = None
    if torch.cuda.is_available():
        cuda_rng = torch.cuda.get_rng_state()
    mine = dict(cpu=torch.get_rng_state(), cuda=cuda_rng)
    dist.gather_object(mine, rng, dst=0)
    if rank == 0:
        ckpt = dict(format=FORMAT, script=os.path.basename(sys.argv[0]), model=model_state,
                    optimizer=optimizer_state, step=step, rng=rng,
                    config=config.__dict__.copy(), args=vars(args))
        save_atomic(ckpt, os.path.join(args.out_dir, "ckpt.pt"))


def checkpoint(step, model, optimizer, config, args):
    """Collective: model.full_state(optimizer) gathers the full format in the strategy's own way
    (model state, AdamW state by name, complete on rank 0), and rank 0 writes it."""
    model_state, optimizer_state = model.full_state(optimizer)
    save_checkpoint(model_state, optimizer_state, step, config, args)


def load(path):
    """(what torch saved at path, None), or (None, the exception torch.load raised: the file is
    missing, truncated, or not torch's)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True), None
    except Exception as e:
        return None, e


def config_mismatch(saved, args):
    """(field, saved value, this run's value) of the first GPTConfig field that a checkpoint's
    `saved` dict holds differently from this run's flags, or None. dropout may change on resume,
    as in nanoGPT."""
    for key, value in gpt_config(args).__dict__.items():
        if key != "dropout" and saved.get(key) != value:
            return key, saved.get(key), value
    return None


def read(path, flag="--resume"):
    """(checkpoint, None), or (None, the one-line reason it cannot be used)."""
    if not os.path.exists(path):
        return None, f"{flag}: no checkpoint at {path}"
    ckpt, e = load(path)
    if e is not None:
        first_line = str(e).splitlines()[0][:200]
        return None, f"{flag}: {path} is truncated or corrupt ({type(e).__name__}: {first_line})"
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "step", "config"} <= set(ckpt):
        needs = "needs model, optimizer, step, config"
        return None, f"{flag}: {path} is not a nanodist full checkpoint ({needs})"
    return ckpt, None


def resume(args):
    """Collective: every rank calls it after setup(). Returns the checkpoint to continue from, or
    None for a fresh start. It resumes when --resume is given, or when torchrun restarted the job
    after a failure (TORCHELASTIC_RESTART_COUNT > 0; then a missing checkpoint means a fresh start).
    Rank 0 reads and checks the file first, so a bad file gives one error line, not one per rank;
    then every rank maps it (out_dir must be shared by the nodes) and restores its RNG state."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    path = os.path.join(args.out_dir, "ckpt.pt")
    if not args.resume and not (restarted and os.path.exists(path)):
        return None
    verdict = [None]
    if dist.get_rank() == 0:
        verdict[0] = _check(path, args)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        die(verdict[0])
    ckpt, _ = read(path)
    rng = ckpt.get("rng")
    if rng is not None and len(rng) == dist.get_world_size():
        state = rng[dist.get_rank()]
        torch.set_rng_state(state["cpu"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    else:  # another world size: a fresh dropout stream per rank and step
        torch.manual_seed(args.seed + dist.get_rank() + 1_000_003 * ckpt["step"])
    if dist.get_rank() == 0:
        script = ckpt.get("script", "?")
        print(f"resuming from {path} at step {ckpt['step']} (written by {script})", flush=True)
    return ckpt


def _check(path, args):
    """None if rank 0 can resume from path with these flags, else the error line."""
    ckpt, error = read(path)
    if error is not None:
        return error
    mismatch = config_mismatch(ckpt["config"], args)
    if mismatch is not None:
        key, saved, value = mismatch
        return f"--{key}: the checkpoint {path} has {key}={saved}, this run has {value}"
    if ckpt["step"] > args.max_iters:
        return (f"--max_iters: the checkpoint {path} is at step {ckpt['step']}, "
                f"past --max_iters {args.max_iters}")
    return None


def set_adamw_state(optimizer, param, state, local):
    """Puts one parameter's full-format AdamW state into `optimizer`: local(full tensor) returns
    this rank's piece of it, laid out like `param` (a shard, a slice, a DTensor, or all of it)."""
    optimizer.state[param] = {k: v.clone() if k == "step" else local(v) for k, v in state.items()}


def optimizer_state_by_name(named_params, optimizer):
    """AdamW state keyed by parameter name (the full format) instead of by position."""
    by_name = {}
    for name, p in named_params:
        if p not in optimizer.state:
            continue
        state = {}
        for key, value in optimizer.state[p].items():
            if torch.is_tensor(value):
                value = value.detach().clone()
            state[key] = value
        by_name[name] = state
    return by_name
