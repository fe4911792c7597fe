"""Process-group setup: nccl + CUDA when a GPU is present, gloo + CPU otherwise.

Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment) it joins the job; run with plain
`python script.py` it makes a one-rank group in memory, so every script runs the same code path
and `python <script>.py` is the single-process reference.
"""
import atexit
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from common import data
from common.config import die


def setup(args):
    """Returns (rank, world_size, device) after init_process_group. On CPU each rank gets
    OMP_NUM_THREADS, or cores / local ranks, intra-op threads, so N ranks on one machine share its cores."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        die("--device: cuda was asked for but torch.cuda.is_available() is False")
    torchrun = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        threads = os.environ.get("OMP_NUM_THREADS")  # else share the cores among this node's ranks
        torch.set_num_threads(int(threads) if threads else max(1, len(os.sched_getaffinity(0)) // local_world))
    # Seeds only what is random at run time (dropout): weights come from init_tensor, batches from
    # get_batch. Each rank gets its own stream, so ranks drop different units of their different rows.
    torch.manual_seed(args.seed + rank)
    backend = "nccl" if use_cuda else "gloo"
    timeout = timedelta(seconds=args.timeout_s)  # a collective waiting longer than this raises
    if torchrun:
        store, attempt = None, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if attempt > 0:
            # torchrun's agent serves one store to every attempt, and the dead attempt's keys are still
            # in it: a restarted rank could read its predecessor's gloo address and wait forever
            # (seen here in about 1 restart in 3). A prefix per attempt keeps the attempts apart.
            hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            store = dist.PrefixStore(f"nanodist/attempt_{attempt}", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, hosts, timeout=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if use_cuda else None)
    else:  # single process: a one-rank group in memory, no port needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    # FSDP2/DTensor modules sit in reference cycles that hold gloo work objects; if they are first
    # freed during interpreter shutdown, a gloo thread is destroyed unjoined and the rank aborts
    # ("terminate called without an active exception", 3 in 10 runs at 4 ranks here). Collecting
    # them at exit, while the interpreter is still whole, makes teardown clean.
    atexit.register(gc.collect)
    return rank, world_size, device


def setup_data(args):
    """Rank 0 prepares data/<dataset>/ (tokenising the text on first use) while the others wait in
    a broadcast of its verdict; then every rank either goes on or exits with rank 0's error."""
    verdict = [None]
    if dist.get_rank() == 0:
        try:
            verdict[0] = data.prepare(args.dataset, args.data_file) or data.check_block_size(args.block_size, args.dataset)
        except Exception as e:  # turn anything unexpected into one line instead of a hang
            verdict[0] = f"--dataset {args.dataset}: preparing the data failed: {type(e).__name__}: {e}"
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        dist.destroy_process_group()
        die(verdict[0])


def autocast(args, device):
    """bf16 compute with fp32 parameters (autocast), or a no-op in fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
