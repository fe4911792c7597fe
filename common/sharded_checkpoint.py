"""The sharded checkpoint: a file per rank beside the full one, written and checked with no tensor
communication, for a run at the same world size. fsdp_train.py (--sharded_checkpoint,
--resume_sharded) hands it each rank's own tensors; the layout of the files under out_dir/sharded/:
  step_<N>/rank<r>.pt  rank r's tensors ("units": a list of dicts), stamped with the save's header:
                       step, world_size, every GPTConfig field, folder, save (an id)
  manifest.pt          the header of the published save, written last (an atomic rename) by rank 0
                       once every rank's file is on disk
Each save goes to a new folder, so a save that dies midway leaves the previous one published; the
older folders are removed once the new one is published."""
import os
import shutil
import time

import torch
import torch.distributed as dist

from common.checkpoint import config_mismatch, load, save_atomic
from common.distributed import die_on_any


def save_sharded(step, units, config, args):
    """Writes this rank's `units` into a new save under out_dir/sharded/ and publishes it."""
    root = os.path.join(args.out_dir, "sharded")
    rank = dist.get_rank()
    headers = [None]  # rank 0's, broadcast
    if rank == 0:  # the folder for every rank: never the published one (then step_<N>_b)
        manifest, _ = load_file(os.path.join(root, "manifest.pt"))
        folder = f"step_{step}"
        if manifest is not None and manifest.get("folder") == folder:
            folder += "_b"
        shutil.rmtree(os.path.join(root, folder), ignore_errors=True)  # a dead save's leftovers
        headers[0] = dict(step=step, world_size=dist.get_world_size(), **config.__dict__,
                          folder=folder, save=time.time_ns())
    dist.broadcast_object_list(headers, src=0)
    header = headers[0]
    path = os.path.join(root, header["folder"], f"rank{rank}.pt")
    save_atomic(dict(header, units=units), path)
    dist.barrier()  # every rank's file is written and fsync'd before the manifest publishes it
    if rank == 0:
        save_atomic(header, os.path.join(root, "manifest.pt"))
        for old in os.listdir(root):
            if old.startswith("step_") and old != header["folder"]:
                shutil.rmtree(os.path.join(root, old))


def load_file(path):
    """(what torch saved at path, None), or (None, why not: missing, truncated, not torch's)."""
    saved, e = load(path)
    return saved, e and f"{path} cannot be read ({type(e).__name__})"


def load_sharded(path, rank, device):
    """This rank's units [{local_shard, AdamW state}] from the save the manifest at path names, on
    `device`, but AdamW's `step`, which stays on the CPU as saved: set_adamw_state puts it where
    the optimizer reads it (on `device` for the scripts' fused AdamW)."""
    manifest, _ = load_file(os.path.join(path, "manifest.pt"))
    file = os.path.join(path, manifest["folder"], f"rank{rank}.pt")
    units = torch.load(file, map_location="cpu", weights_only=True)["units"]
    on_device = []
    for unit in units:
        on_device.append({k: v if k == "step" else v.to(device) for k, v in unit.items()})
    return on_device


def check_sharded(args, rank, world_size):
    """None if this rank can resume from the sharded checkpoint at args.resume_sharded, else the
    error line: the manifest must fit this run's world size and model flags, and this rank's file
    the manifest."""
    path = args.resume_sharded
    flag = "--resume_sharded:"
    manifest, error = load_file(os.path.join(path, "manifest.pt"))
    if error:
        return f"{flag} {error}"
    if not isinstance(manifest, dict) or "folder" not in manifest:
        return f"{flag} {path}/manifest.pt is not a sharded checkpoint manifest"
    if manifest["world_size"] != world_size:
        saved_by = manifest["world_size"]
        return f"{flag} {path} was written by {saved_by} ranks, this run has {world_size}"
    mismatch = config_mismatch(manifest, args)  # every GPTConfig field but dropout
    if mismatch is not None:
        key, saved, value = mismatch
        return f"{flag} {path} was saved with {key}={saved}, this run has --{key} {value}"
    if manifest["step"] > args.max_iters:
        return f"{flag} {path} is at step {manifest['step']}, past --max_iters {args.max_iters}"
    file = os.path.join(path, manifest["folder"], f"rank{rank}.pt")
    saved, error = load_file(file)
    if error:
        return f"{flag} {error}"
    if not isinstance(saved, dict):
        return f"{flag} {file} is not a sharded checkpoint file"
    for key, value in manifest.items():  # a file of another save (a mixed set): step or save differ
        if saved.get(key) != value:
            return (f"{flag} {file} is not of the save that {path}/manifest.pt publishes "
                    f"({key} {saved.get(key)}, not {value})")
    return None


def resume_sharded(args, ckpt):
    """The step of the sharded checkpoint at args.resume_sharded (the strategy loads its tensors),
    once every rank has checked its own file: the verdicts are gathered, so a bad one ends all
    ranks with one line. ckpt: the full checkpoint, or None."""
    die_on_any(check_sharded(args, dist.get_rank(), dist.get_world_size()))
    manifest, _ = load_file(os.path.join(args.resume_sharded, "manifest.pt"))
    if ckpt is None:  # no full checkpoint: model and optimizer come from the sharded files
        ckpt = dict(model=None, optimizer=None)
    return dict(ckpt, step=manifest["step"])
