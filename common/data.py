"""Data: Tiny Shakespeare (or any text file) tokenised with GPT-2 BPE, and the deterministic
global batch of each optimizer step.

`prepare(dataset, data_file)` writes data/<dataset>/{train,val}.bin (uint16 token ids, split
90/10 by characters as nanoGPT does: 301,966 train and 36,059 val tokens for Tiny Shakespeare).
`get_batch(split, step, ...)` returns the same (x, y) on every rank and in every strategy:
the batch depends only on (seed, split, step).
"""
import hashlib
import json
import os
import urllib.request

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_ROOT = os.path.join(REPO_ROOT, "data")
SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                   "tinyshakespeare/input.txt")
GPT2_VOCAB = 50257  # ids produced by tiktoken's gpt2 encoding are < 50257


def data_dir(dataset):
    return os.path.join(DATA_ROOT, dataset)


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def prepare(dataset="shakespeare", data_file=None):
    """Make sure data/<dataset>/{train,val}.bin exist; return None, or one line saying what is
    wrong. The text comes from `data_file` if given, else data/<dataset>/input.txt, which for
    "shakespeare" is downloaded from SHAKESPEARE_URL when missing."""
    out = data_dir(dataset)
    meta_path = os.path.join(out, "meta.json")
    text_path = data_file or os.path.join(out, "input.txt")
    if data_file is not None and not os.path.isfile(data_file):
        return f"--data_file: no such file: {data_file}"
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if data_file is None or meta.get("sha256") == _sha256(data_file):
            return None  # already prepared from this text
    if not os.path.exists(text_path):
        if dataset != "shakespeare":
            return (f"--dataset {dataset}: no text at {text_path}; put a text file there "
                    f"or pass --data_file PATH")
        try:
            os.makedirs(out, exist_ok=True)
            with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as r:
                text = r.read()
            with open(f"{text_path}.tmp.{os.getpid()}", "wb") as f:
                f.write(text)
            os.replace(f"{text_path}.tmp.{os.getpid()}", text_path)
        except OSError as e:
            return (f"--dataset shakespeare: cannot download {SHAKESPEARE_URL} ({e}); "
                    f"offline, put Tiny Shakespeare's input.txt at {text_path}")
    try:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken fetches the BPE files on first use
        reason = f"{type(e).__name__}: {e}"
        return (f"--dataset {dataset}: cannot load tiktoken's gpt2 encoding ({reason}); "
                f"offline, set TIKTOKEN_CACHE_DIR to a folder holding the GPT-2 BPE files")
    with open(text_path, "r", encoding="utf-8") as f:
        text = f.read()
    n = len(text)
    os.makedirs(out, exist_ok=True)
    cut = int(n * 0.9)
    for split, chunk in (("train", text[:cut]), ("val", text[cut:])):
        ids = np.array(enc.encode_ordinary(chunk), dtype=np.uint16)
        # a temporary file per process: nodes may share this folder
        tmp = os.path.join(out, f"{split}.bin.tmp.{os.getpid()}")
        ids.tofile(tmp)
        os.replace(tmp, os.path.join(out, f"{split}.bin"))
    meta_tmp = f"{meta_path}.tmp.{os.getpid()}"
    with open(meta_tmp, "w") as f:  # meta.json last: it says the .bin files are complete
        json.dump({"source": os.path.abspath(text_path), "sha256": _sha256(text_path)}, f)
    os.replace(meta_tmp, meta_path)
    return None


_tokens = {}


def tokens(split, dataset="shakespeare"):
    key = (dataset, split)
    if key not in _tokens:
        path = os.path.join(data_dir(dataset), f"{split}.bin")
        _tokens[key] = np.memmap(path, dtype=np.uint16, mode="r")
    return _tokens[key]


def check_block_size(block_size, dataset="shakespeare"):
    """None, or the error line if a split is too short for one sequence of block_size + 1 tokens."""
    for split in ("train", "val"):
        n = len(tokens(split, dataset))
        if n < block_size + 2:
            return (f"--block_size: {block_size} is too large for the {split} split of {dataset} "
                    f"({n} tokens)")
    return None


def get_batch(split, step, batch_size, block_size, seed, dataset="shakespeare"):
    """The global batch of optimizer step `step`: `batch_size` random windows of the split,
    chosen by a generator seeded with (seed, split, step), so it is the same on every rank and in
    every strategy. Returns int64 CPU tensors x, y of shape (batch_size, block_size); y is x
    shifted by 1."""
    data = tokens(split, dataset)
    split_id = 0 if split == "train" else 1
    rng = np.random.default_rng([seed, split_id, step])
    ix = rng.integers(0, len(data) - block_size - 1, size=batch_size)
    x = np.stack([data[i: i + block_size] for i in ix]).astype(np.int64)
    y = np.stack([data[i + 1: i + 1 + block_size] for i in ix]).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)
