"""Checkpoints: one on-disk format for every script, atomic writes, and resume.

The full format, `<out_dir>/ckpt.pt` (like nanoGPT's), is one dict gathered on rank 0:
  model:      the full GPT state_dict (both tied keys, transformer.wte.weight and lm_head.weight)
  optimizer:  {parameter name: {"step", "exp_avg", "exp_avg_sq"}}: unsharded AdamW state
  step:       optimizer steps taken = the next step to run; the lr schedule position is get_lr(step)
  rng:        [{"cpu", "cuda"} RNG states of rank r, for r in range(world_size)] (dropout; the data
              is a function of the step)
  config:     GPTConfig fields (a mixture of experts: n_experts, top_k, expert_hidden too; gelu
              tanh for a model started from OpenAI's GPT-2: --init_from)
  args:       the run's flags
  save:       this save's id (time.time_ns()): on resume, each rank checks it read rank 0's file
  format:     "nanodist-full-v1"
Every script writes it and every script resumes from it, re-sharding model and optimizer state to
its own layout: a checkpoint written by fsdp_train.py resumes in tp_train.py. fsdp_train.py can
also write a sharded format (a file per rank + a manifest; see its docstring).
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from common.config import die, gpt_config
from common.distributed import die_on_any
from common.model import GPT, GPTConfig

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
    rng_here = dict(cpu=torch.get_rng_state(), cuda=cuda_rng)
    dist.gather_object(rng_here, rng, dst=0)
    if rank == 0:
        ckpt = dict(format=FORMAT, script=os.path.basename(sys.argv[0]), model=model_state,
                    optimizer=optimizer_state, step=step, rng=rng,
                    config=config.__dict__.copy(), args=vars(args), save=time.time_ns())
        save_atomic(ckpt, os.path.join(args.out_dir, "ckpt.pt"))


def checkpoint(step, model, optimizer, config, args):
    """Collective: model.full_state(optimizer) gathers the full format in the strategy's own way
    (model state, AdamW state by name, complete on rank 0), and rank 0 writes it. At step 0 (the
    end of --max_iters 0, which only evaluates) nothing was trained: nothing is written, and the
    out_dir's ckpt.pt, if any, stays as it was."""
    if step == 0:
        return
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
    as in nanoGPT. A field the checkpoint lacks (written before the field existed: the MoE ones)
    has its default, the dense GPT's."""
    for key, value in gpt_config(args).__dict__.items():
        held = saved.get(key, getattr(GPTConfig, key))
        if key != "dropout" and held != value:
            return key, held, value
    return None


def read(path, flag="--resume", args=None):
    """(checkpoint, None), or (None, the one-line reason it cannot be used). flag --init_from: the
    GPT-2 weights at path as a step-0 checkpoint of the model args size (common/pretrained.py)."""
    if not os.path.exists(path):
        return None, f"{flag}: no checkpoint at {path}"
    if flag == "--init_from":
        from common import pretrained  # only with --init_from: a run without it never imports it
        return pretrained.checkpoint(path, gpt_config(args))
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
    None for a fresh start. It resumes when --resume or --resume_from is given, or when torchrun
    restarted the job after a failure (TORCHELASTIC_RESTART_COUNT > 0 on any rank; then
    out_dir/ckpt.pt, the job's own latest, if there is one yet). Otherwise --init_from's weights
    are a checkpoint at step 0 with no optimizer state: a fresh start from them.

    Decided once: rank 0 chooses the file and checks it, and broadcasts its choice (path, step and
    save id). Every other rank then reads that path and must find the same checkpoint; their
    verdicts are gathered, so a node that cannot see it (out_dir not shared, or NFS lagging) ends
    every rank with one line naming the path, and no job has some ranks resumed and others fresh."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Each node's torchrun agent counts its own restarts: a node restarted because a peer failed
    # may read 0 where the failed one reads 1. Every rank's count goes to every rank (a few bytes).
    restarts = [None] * world_size
    dist.all_gather_object(restarts, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    choice, ckpt, error = [None], None, None
    if rank == 0:
        choice[0], ckpt = choose(args, restarted=max(restarts) > 0)
    dist.broadcast_object_list(choice, src=0)  # rank 0's choice to every rank: a small dict
    choice = choice[0]
    if choice is None:
        return None  # a fresh start on every rank
    if "error" in choice:
        die(choice["error"])
    if rank != 0:
        ckpt, error = read_chosen(choice, rank, args)
    die_on_any(error)
    rng = ckpt.get("rng")
    if rng is not None and len(rng) == world_size:
        state = rng[rank]
        torch.set_rng_state(state["cpu"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    else:  # another world size, or --init_from's weights: a fresh dropout stream per rank and step
        torch.manual_seed(args.seed + rank + 1_000_003 * ckpt["step"])
    if rank == 0 and choice["flag"] == "--init_from":
        print(f"starting from {args.init_from}'s weights, {choice['path']}", flush=True)
    elif rank == 0:
        script = ckpt.get("script", "?")
        print(f"resuming from {choice['path']} at step {ckpt['step']} (written by {script})",
              flush=True)
    return ckpt


def choose(args, restarted):
    """Rank 0's choice and the checkpoint it read: (None, None) for a fresh start, ({"error": line},
    None), or ({"path", "flag", "step", "save", "bytes"}, the checkpoint every rank resumes from).
    After a restart the job's own latest checkpoint wins, even over --resume_from (which the job
    started from, and has gone past); any resume wins over --init_from, which starts a run."""
    latest = os.path.join(args.out_dir, "ckpt.pt")
    if restarted and os.path.exists(latest):
        path, flag = latest, "--resume"
    elif args.resume_from is not None:
        path, flag = args.resume_from, "--resume_from"
    elif args.resume:
        path, flag = latest, "--resume"
    elif args.init_from is not None:
        from common import pretrained  # only with --init_from: a run without it never imports it
        path, error = pretrained.weights_path(args.init_from)
        if error is not None:
            return dict(error=error), None
        flag = "--init_from"
    else:
        return None, None  # also a restart before the first checkpoint was written
    ckpt, error = read(path, flag, args)
    if error is None:
        error = _check(ckpt, path, args)
    if error is not None:
        return dict(error=error), None
    choice = dict(path=path, flag=flag, step=ckpt["step"], save=ckpt.get("save"),
                  bytes=os.path.getsize(path))
    return choice, ckpt


def read_chosen(choice, rank, args):
    """(the checkpoint at rank 0's chosen path, None), or (None, the line saying that this rank
    cannot see it, or sees another file there: a stale copy, as NFS may show for a while)."""
    path, flag = choice["path"], choice["flag"]
    node = os.environ.get("GROUP_RANK", "?")
    where = f"node {node} (host {socket.gethostname()}, rank {rank})"
    fix = ("out_dir must be on a shared filesystem, or pass --resume_from a path every node "
           "can read")
    if not os.path.exists(path):
        return None, f"{flag}: {path} is not visible from {where}: {fix}"
    ckpt, error = read(path, flag, args)
    if error is not None:  # e.g. a file still being copied
        return None, f"{error}, on {where}: {fix}"
    read_here = dict(step=ckpt["step"], save=ckpt.get("save"), bytes=os.path.getsize(path))
    if any(read_here[key] != choice[key] for key in read_here):
        return None, (f"{flag}: {path} on {where} is another file than rank 0 read "
                      f"({describe(read_here)}, not {describe(choice)}; a stale copy?): {fix}")
    return ckpt, None


def describe(file):
    return f"step {file['step']}, save id {file['save']}, {file['bytes']} bytes"


def _check(ckpt, path, args):
    """None if rank 0 can resume from ckpt (read from path) with these flags, else the error."""
    mismatch = config_mismatch(ckpt["config"], args)
    if mismatch is not None:
        key, saved, value = mismatch
        flag = "--init_from" if key == "gelu" else f"--{key}"  # tanh: started from GPT-2's weights
        return f"{flag}: the checkpoint {path} has {key}={saved}, this run has {value}"
    if ckpt["step"] > args.max_iters:
        return (f"--max_iters: the checkpoint {path} is at step {ckpt['step']}, "
                f"past --max_iters {args.max_iters}")
    return None


def set_adamw_state(optimizer, param, state, local=None):
    """Puts one parameter's AdamW state into `optimizer`, as every resume does: local(full tensor)
    returns this rank's piece of a full-format moment, laid out like `param` (a shard, a slice, a
    DTensor, or all of it); without local the moments are this rank's already (a sharded file's).
    `step` goes where this optimizer reads it (adamw_step)."""
    local = local or (lambda moment: moment)
    optimizer.state[param] = {k: adamw_step(optimizer, param, v) if k == "step" else local(v)
                              for k, v in state.items()}


def adamw_step(optimizer, param, step):
    """A copy of AdamW's `step` (a checkpoint's, on the CPU) where torch's own load_state_dict puts
    it for `param`'s group (Optimizer._process_value_according_to_param_policy; the same rule in
    torch 2.0 to 2.13). A fused or capturable AdamW reads it on the parameter's device, as float32:
    the fused CUDA kernel dereferences it there, and nothing checks that it is (a DTensor's device
    is its local one, and the copy a plain tensor). Any other AdamW reads it on the CPU, as saved.
    A fused AdamW's step is float32 from its first step, so a CPU resume keeps its bits."""
    [group] = [g for g in optimizer.param_groups if any(p is param for p in g["params"])]
    if group.get("fused") or group.get("capturable"):
        return step.to(dtype=torch.float32, device=param.device, copy=True)
    return step.clone()


def model_state_on_cpu(model, gather=torch.Tensor.detach, keep=True):
    """model.state_dict() copied into this process's CPU memory, one tensor at a time, each
    parameter once: the tied wte/lm_head's two names share one copy, as in the model.
    gather(value): the whole tensor, where a rank holds a piece (a collective: every rank calls
    it, in the same order); keep=False: this rank only takes part in the gathers (values None)."""
    copies = {}  # parameter -> its CPU copy
    state = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if value not in copies:
            whole = gather(value)
            copies[value] = whole.to("cpu", copy=True) if keep else None
            del whole  # before the next gather: at most one whole tensor on the device
        state[name] = copies[value]
    return state


def optimizer_state_by_name(named_params, optimizer):
    """AdamW state keyed by parameter name (the full format) instead of by position, copied into
    this process's CPU memory one tensor at a time."""
    by_name = {}
    for name, p in named_params:
        if p not in optimizer.state:
            continue
        state = {}
        for key, value in optimizer.state[p].items():
            if torch.is_tensor(value):
                value = value.detach().to("cpu", copy=True)
            state[key] = value
        by_name[name] = state
    return by_name


def gather_to_rank0(entries, sends, config, device):
    """Collective: the full format's dicts (model state by GPT name, AdamW state by name) in rank
    0's CPU memory, None elsewhere, from tensors spread over the ranks (pipeline stages).
    `entries`: this rank's (name, "param" or an AdamW state key, full shape, dtype, make) in order,
    make() giving the whole tensor on `device` (it may be a collective that other ranks call in the
    same order); `sends`: whether this rank's entries go to rank 0. Each sender tells rank 0 what it
    holds (one small object), then sends one tensor a message; rank 0 receives each into a buffer
    and copies it to the CPU before the next. lm_head.weight is written from the tied wte."""
    rank0 = dist.get_rank() == 0
    layouts = [None] * dist.get_world_size() if rank0 else None
    layout = [(name, key, shape, dtype) for name, key, shape, dtype, _ in entries]
    dist.gather_object(layout if sends else [], layouts, dst=0)
    params, states = {}, {}

    def keep(name, key, value):
        if key == "param":
            params[name] = value.to("cpu", copy=True)
        else:
            states.setdefault(name, {})[key] = value.to("cpu", copy=True)
    for name, key, _, _, make in entries:
        value = make()
        if rank0:
            keep(name, key, value)
        elif sends:
            dist.send(value, dst=0)
    if not rank0:
        return None, None
    for r in range(1, len(layouts)):
        for name, key, shape, dtype in layouts[r]:
            value = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(value, src=r)
            keep(name, key, value)
    model = {}
    for name in GPT(config, device="meta").state_dict():
        model[name] = params["transformer.wte.weight" if name == "lm_head.weight" else name]
    return model, states
