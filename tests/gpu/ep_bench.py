"""ep_train.py's experts on one device: the loop (a matmul pair an expert) against torch._grouped_mm, and the
host syncs of a MoE layer. Self-contained (no data, one process): from the project root,

    python tests/gpu/ep_bench.py            # CUDA if there is one (bf16), else the CPU (fp32)

1. Experts: GroupedExperts at GPT-2 124M's widths (C 768, H 1536 = 4C/k, k 2), E = 8, one micro-batch of
   12 x 1024 tokens (24,576 rows), routed by a skewed random draw; forward + backward of the loop and of the
   grouped path, the median ms of ITERS after warm-up, and their largest relative difference (output, gradients).
2. Syncs: one EP step (world size 1, GPT-2 widths, 4 layers, 2 micro-steps) with torch.cuda.set_sync_debug_mode:
   the synchronizing CUDA calls counted by warning, per MoE layer and micro-step (ep_train.py: one, the sizes).
Under a minute on an H100; the CPU row at these sizes takes a few minutes (SMALL=1: smaller).
"""
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ep_train  # noqa: E402
from common.config import gpt_config, parse_args  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
SMALL = os.environ.get("SMALL") == "1"
C, E, K = (128, 8, 2) if SMALL else (768, 8, 2)
ROWS = (16 * 64 if SMALL else 12 * 1024) * K
ITERS = int(os.environ.get("ITERS", 20))


def wait():
    if CUDA:
        torch.cuda.synchronize()


def experts_bench():
    config = type("Config", (), dict(n_embd=C, expert_hidden=4 * C // K, bias=False))
    generator = torch.Generator().manual_seed(0)
    share = torch.softmax(torch.randn(E, generator=generator), dim=0)  # skewed: some experts get far more
    sizes = torch.multinomial(share, ROWS, replacement=True, generator=generator).bincount(minlength=E)
    sizes = sizes.tolist()
    counts = torch.tensor(sizes, device=DEVICE)
    expert_of_row = torch.arange(E, device=DEVICE).repeat_interleave(counts, output_size=ROWS)
    rows = torch.randn(ROWS, C, generator=generator).to(DEVICE, DTYPE)
    grad = torch.randn(ROWS, C, generator=generator).to(DEVICE, DTYPE)
    found = {}
    for grouped in (False, True):
        experts = ep_train.GroupedExperts(list(range(E)), config, grouped).to(DEVICE)
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
        x = rows.clone().requires_grad_()
        times = []
        for i in range(ITERS + 3):
            wait()
            start = time.perf_counter()
            y = experts(x, expert_of_row, counts, sizes)
            y.backward(grad)
            wait()
            if i >= 3:
                times.append(1000 * (time.perf_counter() - start))
            if i < ITERS + 2:
                x.grad = None
                experts.zero_grad()
        found[grouped] = statistics.median(times), [y.float(), x.grad.float()] + [
            p.grad.float() for p in experts.parameters()]
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(found[True][1], found[False][1]))
    print(f"experts fwd+bwd, {E} experts, {ROWS} rows, C {C}, {DTYPE} on {DEVICE}: loop {found[False][0]:.2f} ms, "
          f"grouped_mm {found[True][0]:.2f} ms ({found[False][0] / found[True][0]:.2f}x), largest relative "
          f"difference {worst:.1e}, grouped_mm_runs here: {ep_train.grouped_mm_runs(DEVICE, DTYPE)}")


def syncs_bench():
    dtype = "bfloat16" if CUDA else "float32"
    micro, T = (2, 64) if SMALL else (4, 1024)
    argv = ["--n_layer", "4", "--n_head", "4" if SMALL else "12", "--n_embd", str(C), "--block_size", str(T),
            "--n_experts", str(E), "--top_k", str(K), "--batch_size", str(2 * micro), "--grad_accum_steps", "2",
            "--dtype", dtype, "--tensorboard", "false"]
    args = parse_args("ep", ep_train.add_ep_flags, argv)
    strategy = ep_train.EP(gpt_config(args), args, DEVICE)
    x = torch.randint(0, 50257, (2 * micro, T), device=DEVICE)
    for step in range(2):  # the first is warm-up
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if CUDA:
                torch.cuda.set_sync_debug_mode("warn")
            for j in range(2):
                part = slice(j * micro, (j + 1) * micro)
                strategy.forward_backward(x[part], x[part], sync=j == 1)
            if CUDA:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = sorted({f"{os.path.basename(w.filename)}:{w.lineno}" for w in syncs})
    shown = f"{len(syncs) / 8:.2f} per MoE layer and micro-step ({len(syncs)} in 2 x 4), at {where}" if CUDA \
        else "not counted on the CPU (tests/test_ep.py counts them there)"
    print(f"EP step, 4 MoE layers x 2 micro-steps, {strategy.describe()}: synchronizing CUDA calls {shown}")


if __name__ == "__main__":
    dist.init_process_group("nccl" if CUDA else "gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    if CUDA:
        torch.cuda.set_device(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if CUDA else 'CPU'}")
    experts_bench()
    syncs_bench()
    dist.destroy_process_group()
