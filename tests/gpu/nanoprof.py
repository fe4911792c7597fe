"""nanoGPT's own model (its model.py, in the folder given), GPT-2 124M without bias, bf16 autocast,
its fused AdamW and clip, 12 x 1024 random tokens: a torch.profiler trace of 3 steps after 3 of
warm-up, for kern.py. usage: python3 nanoprof.py NANOGPT_DIR TRACE_JSON"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, sys.argv[1])
from model import GPT, GPTConfig  # noqa: E402  nanoGPT's

torch.backends.cuda.matmul.allow_tf32 = True
config = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768,
                   dropout=0.0, bias=False)
model = GPT(config).cuda()
optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
x = torch.randint(0, 50304, (12, 1024), device="cuda")
y = torch.randint(0, 50304, (12, 1024), device="cuda")
activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
with profile(activities=activities, schedule=schedule(wait=1, warmup=2, active=3),
             on_trace_ready=lambda p: p.export_chrome_trace(sys.argv[2])) as prof:
    for _ in range(6):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        prof.step()
