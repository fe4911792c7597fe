"""Pretraining corpora from the Hugging Face hub, tokenised into shards: OpenWebText, and FineWeb
and FineWeb-Edu's 10B-token samples (docs/data.md).

    python -m common.prepare fineweb_edu [--workers N] [--shard_tokens N]
    python -m common.prepare shakespeare   # Tiny Shakespeare: common.data.prepare(), as runs do

The parquet files download in the background (huggingface_hub, into its cache) while a pool of
workers tokenises the files already there, one row group a task, with tiktoken's GPT-2 encoding
and <|endoftext|> before each document. The main process appends the tokens, in corpus order, to
the partial file of the current shard; a full shard (--shard_tokens uint16 ids) is published
(common.data.publish), then the manifest that names it, with where the shard starts: (document,
offset), as documents span shards, and where every stream's partial shard stands. A rerun skips
the shards the manifest names and continues the partial ones it records, so a prepare killed at
any point resumes, and the loader never sees a partial shard. Branches and tags are pinned to
their commit; --format llmc writes llm.c's shards; --verify checks a prepared folder.
The hub's corpora need requirements-data.txt (pyarrow, huggingface_hub); training never imports
this module (`python -m common.data <name>`, an older spelling, runs this command in a process of
its own).
`python -m common.prepare --bench`: tokenising throughput and peak memory, on a synthetic corpus.
"""
import argparse
import collections
import concurrent.futures
import errno
import fnmatch
import functools
import glob
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import tiktoken

try:  # what the hub's corpora need beyond training; main() names the one that is missing
    import huggingface_hub
    import pyarrow as pa
    import pyarrow.parquet as pq
    import fcntl  # one prepare a folder: Unix only
    import resource  # peak memory and CPU seconds: Unix only
    missing = None
except ImportError as error:
    missing = error.name

from common import data


@dataclass(frozen=True)
class Source:
    """A dataset on the hub: its repository, the revision read, the parquet files' patterns, and
    how its validation split is drawn: "first_shard" (build-nanogpt: the first shard of the
    corpus) or "nanogpt_split" (nanoGPT: datasets' train_test_split(test_size, seed))."""
    repo: str
    revision: str
    patterns: tuple
    val: str


# Not checked online from here (the hub cannot be reached): the revisions are those public records
# name (fineweb-edu: a commit whose sample/10BT holds 14 parquet files; fineweb: the release tag),
# and OpenWebText, a loading-script dataset, is read from the hub's parquet conversion branch.
SOURCES = {
    "openwebtext": Source("Skylion007/openwebtext", "refs/convert/parquet",
                          ("plain_text/train/*.parquet",), "nanogpt_split"),
    "fineweb": Source("HuggingFaceFW/fineweb", "v1.4.0", ("sample/10BT/*.parquet",), "first_shard"),
    "fineweb_edu": Source("HuggingFaceFW/fineweb-edu", "87f09149ef4734204d70ed1d046ddc9ca3f2b8f9",
                          ("sample/10BT/*.parquet",), "first_shard"),
}
SHARD_TOKENS = 10**8  # build-nanogpt's shard: FineWeb's val split is the first one
NANOGPT_TEST_SIZE = 0.0005  # nanoGPT's openwebtext/prepare.py: train_test_split(0.0005, seed=2357)
NANOGPT_SEED = 2357
DOWNLOADS = 4  # files downloading at once, ahead of the tokenising
PROGRESS_S = 10.0  # seconds between progress lines


def list_files(source):
    """The repository's parquet files that the patterns match, in the corpus order (by name)."""
    names = huggingface_hub.list_repo_files(source.repo, repo_type="dataset",
                                            revision=source.revision)
    matched = [n for n in names if any(fnmatch.fnmatch(n, p) for p in source.patterns)]
    return sorted(matched)


def download(source, name):
    """The local path of one parquet file (huggingface_hub's cache: a rerun does not download it
    again, and an interrupted download resumes)."""
    return huggingface_hub.hf_hub_download(source.repo, name, repo_type="dataset",
                                           revision=source.revision)


def val_documents(count):
    """nanoGPT's validation documents of a corpus of `count`, as a boolean mask: datasets'
    train_test_split(test_size=0.0005, seed=2357) draws np.random.default_rng(seed).permutation
    and takes its first ceil(test_size * count) entries as the test split."""
    permutation = np.random.default_rng(NANOGPT_SEED).permutation(count)
    mask = np.zeros(count, dtype=bool)
    mask[permutation[:math.ceil(NANOGPT_TEST_SIZE * count)]] = True
    return mask


# ---- the workers: one row group of one parquet file each ------------------------------------

_worker = {}  # this worker's encoding, and the parquet file it read last (open)


def start_worker():
    _worker["encoding"] = tiktoken.get_encoding("gpt2")
    _worker["file"] = (None, None)


def tokenise(task):
    """(first document's index, tokens per document, token ids) of the task's documents: rows
    first_row.. of one row group, each as <|endoftext|> and its text's ids. encode_ordinary reads
    a literal "<|endoftext|>" in a text as text, never as the special token."""
    path, row_group, first_doc, first_row = task
    if _worker["file"][0] != path:
        _worker["file"] = (path, pq.ParquetFile(path))
    table = _worker["file"][1].read_row_group(row_group, columns=["text"], use_threads=False)
    texts = table.column("text").to_pylist()[first_row:]
    encoding = _worker["encoding"]
    eot = encoding.eot_token
    ids, lengths = [], []
    for text in texts:
        doc = encoding.encode_ordinary(text or "")  # a null text: an empty document
        ids.append(eot)  # before the document, as build-nanogpt and llm.c (nanoGPT: after)
        ids.extend(doc)
        lengths.append(1 + len(doc))
    return first_doc, np.array(lengths, dtype=np.int64), np.array(ids, dtype=np.uint16)


# ---- the main process: tasks in corpus order, shards, manifest ------------------------------

def row_groups(paths, first_doc, first_file, base, counted, n_files):
    """Tasks (path, row group, index of its first document taken, first row taken) from document
    first_doc on, each with the share of the n_files that its end reaches; `paths` yields each
    file's local path in order, once it is downloaded, from file first_file (its first document:
    base). Each file's documents are added to `counted` once its footer is read."""
    for k, path in enumerate(paths, start=first_file):
        meta = pq.ParquetFile(path).metadata
        if k == len(counted):
            counted.append(meta.num_rows)
        for row_group in range(meta.num_row_groups):
            rows = meta.row_group(row_group).num_rows
            if base + rows > first_doc:
                first_row = max(0, first_doc - base)
                fraction = (k + (row_group + 1) / meta.num_row_groups) / n_files
                yield (path, row_group, base + first_row, first_row), fraction
            base += rows


def in_order(pool, tasks, window):
    """Each task's result, in the tasks' order, with at most `window` tasks queued or done and not
    yet taken: the memory held is bounded by row groups, whatever the corpus size. A worker that
    dies (the OOM killer's SIGKILL) raises BrokenProcessPool here, where a multiprocessing.Pool
    would wait for its result forever (cpython #96062)."""
    pending = collections.deque()
    for task in tasks:
        pending.append(pool.submit(tokenise, task))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


class Stream:
    """One stream of documents cut into shards of shard_tokens ids: the corpus (FineWeb: its first
    shard is the val split) or one split (OpenWebText). Each shard is written to its partial file
    as the tokens come, then published, then named in the manifest. `llmc`: each shard starts
    with llm.c's header (common.data.LLMC_*), and is named as llm.c names them."""

    def __init__(self, folder, stream, manifest, shard_tokens, llmc=False):
        self.folder, self.stream, self.manifest = folder, stream, manifest
        self.shard_tokens, self.llmc = shard_tokens, llmc
        published = [s for s in manifest["shards"] if s["stream"] == stream]
        self.index = len(published)  # of the next shard
        # What the published shards hold: every token before (document, offset), in this stream.
        self.done = published[-1]["end"] if published else [0, 0]
        self.seen = self.done[0]  # the documents before it were all given to add()
        self.file, self.entry = None, None
        self.streams = [self]  # all the streams of the corpus (prepare sets it)
        progress = manifest.get("progress", {}).get(stream)
        # Its tokens of the documents before `seen` are in the shards or the partial one (a
        # stream that publishes in add() has not seen all of the batch: its shards' end holds)
        if progress is not None and self.reopen(progress["partial"]):
            self.seen = max(self.seen, progress["seen"])
            self.done = [self.seen, 0] if self.seen > self.done[0] else self.done

    def split(self):
        if self.stream == "corpus":
            return "val" if self.index == 0 else "train"
        return self.stream

    def partial(self, name):
        """The shard's file while it is written: one name a host, the same in every run, so a
        rerun continues it where the manifest recorded it (OpenWebText's val shard, the size of
        the whole run)."""
        return os.path.join(self.folder, f"{name}.partial.{socket.gethostname()}")

    def reopen(self, entry):
        """Continues the partial shard `entry` of a killed run, cut back to what the manifest
        recorded; False if its file is gone or short (the stream restarts at its last shard)."""
        if entry is None:
            return True
        path = self.partial(entry["file"])
        size = self.header_bytes() + 2 * entry["tokens"]
        if not os.path.exists(path) or os.path.getsize(path) < size:
            return False
        self.file = open(path, "r+b")
        self.file.truncate(size)
        self.file.seek(size)
        self.entry = dict(entry)
        return True

    def header_bytes(self):
        return data.LLMC_HEADER_BYTES if self.llmc else 0

    def add(self, ids, docs, lengths, through):
        """Appends the tokens `ids` of whole documents `docs` (lengths[k] tokens each, in order),
        less those written already; `through`: the documents before it have all been given."""
        done_doc, done_offset = self.done
        skip = int(lengths[docs < done_doc].sum())
        if done_doc in docs:
            skip += done_offset
        ends = np.cumsum(lengths)  # where each document ends in ids

        def position(k):  # [document, offset] of ids[k]
            j = int(np.searchsorted(ends, k, side="right"))
            return [int(docs[j]), int(k - (ends[j] - lengths[j]))]
        k = skip
        while k < len(ids):
            if self.file is None:
                self.open(position(k))
            n = min(len(ids) - k, self.shard_tokens - self.entry["tokens"])
            ids[k:k + n].tofile(self.file)
            self.entry["tokens"] += n
            k += n
            doc, offset = position(k - 1)
            self.entry["end"] = [doc, offset + 1]  # the token after the last one written
            if self.entry["tokens"] == self.shard_tokens:
                self.publish()
        self.seen = max(self.seen, through)

    def open(self, start):
        split = self.split()
        name = f"{split}_{self.index:06d}.bin"
        if self.llmc:  # llm.c's names: <dataset>_<split>_<index>.bin
            name = f"{self.manifest['dataset']}_{name}"
        self.entry = dict(file=name, split=split, stream=self.stream, tokens=0, start=start,
                          end=start)
        self.file = open(self.partial(name), "wb")
        self.file.write(bytes(self.header_bytes()))  # llm.c's header, filled in by publish

    def sync(self):
        """The partial shard on disk, as far as written: what the manifest may then record."""
        self.file.flush()
        os.fsync(self.file.fileno())

    def progress(self):
        return dict(seen=self.seen, partial=None if self.file is None else dict(self.entry))

    def publish(self):
        """The shard, then the manifest naming it: a kill between the two leaves a published shard
        that no manifest names, which the rerun writes again with the same bytes."""
        if self.llmc:  # magic, version, tokens, then zeros: llm.c's write_datafile
            header = np.zeros(data.LLMC_HEADER_INTS, dtype=np.int32)
            header[:3] = data.LLMC_MAGIC, data.LLMC_VERSION, self.entry["tokens"]
            self.file.seek(0)
            header.tofile(self.file)
        # On disk before its name is: a lost machine, not only a killed process, leaves no
        # partial shard under the name.
        self.sync()
        self.file.close()
        path = os.path.join(self.folder, self.entry["file"])
        self.entry["sha256"] = sha256(self.partial(self.entry["file"]))
        data.publish(self.partial(self.entry["file"]), path)
        self.manifest["shards"].append(self.entry)
        self.done = self.entry["end"]
        self.index += 1
        self.file, self.entry = None, None
        # With the shard, where every stream is: a rerun continues each from there
        for stream in self.streams:
            if stream.file is not None:
                stream.sync()
        self.manifest["progress"] = {stream.stream: stream.progress() for stream in self.streams}
        write_manifest(self.folder, self.manifest)

    def finish(self):  # the last shard, shorter than shard_tokens
        if self.file is not None:
            self.publish()


def sha256(path):
    """The file's SHA-256, read 16 MB at a time (a shard is 200 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder, manifest):
    path = os.path.join(folder, data.MANIFEST)
    with open(data.temporary(path), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    data.publish(data.temporary(path), path)


def read_manifest(folder, fresh):
    """The manifest to resume from: the one in folder, its shards cut at the first one whose file is
    missing or of another size (the rest, and the streams' progress, are written again), or
    `fresh` if there is none. A line saying why not if the folder holds another source's shards."""
    path = os.path.join(folder, data.MANIFEST)
    if not os.path.exists(path):
        return fresh
    with open(path) as f:
        manifest = json.load(f)
    pinned = manifest.get("commit")  # None: prepared before commits were recorded, or local files
    if pinned is not None and fresh["commit"] is not None and pinned != fresh["commit"]:
        return (f"{fresh['repo']}@{fresh['revision']} is commit {fresh['commit']} now, but "
                f"{folder} holds shards of commit {pinned}: pass --revision {pinned} to finish "
                f"it, or delete the folder to prepare the new one")
    same = ("dataset", "repo", "files", "shard_tokens") + (() if pinned else ("revision",))
    if any(manifest.get(key) != fresh[key] for key in same) or manifest.get("format", "raw") != \
            fresh["format"]:
        return (f"{folder} holds shards of another source, --shard_tokens or --format (its "
                f"{data.MANIFEST}); delete the folder, or pass the flags it was prepared with")
    header = data.header_bytes(fresh)  # llm.c's, before each shard's tokens, or none
    for k, shard in enumerate(manifest["shards"]):
        shard_path = os.path.join(folder, shard["file"])
        size = header + 2 * shard["tokens"]
        if not os.path.exists(shard_path) or os.path.getsize(shard_path) != size:
            manifest["shards"] = manifest["shards"][:k]
            manifest["progress"] = {}
            manifest["complete"] = False
            break
    return manifest


def remove_stale_temporaries(folder, kept):
    """This host's temporary files of processes no longer running (a manifest being written), and
    its partial shards that no stream continues (`kept`: their paths)."""
    host = socket.gethostname()
    for path in glob.glob(os.path.join(folder, f"*.tmp.{host}.*")):
        pid = int(path.rsplit(".", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os.remove(path)
    for path in glob.glob(os.path.join(folder, f"*.partial.{host}")):
        if path not in kept:
            os.remove(path)


def summary(dataset, manifest):
    counts = manifest["tokens"]
    shards = collections.Counter(s["split"] for s in manifest["shards"])
    return (f"{dataset}: {manifest['documents']:,} documents; train {counts['train']:,} tokens in "
            f"{shards['train']} shards, val {counts['val']:,} tokens in {shards['val']} shards")


def cpu_seconds(who):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mb():
    """This process's peak resident memory: Linux's VmHWM, as ru_maxrss also counts the memory of
    the process that started this one, from before its exec."""
    if not os.path.exists("/proc/self/status"):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def prepare(dataset, folder, source, names, fetch, workers, shard_tokens, commit, fmt):
    """Tokenises the source's files `names` (`fetch(name)`: its local path) into folder/; returns
    None, or one line saying what is wrong."""
    fresh = dict(dataset=dataset, repo=source.repo, revision=source.revision, commit=commit,
                 files=names, shard_tokens=shard_tokens, format=fmt, val=source.val,
                 eot="before each document", shards=[], file_documents=[], progress={},
                 complete=False)
    os.makedirs(folder, exist_ok=True)
    # A POSIX lock: this process's alone (the forked workers do not inherit it), released when
    # it ends, however it ends
    lock = open(os.path.join(folder, "prepare.lock"), "w")
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return f"another python -m common.prepare is writing {folder}: wait for it to end"
    manifest = read_manifest(folder, fresh)
    if isinstance(manifest, str):
        return manifest
    if manifest["complete"]:
        print(summary(dataset, manifest) + f" (already prepared in {folder})", flush=True)
        return None
    splits = ("val", "train") if source.val == "nanogpt_split" else ("corpus",)
    streams = [Stream(folder, split, manifest, shard_tokens, fmt == "llmc") for split in splits]
    for stream in streams:
        stream.streams = streams
    remove_stale_temporaries(folder, [s.file.name for s in streams if s.file is not None])
    first_doc = min(s.done[0] for s in streams)
    # The files wholly before first_doc, by the documents each holds (recorded as their footers
    # are read), are neither downloaded nor read again.
    counted = manifest["file_documents"]
    skip, base = 0, 0
    while skip < len(counted) and base + counted[skip] <= first_doc:
        base, skip = base + counted[skip], skip + 1
    if manifest["shards"] or first_doc:
        print(f"{dataset}: resuming after {len(manifest['shards'])} published shards, at "
              f"document {first_doc:,}", flush=True)
    # fork: the workers start as copies of this process, before any thread of this one exists
    # (the downloads') and before pyarrow reads anything; spawn would import torch in each.
    children_cpu = cpu_seconds(resource.RUSAGE_CHILDREN)
    main_cpu = cpu_seconds(resource.RUSAGE_SELF)
    fork = multiprocessing.get_context("fork")
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=fork,
                                                  initializer=start_worker)
    pool.submit(int).result()  # with fork, every worker starts now: before the downloads' threads
    downloads = concurrent.futures.ThreadPoolExecutor(DOWNLOADS)
    try:
        files = [downloads.submit(fetch, name) for name in names[skip:]]
        val = None  # FineWeb: one stream, whose first shard is the val split
        if source.val == "nanogpt_split":  # the split needs the count: every file's, once
            if len(counted) < len(names):
                counted[:] = [pq.ParquetFile(f.result()).metadata.num_rows for f in files]
            val = val_documents(sum(counted))
        fractions = collections.deque()  # of the corpus's files, at each task's end
        tasks = (fractions.append(fraction) or task for task, fraction in
                 row_groups((f.result() for f in files), first_doc, skip, base, counted,
                            len(names)))
        start, last_print, documents, tokens = time.monotonic(), time.monotonic(), 0, 0
        first_fraction = None
        for first, lengths, ids in in_order(pool, tasks, 2 * workers):
            docs = first + np.arange(len(lengths))
            through = int(docs[-1]) + 1 if len(docs) else first
            if val is None:
                streams[0].add(ids, docs, lengths, through)
            else:
                in_val = val[docs]
                for stream, chosen in zip(streams, (in_val, ~in_val)):  # ("val", "train")
                    stream.add(ids[np.repeat(chosen, lengths)], docs[chosen], lengths[chosen],
                               through)
            documents, tokens = documents + len(lengths), tokens + len(ids)
            fraction = fractions.popleft()
            if first_fraction is None:
                first_fraction = fraction
            if time.monotonic() - last_print > PROGRESS_S:
                last_print = time.monotonic()
                print(progress(dataset, documents, tokens, last_print - start,
                               fraction, first_fraction, len(manifest["shards"])), flush=True)
        for stream in reversed(streams):  # train's last shard, then (OpenWebText) the val split
            stream.finish()
        elapsed = time.monotonic() - start
        manifest["documents"] = sum(counted)  # every file's footer has been read by now
    finally:
        # waits for the workers (their CPU and memory join RUSAGE_CHILDREN's); a dead one: at once
        pool.shutdown(cancel_futures=True)
        downloads.shutdown(cancel_futures=True)
    cpu = cpu_seconds(resource.RUSAGE_SELF) - main_cpu
    cpu += cpu_seconds(resource.RUSAGE_CHILDREN) - children_cpu
    manifest["tokens"] = {split: sum(s["tokens"] for s in manifest["shards"] if s["split"] == split)
                          for split in ("train", "val")}
    manifest["progress"] = {}
    manifest["complete"] = True
    write_manifest(folder, manifest)
    main_mb = peak_rss_mb()
    worker_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux: in KiB
    rate = tokens / max(elapsed, 1e-9)
    print(f"{dataset}: tokenised {tokens:,} tokens in {elapsed:.1f} s ({rate:,.0f} tokens/s, "
          f"{workers} workers, {cpu:.1f} CPU-s); peak RSS {main_mb:,.0f} MB, a worker's "
          f"{worker_mb:,.0f} MB", flush=True)
    print(summary(dataset, manifest) + f" -> {folder}", flush=True)
    return None


def progress(dataset, documents, tokens, seconds, fraction, first_fraction, shards):
    """The progress line: what is done since the start, and the estimated time left, from the
    share of the corpus's files done in this run (row groups: of about equal size)."""
    line = (f"{dataset}: {100 * fraction:.1f}% of the files, {documents:,} documents, {tokens:,} "
            f"tokens, {tokens / seconds:,.0f} tokens/s, {shards} shards published")
    if fraction > first_fraction:
        left = seconds * (1 - fraction) / (fraction - first_fraction)
        line += f", about {left / 60:,.0f} min left"
    return line


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m common.prepare",
                                description="Download and tokenise a pretraining corpus into "
                                            "data/<dataset>/ (docs/data.md).")
    p.add_argument("dataset", choices=["shakespeare", *sorted(SOURCES)])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p.add_argument("--workers", type=int, default=cores, help="tokenising processes")
    p.add_argument("--shard_tokens", type=int, default=SHARD_TOKENS, help="uint16 ids a shard")
    p.add_argument("--revision", default=None,
                   help="the hub revision: a branch, tag or commit (default: the pinned one); "
                        "a branch or tag is resolved to its commit once, and recorded")
    p.add_argument("--format", choices=["raw", "llmc"], default="raw",
                   help="raw: uint16 ids; llmc: llm.c's .bin shards (a 1,024-byte header first, "
                        "named <dataset>_<split>_<index>.bin), which llm.c's trainer reads too")
    p.add_argument("--data_dir", default=None, help="where the shards go (default data/<dataset>, "
                                                    "where training reads them)")
    p.add_argument("--parquet_dir", default=None,
                   help="read the parquet files from this folder (laid out as in the repository) "
                        "instead of the hub")
    p.add_argument("--verify", action="store_true",
                   help="check each shard against the manifest's SHA-256 and print the manifest's "
                        "own: two folders with the same one hold the same shards")
    return p.parse_args(argv)


def resolve(source):
    """The commit of the source's revision: the revision itself if it is one (no request), else
    the hub's answer, asked once: the files are then listed and downloaded at that commit."""
    if is_commit(source.revision):
        return source.revision
    info = huggingface_hub.HfApi().dataset_info(source.repo, revision=source.revision)
    return info.sha


def is_commit(revision):
    return len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


def verify(folder):
    """None and a line with the manifest's digest, or one line naming what does not match."""
    path = os.path.join(folder, data.MANIFEST)
    if not os.path.exists(path):
        return f"{folder} has no {data.MANIFEST}: not prepared", None
    with open(path) as f:
        manifest = json.load(f)
    if not manifest["complete"]:
        return f"{folder} is only partly prepared: run the prepare again to finish it", None
    for shard in manifest["shards"]:
        shard_path = os.path.join(folder, shard["file"])
        if not os.path.exists(shard_path) or sha256(shard_path) != shard.get("sha256"):
            return f"{shard_path} is missing, or differs from its manifest's SHA-256", None
    return None, (f"{len(manifest['shards'])} shards match {path}, whose SHA-256 is "
                  f"{sha256(path)}")


def failure(e):
    """One line for an exception of the preparing: what went wrong, and whether a rerun, which
    resumes, can fix it."""
    if isinstance(e, concurrent.futures.process.BrokenProcessPool):
        return ("a tokenising worker died (killed: out of memory?); run again, with fewer "
                "--workers if memory ran out, to resume")
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"the disk is full ({e}); free some (docs/data.md: Disk) and run again to resume"
    if isinstance(e, OSError):  # the hub's errors (a connection, a download) are OSErrors too
        return f"{type(e).__name__}: {e}; run again to resume, once the cause is fixed"
    if isinstance(e, pa.ArrowException):
        return (f"a parquet file cannot be read ({type(e).__name__}: {e}); delete it from "
                f"huggingface_hub's cache (hf cache rm, or huggingface-cli delete-cache), then "
                f"run again to resume")
    return f"preparing failed ({type(e).__name__}: {e}); running again will not fix this"


def main(argv):
    """python -m common.prepare <dataset> [flags]: 0, or exits with one error line."""
    args = parse(argv)
    if args.dataset == "shakespeare":  # the loader's own, which needs no library of the hub's
        error = data.prepare()
        if error is not None:
            sys.exit(f"error: {error}")
        return 0
    if missing in ("huggingface_hub", "pyarrow"):
        sys.exit(f"error: python -m common.prepare {args.dataset} needs {missing}: "
                 "pip install -r requirements-data.txt (pyarrow, huggingface_hub)")
    if missing is not None:
        sys.exit(f"error: python -m common.prepare {args.dataset} needs Python's {missing} "
                 "module, which Windows lacks: it runs on Linux and macOS (on Windows: in WSL)")
    folder = args.data_dir or data.data_dir(args.dataset)
    if args.verify:
        error, line = verify(folder)
        if error is not None:
            sys.exit(f"error: {args.dataset}: {error}")
        print(f"{args.dataset}: {line}", flush=True)
        return 0
    for flag in ("workers", "shard_tokens"):
        if getattr(args, flag) < 1:
            sys.exit(f"error: --{flag}: must be >= 1, got {getattr(args, flag)}")
    source = SOURCES[args.dataset]
    if args.revision is not None:
        source = Source(source.repo, args.revision, source.patterns, source.val)
    commit = source.revision if is_commit(source.revision) else None  # local files: as named
    error = data.use_offline_dir()
    if error is None:
        try:
            tiktoken.get_encoding("gpt2")  # tiktoken fetches the BPE files on first use
        except Exception as e:
            error = f"cannot load tiktoken's gpt2 encoding ({type(e).__name__}: {e})"
    if error is None:
        try:
            if args.parquet_dir is None:
                commit = resolve(source)
                pinned = Source(source.repo, commit, source.patterns, source.val)
                names = list_files(pinned)
                fetch = functools.partial(download, pinned)
            else:
                names = sorted(os.path.relpath(p, args.parquet_dir) for pattern in source.patterns
                               for p in glob.glob(os.path.join(args.parquet_dir, pattern)))
                fetch = functools.partial(os.path.join, args.parquet_dir)
        except Exception as e:
            error = f"cannot list {source.repo}@{source.revision}: {type(e).__name__}: {e}"
    if error is None and not names:
        error = f"no file of {source.repo}@{source.revision} matches {', '.join(source.patterns)}"
    if error is None:
        try:
            error = prepare(args.dataset, folder, source, names, fetch, args.workers,
                            args.shard_tokens, commit, args.format)
        except Exception as e:
            error = failure(e)
    if error is not None:
        sys.exit(f"error: {args.dataset}: {error}")
    return 0


# ---- the bench: python -m common.prepare --bench -------------------------------------------

def synthetic_corpus(folder, megabytes, docs_a_file=20000):
    """About `megabytes` MB of text as parquet files laid out as FineWeb's sample/10BT (row groups
    of 1,000 documents, as FineWeb's): documents of 200 to 8,000 characters cut from Tiny
    Shakespeare at random places."""
    error = data.prepare()
    if error is not None:
        sys.exit(f"error: {error}")
    with open(os.path.join(data.data_dir("shakespeare"), "input.txt"), encoding="utf-8") as f:
        text = f.read()
    rng = np.random.default_rng(0)
    texts, size, files = [], 0, 0
    while size < megabytes * 2**20 or texts:
        length = int(rng.integers(200, 8000))
        start = int(rng.integers(0, len(text) - length))
        texts.append(text[start:start + length])
        size += length
        if len(texts) == docs_a_file or size >= megabytes * 2**20:
            path = os.path.join(folder, "sample", "10BT", f"{files:03d}_00000.parquet")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            pq.write_table(pa.table({"text": texts}), path, row_group_size=1000)
            texts, files = [], files + 1
            if size >= megabytes * 2**20:
                break


def bench(workers, sizes_mb, rounds):
    """At each corpus size, `rounds` times each, alternating: tiktoken's
    encode_ordinary_batch(docs, num_threads=workers) on the documents already in memory, and
    `python -m common.prepare fineweb_edu --parquet_dir` on their files in a process of its own (its
    tokenising loop's seconds, CPU seconds and peak RSS, as it prints them). The best wall time of
    each is kept, as other work on the machine only slows a round down; CPU seconds, which it
    hardly changes, give the cost of the pool, the parquet reading and the shards."""
    encoding = tiktoken.get_encoding("gpt2")
    for megabytes in sizes_mb:
        with tempfile.TemporaryDirectory() as folder:
            corpus = os.path.join(folder, "corpus")
            synthetic_corpus(corpus, megabytes)
            paths = sorted(glob.glob(os.path.join(corpus, "sample", "10BT", "*.parquet")))
            docs = [t for p in paths for t in pq.read_table(p).column("text").to_pylist()]
            in_memory, prepared, rss = [], [], []  # (wall s, CPU s) of each round
            for r in range(rounds):
                start, cpu = time.perf_counter(), time.process_time()
                ids = encoding.encode_ordinary_batch(docs, num_threads=workers)
                in_memory.append((time.perf_counter() - start, time.process_time() - cpu))
                count = sum(len(doc) for doc in ids) + len(docs)  # with each <|endoftext|>
                del ids
                command = [sys.executable, "-m", "common.prepare", "fineweb_edu", "--parquet_dir",
                           corpus, "--data_dir", os.path.join(folder, f"shards{r}"), "--workers",
                           str(workers), "--shard_tokens", str(10**7)]
                out = subprocess.run(command, cwd=data.REPO_ROOT, capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(out.stderr)
                line = next(ln for ln in out.stdout.splitlines() if "tokenised" in ln)
                wall = float(line.split(" tokens in ")[1].split(" s ")[0])
                prepared.append((wall, float(line.split(" workers, ")[1].split(" CPU-s")[0])))
                rss.append(line.split("peak RSS ")[1])
                shutil.rmtree(os.path.join(folder, f"shards{r}"))
        wall_ratio = min(in_memory)[0] / min(prepared)[0]
        cpu_ratio = min(c for _, c in in_memory) / min(c for _, c in prepared)
        print(f"bench {megabytes} MB ({count:,} tokens), {workers} workers, best of {rounds}: "
              f"prepare {count / min(prepared)[0]:,.0f} tokens/s (parquet -> published shards), "
              f"encode_ordinary_batch {count / min(in_memory)[0]:,.0f} tokens/s (in memory): "
              f"ratio {wall_ratio:.2f} (CPU seconds: {cpu_ratio:.2f}); peak RSS "
              f"{' / '.join(rss)}", flush=True)


if __name__ == "__main__" and "--bench" not in sys.argv[1:]:
    sys.exit(main(sys.argv[1:]))
elif __name__ == "__main__":
    bench_flags = argparse.ArgumentParser(prog="python -m common.prepare")
    bench_flags.add_argument("--bench", action="store_true", required=True)
    bench_flags.add_argument("--workers", type=int, default=parse(["fineweb"]).workers)
    bench_flags.add_argument("--sizes_mb", default="200,400", help="corpus sizes, comma-separated")
    bench_flags.add_argument("--rounds", type=int, default=2, help="runs of each, alternating")
    flags = bench_flags.parse_args()
    bench(flags.workers, [int(size) for size in flags.sizes_mb.split(",")], flags.rounds)
