"""Generate text from any nanodist checkpoint, as nanoGPT's sample.py does.

  python sample.py --out_dir out/fsdp --start "ROMEO:" --num_samples 3 --max_new_tokens 200

Every script writes the same full format (<out_dir>/ckpt.pt, see common/checkpoint.py), so this
works for a checkpoint from ddp, fsdp, zero3, tp or pp training alike. --start "FILE:prompt.txt"
reads the prompt from a file.
"""
import argparse
import os
import sys

import tiktoken
import torch
import torch.nn.functional as F

from common.checkpoint import read
from common.data import use_offline_dir
from common.model import GPT, GPTConfig


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature, top_k):
    """nanoGPT's sampling loop: crop the context to block_size, sample the next token, append."""
    for _ in range(max_new_tokens):
        context = idx[:, -model.config.block_size:]
        logits, _ = model(context)
        logits = logits[:, -1, :] / temperature
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
        idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
    return idx


def main(argv=None):
    p = argparse.ArgumentParser(description="nanodist: sample text from a checkpoint.")
    p.add_argument("--out_dir", default="out/ddp", help="the folder holding ckpt.pt")
    p.add_argument("--start", default="\n", help='the prompt, or "FILE:path" to read it from a file')
    p.add_argument("--num_samples", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="< 1: less random, > 1: more random")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    for name in ("num_samples", "max_new_tokens", "top_k"):
        if getattr(args, name) <= 0:
            sys.exit(f"error: --{name}: must be > 0, got {getattr(args, name)}")
    if not args.temperature > 0:
        sys.exit(f"error: --temperature: must be > 0, got {args.temperature}")
    error = use_offline_dir()  # offline: tiktoken reads its files from NANODIST_OFFLINE_DIR
    if error is not None:
        sys.exit(f"error: {error}")
    ckpt, error = read(os.path.join(args.out_dir, "ckpt.pt"), flag="--out_dir")
    if error is not None:
        sys.exit(f"error: {error}")

    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(**ckpt["config"]), device="meta")
    model.load_state_dict(ckpt["model"], assign=True)  # the tensors are mapped from the file
    model.tie_weights()
    model.to(args.device).eval()
    enc = tiktoken.get_encoding("gpt2")
    start = args.start
    if start.startswith("FILE:"):
        with open(start[5:], encoding="utf-8") as f:
            start = f.read()
    x = torch.tensor(enc.encode_ordinary(start), dtype=torch.long, device=args.device)[None]
    for _ in range(args.num_samples):
        y = generate(model, x, args.max_new_tokens, args.temperature, args.top_k)
        tokens = [t for t in y[0].tolist() if t < enc.n_vocab]  # the padded vocabulary's extra ids decode to nothing
        print(enc.decode(tokens))
        print("---------------")


if __name__ == "__main__":
    main()
