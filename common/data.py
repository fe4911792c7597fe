"""Data: Tiny Shakespeare (or any text file) tokenised with GPT-2 BPE, and the deterministic
global batch of each optimizer step.

`prepare(dataset, data_file)` writes data/<dataset>/{train,val}.bin (uint16 token ids, split
90/10 by characters as nanoGPT does: 301,966 train and 36,059 val tokens for Tiny Shakespeare).
`get_batch(split, step, ...)` returns the same (x, y) on every rank and in every strategy:
the batch depends only on (seed, split, step).
Offline, NANODIST_OFFLINE_DIR names a folder holding the text and tiktoken's GPT-2 BPE files
(docs/offline.md): the text is copied from it instead of downloaded, and tiktoken reads it.
`python -m common.data` prepares Tiny Shakespeare once, before any run.
The hub's corpora (openwebtext, fineweb, fineweb_edu) are prepared once by `python -m common.prepare
<name>` (docs/data.md) into shards named by data/<name>/manifest.json; a split
is then the concatenation of its shards, each memory-mapped, and get_batch draws from it as from
one file.
A folder of llm.c's shards (`--dataset PATH`, e.g. modded-nanogpt's data/fineweb10B/) is read where
it is, each shard's header checked first: llmc_verdict().
"""
import filecmp
import glob
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_ROOT = os.path.join(REPO_ROOT, "data")
SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                   "tinyshakespeare/input.txt")
GPT2_VOCAB = 50257  # ids produced by tiktoken's gpt2 encoding are < 50257
OFFLINE_DIR = "NANODIST_OFFLINE_DIR"  # the offline folder's variable, and what the folder holds:
OFFLINE_TEXT = os.path.join("data", "tinyshakespeare", "input.txt")
OFFLINE_BPE = "tiktoken_cache"  # the files tiktoken caches, named by the sha1 of their URL
HUB_DATASETS = ("openwebtext", "fineweb", "fineweb_edu")  # common/prepare.py's SOURCES
MANIFEST = "manifest.json"  # a sharded dataset's: its shards, written by common/prepare.py
# llm.c's shard (dev/data/data_common.py's write_datafile, read by llmc/dataloader.h): a header of
# 256 little-endian int32, of which the first three are the magic, the version and the number of
# tokens; then that many uint16 GPT-2 token ids, the same layout as our shards.
LLMC_MAGIC = 20240520  # GPT-2 tokens (llm.c's Llama 3 shards, 20240801, hold uint32 tokens)
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = 4 * LLMC_HEADER_INTS


def data_dir(dataset):
    """data/<dataset>, or the folder itself when --dataset is a path (it holds a "/"): a folder of
    llm.c's shards is read where it is. A name never holds one."""
    if "/" in dataset or os.sep in dataset:
        return dataset
    return os.path.join(DATA_ROOT, dataset)


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def use_offline_dir():
    """None, or the line saying why the folder NANODIST_OFFLINE_DIR names cannot be used. When it
    can, tiktoken reads its BPE files there (unless TIKTOKEN_CACHE_DIR names another folder)."""
    folder = os.environ.get(OFFLINE_DIR)
    if not folder:
        return None
    for name in (OFFLINE_TEXT, OFFLINE_BPE):
        if not os.path.exists(os.path.join(folder, name)):
            return (f"{OFFLINE_DIR}: {folder} has no {name}; the folder must hold "
                    f"{OFFLINE_TEXT} and {OFFLINE_BPE}/ (docs/offline.md)")
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(folder, OFFLINE_BPE))
    return None


def prepare(dataset="shakespeare", data_file=None):
    """Make sure data/<dataset>/{train,val}.bin exist; return None, or one line saying what is
    wrong. The text comes from `data_file` if given, else data/<dataset>/input.txt, which for
    "shakespeare" is copied from NANODIST_OFFLINE_DIR, or else downloaded from SHAKESPEARE_URL,
    when missing.

    Several nodes may prepare one shared folder at once (each node's local rank 0), and one node's
    ranks may already read (memmap) the files another node is about to publish: see publish().
    A hub corpus, any folder with a manifest.json, and a folder of llm.c's shards are only
    checked: sharded_verdict(), llmc_verdict()."""
    out = data_dir(dataset)
    if os.path.exists(os.path.join(out, MANIFEST)):
        return sharded_verdict(dataset, data_file)
    if llmc_shards(out, "train") or llmc_shards(out, "val"):
        return llmc_verdict(dataset, data_file)
    if dataset in HUB_DATASETS:
        return sharded_verdict(dataset, data_file)
    meta_path = os.path.join(out, "meta.json")
    text_path = data_file or os.path.join(out, "input.txt")
    if data_file is not None and not os.path.isfile(data_file):
        return f"--data_file: no such file: {data_file}"
    offline_error = use_offline_dir()
    if offline_error is not None:
        return offline_error
    if prepared(out, data_file):
        return None
    if not os.path.exists(text_path):
        if dataset != "shakespeare":
            return (f"--dataset {dataset}: no text at {text_path}; put a text file there, "
                    f"pass --data_file PATH, or give the path of a folder of llm.c shards")
        os.makedirs(out, exist_ok=True)
        if os.environ.get(OFFLINE_DIR):
            offline_text = os.path.join(os.environ[OFFLINE_DIR], OFFLINE_TEXT)
            shutil.copyfile(offline_text, temporary(text_path))
        else:
            try:
                with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as r:
                    text = r.read()
            except OSError as e:
                return (f"--dataset shakespeare: cannot download {SHAKESPEARE_URL} ({e}); "
                        f"offline, set {OFFLINE_DIR} (docs/offline.md) or put the text at "
                        f"{text_path}")
            with open(temporary(text_path), "wb") as f:
                f.write(text)
        publish(temporary(text_path), text_path)
    try:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken fetches the BPE files on first use
        reason = f"{type(e).__name__}: {e}"
        return (f"--dataset {dataset}: cannot load tiktoken's gpt2 encoding ({reason}); "
                f"offline, set {OFFLINE_DIR} (docs/offline.md)")
    with open(text_path, "r", encoding="utf-8") as f:
        text = f.read()
    n = len(text)
    os.makedirs(out, exist_ok=True)
    cut = int(n * 0.9)
    meta = {"source": os.path.abspath(text_path), "sha256": _sha256(text_path), "tokens": {}}
    for split, chunk in (("train", text[:cut]), ("val", text[cut:])):
        ids = np.array(enc.encode_ordinary(chunk), dtype=np.uint16)
        ids.tofile(temporary(os.path.join(out, f"{split}.bin")))
        meta["tokens"][split] = len(ids)
    for split in ("train", "val"):
        path = os.path.join(out, f"{split}.bin")
        publish(temporary(path), path)
    with open(temporary(meta_path), "w") as f:  # meta.json last: the .bin files are complete
        json.dump(meta, f)
    publish(temporary(meta_path), meta_path)
    return None


def read_manifest(dataset):
    with open(os.path.join(data_dir(dataset), MANIFEST)) as f:
        return json.load(f)


def header_bytes(manifest):
    """Before each shard's tokens: nothing, or (python -m common.prepare --format llmc) llm.c's
    header."""
    return LLMC_HEADER_BYTES if manifest.get("format") == "llmc" else 0


def sharded_verdict(dataset, data_file):
    """None if data/<dataset>/ holds every shard its manifest names, complete; else the line
    naming the command that prepares them. Training never downloads or tokenises these."""
    if data_file is not None:
        return (f"--data_file: --dataset {dataset} is prepared by python -m common.prepare "
                f"{dataset}, not from a text file")
    prepare_first = f"run python -m common.prepare {dataset} first (docs/data.md)"
    if not os.path.exists(os.path.join(data_dir(dataset), MANIFEST)):
        return f"--dataset {dataset}: not prepared: {prepare_first}"
    manifest = read_manifest(dataset)
    if not manifest["complete"]:
        return f"--dataset {dataset}: only partly prepared: {prepare_first}"
    header = header_bytes(manifest)
    for shard in manifest["shards"]:
        path = os.path.join(data_dir(dataset), shard["file"])
        if not os.path.exists(path) or os.path.getsize(path) != header + 2 * shard["tokens"]:
            return f"--dataset {dataset}: {path} is missing or cut short: {prepare_first}"
    return None


def llmc_shards(folder, split):
    """The split's llm.c shards in folder, in name order as llm.c's glob and modded-nanogpt's
    sorted() list them: fineweb_train_000001.bin, ... or a single tiny_shakespeare_train.bin."""
    return sorted(glob.glob(os.path.join(glob.escape(folder), f"*_{split}*.bin")))


def llmc_error(path):
    """None, or what makes path no llm.c GPT-2 shard: its magic, its version, or a length other
    than the header and the tokens it counts (llm.c's dataloader.h checks the same three)."""
    size = os.path.getsize(path)
    if size < LLMC_HEADER_BYTES:
        return f"{path}: {size} bytes, shorter than llm.c's {LLMC_HEADER_BYTES}-byte header"
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    magic, version, count = (int(value) for value in header[:3])
    if magic != LLMC_MAGIC:
        return f"{path}: magic {magic}, not {LLMC_MAGIC} (llm.c's shards of GPT-2 tokens)"
    if version != LLMC_VERSION:
        return f"{path}: version {version}, not {LLMC_VERSION} (llm.c's shards of GPT-2 tokens)"
    expected = LLMC_HEADER_BYTES + 2 * count  # uint16 ids
    if size != expected:
        return (f"{path}: {size:,} bytes, but its header counts {count:,} tokens: "
                f"{expected:,} bytes with the header")
    return None


def llmc_verdict(dataset, data_file):
    """None if the folder holds llm.c shards of both splits, each with a sound header; else the line
    naming the first file that is wrong. Every header is read, as llm.c does before training."""
    if data_file is not None:
        return (f"--data_file: --dataset {dataset} holds llm.c's shards, read as they are, "
                f"not tokenised from a text file")
    folder = data_dir(dataset)
    for split in ("train", "val"):
        paths = llmc_shards(folder, split)
        if not paths:
            return f"--dataset {dataset}: {folder} holds no llm.c {split} shards (*_{split}*.bin)"
        for path in paths:
            error = llmc_error(path)
            if error is not None:
                return f"--dataset {dataset}: {error}"
    return None


def prepared(out, data_file):
    """Whether out/ holds complete .bin files of this text: meta.json (written last) names the
    text's sha256 (checked only for a --data_file: input.txt is the folder's own) and each split's
    token count, which the file's size must match (older meta.json files have no counts)."""
    meta_path = os.path.join(out, "meta.json")
    if not os.path.exists(meta_path):
        return False
    with open(meta_path) as f:
        meta = json.load(f)
    if data_file is not None and meta.get("sha256") != _sha256(data_file):
        return False
    for split, count in meta.get("tokens", {}).items():
        path = os.path.join(out, f"{split}.bin")
        if not os.path.exists(path) or os.path.getsize(path) != 2 * count:  # uint16 ids
            return False
    return True


def temporary(path):
    """This process's temporary name for path: by host and PID, as containers on several nodes
    often run their preparing process under the same PID."""
    return f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"


def publish(tmp, path):
    """Moves the finished file tmp to path, never replacing a file that already holds the same
    bytes: another node prepared it first, and its ranks may have it open (memmapped). On NFS a
    rename over a file open elsewhere gives those readers ESTALE, or SIGBUS in a memmap.
    os.link creates path only if it does not exist, atomically (on NFS too: the server decides);
    a file there is kept if it has tmp's bytes (tokenising is deterministic), and replaced only if
    it differs (the data of an older text)."""
    try:
        os.link(tmp, path)
        os.remove(tmp)
        return
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links: only the check below
        if not os.path.exists(path):
            os.replace(tmp, path)
            return
    if filecmp.cmp(tmp, path, shallow=False):
        os.remove(tmp)
    else:
        os.replace(tmp, path)


class Shards:
    """A split's shard files read as one array: len() and [start:stop] windows, which may cross a
    shard boundary and are then read from both. Each shard is memory-mapped, never read whole."""

    def __init__(self, paths, header_bytes=0):
        # header_bytes: what precedes the tokens in each file (ours: none; llm.c's: its header)
        self.parts = [np.memmap(path, dtype=np.uint16, mode="r", offset=header_bytes)
                      for path in paths]
        self.starts = np.cumsum([0] + [len(part) for part in self.parts])  # each part's first index

    def __len__(self):
        return int(self.starts[-1])

    def __getitem__(self, window):
        start, stop = window.start, window.stop
        pieces = []
        while start < stop:
            k = int(np.searchsorted(self.starts, start, side="right")) - 1  # the part holding start
            end = min(stop, int(self.starts[k + 1]))
            pieces.append(self.parts[k][start - self.starts[k]: end - self.starts[k]])
            start = end
        return np.concatenate(pieces)


_tokens = {}


def tokens(split, dataset="shakespeare"):
    """The split's token ids: data/<dataset>/<split>.bin memory-mapped, or its shards (Shards):
    those its manifest names, or llm.c's (checked by prepare() first), read after their headers."""
    key = (dataset, split)
    if key not in _tokens:
        folder = data_dir(dataset)
        if os.path.exists(os.path.join(folder, MANIFEST)):
            manifest = read_manifest(dataset)
            shards = [s["file"] for s in manifest["shards"] if s["split"] == split]
            paths = [os.path.join(folder, name) for name in shards]
            _tokens[key] = Shards(paths, header_bytes(manifest))
        elif paths := llmc_shards(folder, split):
            _tokens[key] = Shards(paths, LLMC_HEADER_BYTES)
        else:
            path = os.path.join(folder, f"{split}.bin")
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


class Batches:
    """This rank's rows of each training step's global batch on `device`, one step ahead, as
    nanoGPT prefetches: the loop calls get(step) for the step it runs, and prefetch(step + 1) once
    that step's work is queued, so the next batch is built on the host and copied while the device
    computes. The same get_batch() windows in the same order: only when they are made changes.
    CUDA: each batch goes through one of two pinned host buffers (pin_memory() fails on a
    CPU-only torch, so only there) and a non_blocking copy. A buffer is written again two steps
    later, when the step's host sync has long finished its copy; its event is still checked
    first, so the host never overwrites a buffer that a copy may be reading. `event`: the event
    factory (a test passes a fake)."""

    def __init__(self, args, rows, device, event=None):
        self.args, self.rows, self.device = args, rows, device
        self.pinned = device.type == "cuda"
        self.event = event or (lambda: torch.cuda.Event())
        self.buffers = [None, None]  # pinned (2, rows, block_size) int64: x and y
        self.copies = [None, None]  # the event recorded after each buffer's last copy
        self.ahead = None  # (step, x, y) fetched ahead

    def get(self, step):
        if self.ahead is None or self.ahead[0] != step:
            self.prefetch(step)  # the first step of a run: nothing was fetched ahead
        _, x, y = self.ahead
        self.ahead = None
        return x, y

    def prefetch(self, step):
        if step >= self.args.max_iters:
            return
        a = self.args
        x, y = get_batch("train", step, a.batch_size, a.block_size, a.seed, a.dataset)
        x, y = x[self.rows], y[self.rows]
        if not self.pinned:
            self.ahead = (step, x.to(self.device), y.to(self.device))
            return
        slot = step % 2
        if self.copies[slot] is not None and not self.copies[slot].query():
            self.copies[slot].synchronize()  # its copy still reads it: wait (never seen in a loop)
        if self.buffers[slot] is None:
            self.buffers[slot] = torch.empty((2, *x.shape), dtype=x.dtype).pin_memory()
        buffer = self.buffers[slot]
        buffer[0].copy_(x)
        buffer[1].copy_(y)
        on_device = self.copy_to_device(buffer)  # returns at once; the stream runs the copy
        self.copies[slot] = self.event()
        self.copies[slot].record()  # on the current stream, after the copy
        self.ahead = (step, on_device[0], on_device[1])

    def copy_to_device(self, buffer):
        return buffer.to(self.device, non_blocking=True)


def main(argv):
    """python -m common.data: Tiny Shakespeare's data/shakespeare/*.bin. With arguments, the older
    spelling of python -m common.prepare <dataset> [flags], which it runs in a process of its own:
    the loader never imports the preparer."""
    if argv:
        return subprocess.call([sys.executable, "-m", "common.prepare", *argv])
    error = prepare()
    if error is not None:
        sys.exit(f"error: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
