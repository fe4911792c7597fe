"""The hub's corpora (common/prepare.py) and the loader that spans their shards (common/data.py).

A small corpus is written in the hub's own file format (parquet files with a `text` column, several row groups each)
and prepared through the same code path as the hub's, with only the two hub calls (list_files, download) replaced.
No test reaches the network: HF_HUB_OFFLINE=1, and a socket guard fails any connection. The expected tokens are
recomputed here with tiktoken: <|endoftext|> before each document, a literal "<|endoftext|>" in a text read as text.
"""
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import torch

from conftest import PARITY, PARITY_STEPS, REPO, TINY, launch, run_record, the_one_error
from test_parity import NORM_TOL, TOL, differences
from common import data, prepare
from common.model import GPT, GPTConfig

SHARD = 64  # tokens a shard: the long document spans several, and a window of 33 tokens often crosses two
NAMES = ["sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"]  # as on the hub
ROW_GROUP = 4  # rows a row group: each file is several tasks
TEXTS = [
    "The first document: plain English, a few words long.",
    "A literal <|endoftext|> in a document is text, not the special token.",
    "",  # an empty document: its <|endoftext|> alone
    " ".join(f"word{i}" for i in range(150)),  # longer than a shard (several hundred tokens)
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, emoji 😀🚀.",
] + [f"Document {i}: " + "to be, or not to be, that is the question. " * (1 + i % 5) for i in range(35)]


def write_corpus(folder):
    """TEXTS as NAMES under folder, the documents split between the files in order."""
    half = len(TEXTS) // 2
    for name, texts in zip(NAMES, (TEXTS[:half], TEXTS[half:])):
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        table = pa.table({"id": [str(uuid.uuid4()) for _ in texts], "text": texts})
        pq.write_table(table, path, row_group_size=ROW_GROUP)


def documents():
    """Each document's tokens, recomputed: <|endoftext|> before each."""
    encoding = tiktoken.get_encoding("gpt2")
    return [[encoding.eot_token] + encoding.encode_ordinary(text) for text in TEXTS]


def run_prepare(corpus, out, workers, dataset="fineweb_edu"):
    """prepare.main on the corpus, with the hub's listing and download answered from the corpus folder."""
    asked = []

    def download(source, name):
        asked.append((source.repo, source.revision, name))
        return os.path.join(corpus, name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepare, "list_files", lambda source: list(NAMES))
        patch.setattr(prepare, "download", download)
        code = prepare.main([dataset, "--data_dir", str(out), "--workers", str(workers), "--shard_tokens",
                             str(SHARD)])
    source = prepare.SOURCES[dataset]
    assert code == 0 and sorted(asked) == [(source.repo, source.revision, name) for name in NAMES]


def folder_bytes(folder):
    """{name: bytes} of every file in folder."""
    return {name: pathlib.Path(folder, name).read_bytes() for name in sorted(os.listdir(folder))}


def split_ids(folder, split):
    manifest = json.loads(pathlib.Path(folder, data.MANIFEST).read_text())
    files = [s["file"] for s in manifest["shards"] if s["split"] == split]
    return np.concatenate([np.fromfile(os.path.join(folder, f), dtype=np.uint16) for f in files])


def refuse(*args, **kwargs):
    raise AssertionError("a network call in an offline test")


def go_offline(patch):
    """huggingface_hub is told it is offline, and any connection fails (the pool's workers, forked, inherit it)."""
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setattr(socket.socket, "connect", refuse)
    patch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    go_offline(monkeypatch)


@pytest.fixture
def one_thread(monkeypatch):
    """Launches with one thread a process, as the ranks have (one fork server for them all): on a loaded machine two
    threads took a 1-process run 15 s instead of 3."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hub")
    write_corpus(str(folder))
    return folder


@pytest.fixture(scope="module")
def sharded(corpus):
    """The corpus prepared as fineweb_edu with 2 workers, in a data/ folder of its own (the parity row trains on
    it by its --dataset name), removed after the module's tests."""
    name = f"test_shards_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as patch:  # a module-scoped fixture: offline by hand
        go_offline(patch)
        run_prepare(corpus, data.data_dir(name), workers=2)
    yield name
    shutil.rmtree(data.data_dir(name), ignore_errors=True)
    for split in ("train", "val"):
        data._tokens.pop((name, split), None)


def test_each_document_is_its_eot_then_its_text(sharded):
    folder = data.data_dir(sharded)
    docs = documents()
    stream = np.array([t for doc in docs for t in doc], dtype=np.uint16)
    val, train = split_ids(folder, "val"), split_ids(folder, "train")
    assert np.array_equal(val, stream[:SHARD]) and np.array_equal(train, stream[SHARD:])  # the first shard is val
    eot = tiktoken.get_encoding("gpt2").eot_token
    assert (stream == eot).sum() == len(TEXTS)  # the literal "<|endoftext|>" is text: one EOT a document
    manifest = json.loads(pathlib.Path(folder, data.MANIFEST).read_text())
    assert manifest["complete"] and manifest["documents"] == len(TEXTS)
    assert manifest["tokens"] == {"train": len(stream) - SHARD, "val": SHARD}
    sizes = [s["tokens"] for s in manifest["shards"]]
    assert sizes[:-1] == [SHARD] * (len(sizes) - 1) and 0 < sizes[-1] <= SHARD
    assert any(len(doc) > SHARD for doc in docs)  # the long document spans shards
    doc_starts = np.cumsum([0] + [len(doc) for doc in docs])
    for k, shard in enumerate(manifest["shards"]):  # each shard's (document, offset): where it starts and ends
        assert doc_starts[shard["start"][0]] + shard["start"][1] == k * SHARD
        assert doc_starts[shard["end"][0]] + shard["end"][1] == k * SHARD + shard["tokens"]


def test_one_or_two_workers_and_a_local_folder_give_the_same_bytes(sharded, corpus, tmp_path):
    run_prepare(corpus, tmp_path / "one", workers=1)
    with pytest.MonkeyPatch.context() as patch:  # --parquet_dir: the files from a folder, not the hub
        patch.setattr(prepare, "list_files", None)
        patch.setattr(prepare, "download", None)
        assert prepare.main(["fineweb_edu", "--data_dir", str(tmp_path / "local"), "--workers", "2",
                             "--shard_tokens", str(SHARD), "--parquet_dir", str(corpus)]) == 0
    two = folder_bytes(data.data_dir(sharded))
    assert folder_bytes(tmp_path / "one") == two
    assert folder_bytes(tmp_path / "local") == two


def test_openwebtext_val_is_nanogpts_split(corpus, tmp_path):
    # datasets 5.2.0's Dataset.train_test_split(test_size=0.0005, seed=2357) on 20,000 rows, as nanoGPT calls it
    # (recorded: datasets is not a dependency)
    assert np.flatnonzero(prepare.val_documents(20000)).tolist() == [
        1602, 3666, 3969, 6134, 7518, 8851, 13717, 14082, 14140, 19177]
    run_prepare(corpus, tmp_path, workers=2, dataset="openwebtext")
    val_docs = set(np.flatnonzero(prepare.val_documents(len(TEXTS))))
    assert len(val_docs) == math.ceil(0.0005 * len(TEXTS))
    docs = documents()
    expected = {split: [t for k, doc in enumerate(docs) if (k in val_docs) == (split == "val") for t in doc]
                for split in ("train", "val")}
    for split in ("train", "val"):  # each split's documents in the corpus order
        assert split_ids(str(tmp_path), split).tolist() == expected[split]


# The prepare killed (SIGKILL) at a hooked point: once two shards or more are published, after a task's tokens went
# to the temporary file of a shard that is not full.
KILLED = r'''
import json, os, signal, socket, sys
sys.path.insert(0, sys.argv[1])
def refuse(*args, **kwargs):
    raise AssertionError("a network call in an offline test")
socket.socket.connect = socket.socket.connect_ex = refuse
from common import prepare
corpus, out, names = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
prepare.list_files = lambda source: names
prepare.download = lambda source, name: os.path.join(corpus, name)
add = prepare.Stream.add
def add_then_die(self, ids, docs, lengths):
    add(self, ids, docs, lengths)
    if self.index >= 2 and self.entry is not None and self.entry["tokens"] > 0:
        os.kill(os.getpid(), signal.SIGKILL)
prepare.Stream.add = add_then_die
prepare.main(["fineweb_edu", "--data_dir", out, "--workers", "2", "--shard_tokens", sys.argv[5]])
'''


def test_a_prepare_killed_mid_shard_resumes_to_the_same_bytes(sharded, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    killed = subprocess.Popen([sys.executable, "-c", KILLED, REPO, str(corpus), str(out), json.dumps(NAMES), str(SHARD)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = killed.communicate(timeout=60)
    finally:  # its workers too, if any outlived it
        try:
            os.killpg(killed.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        killed.wait()
    assert killed.returncode == -signal.SIGKILL, stderr[-2000:]
    manifest = json.loads((out / data.MANIFEST).read_text())
    published = len(manifest["shards"])
    assert not manifest["complete"] and published >= 2
    temporaries = [name for name in os.listdir(out) if ".tmp." in name]
    assert len(temporaries) == 1 and os.path.getsize(out / temporaries[0]) > 0  # the shard it was writing
    final = folder_bytes(data.data_dir(sharded))
    for shard in manifest["shards"]:  # what it published is final
        assert (out / shard["file"]).read_bytes() == final[shard["file"]]
    capsys.readouterr()
    run_prepare(corpus, out, workers=2)
    assert f"resuming after {published} published shards" in capsys.readouterr().out
    assert folder_bytes(out) == final  # the temporary file of the killed run removed, too


def test_the_loader_reads_a_window_across_shards(sharded, tmp_path):
    stream = np.array([t for doc in documents() for t in doc], dtype=np.uint16)
    train = data.tokens("train", sharded)
    assert isinstance(train, data.Shards) and all(isinstance(part, np.memmap) for part in train.parts)
    assert len(train) == len(stream) - SHARD and len(train.parts) > 2
    for boundary in train.starts[1:-1]:
        assert np.array_equal(train[boundary - 5: boundary + 5], stream[SHARD + boundary - 5: SHARD + boundary + 5])
    assert np.array_equal(train[3: 3 + 3 * SHARD], stream[SHARD + 3: SHARD + 3 + 3 * SHARD])  # across 3 shards
    # The same tokens in one file per split, as a --data_file dataset holds them: the same batches, bit for bit.
    plain = f"test_plain_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    os.makedirs(data.data_dir(plain))
    try:
        stream[SHARD:].tofile(os.path.join(data.data_dir(plain), "train.bin"))
        stream[:SHARD].tofile(os.path.join(data.data_dir(plain), "val.bin"))
        crossed = 0
        for split, step in [("train", s) for s in range(5)] + [("val", 0), ("val", 1)]:
            x, y = data.get_batch(split, step, 8, 32, 1337, sharded)
            x_plain, y_plain = data.get_batch(split, step, 8, 32, 1337, plain)
            assert torch.equal(x, x_plain) and torch.equal(y, y_plain)
            ix = np.random.default_rng([1337, 0 if split == "train" else 1, step]).integers(0, len(
                data.tokens(split, sharded)) - 33, size=8)
            crossed += sum(np.searchsorted(train.starts, i, "right") != np.searchsorted(train.starts, i + 32, "right")
                           for i in ix) if split == "train" else 0
        assert crossed > 0  # some windows were read from two shards
    finally:
        shutil.rmtree(data.data_dir(plain))
        for split in ("train", "val"):
            data._tokens.pop((plain, split), None)


def test_a_missing_library_is_one_line_and_training_needs_neither(sharded, monkeypatch):
    for name in ("pyarrow", "huggingface_hub"):  # an import of either fails, as where it is not installed
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "common.prepare")
    monkeypatch.delattr(sys.modules["common"], "prepare")
    with pytest.raises(SystemExit) as stop:
        data.main(["fineweb_edu"])
    assert stop.value.code == ("error: python -m common.data fineweb_edu needs huggingface_hub: "
                               "pip install -r requirements-data.txt (pyarrow, huggingface_hub)")
    assert data.prepare(sharded) is None and data.check_block_size(32, sharded) is None
    data._tokens.pop((sharded, "train"), None)  # read again, without either library
    assert data.get_batch("train", 0, 8, 32, 1337, sharded)[0].shape == (8, 32)


def test_training_asks_to_prepare_first(sharded, monkeypatch, tmp_path):
    first = "run python -m common.data fineweb_edu first (docs/data.md)"
    root = tmp_path / "data"
    os.makedirs(root / "fineweb_edu")
    monkeypatch.setattr(data, "DATA_ROOT", str(root))
    assert data.prepare("fineweb_edu") == f"--dataset fineweb_edu: not prepared: {first}"
    assert data.prepare("fineweb_edu", "input.txt").startswith("--data_file: --dataset fineweb_edu is prepared by")
    shutil.copytree(os.path.join(REPO, "data", sharded), root / "fineweb_edu", dirs_exist_ok=True)
    assert data.prepare("fineweb_edu") is None
    last = json.loads((root / "fineweb_edu" / data.MANIFEST).read_text())["shards"][-1]["file"]
    with open(root / "fineweb_edu" / last, "r+b") as f:
        f.truncate(2)
    assert data.prepare("fineweb_edu") == f"--dataset fineweb_edu: {root / 'fineweb_edu' / last} is missing or cut short: {first}"


def test_a_launch_on_a_partly_prepared_corpus_stops_at_once(sharded, one_thread):
    """The verdict comes through common.distributed's wait for the preparing rank (its limit is 2 hours) at once,
    as one line."""
    partial = f"test_partial_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    shutil.copytree(data.data_dir(sharded), data.data_dir(partial))
    try:
        path = pathlib.Path(data.data_dir(partial), data.MANIFEST)
        path.write_text(json.dumps(dict(json.loads(path.read_text()), complete=False)))
        error = the_one_error("ddp_train.py", None, TINY + ["--dataset", partial, "--max_iters", "1"])
    finally:
        shutil.rmtree(data.data_dir(partial))
    assert error == f"error: --dataset {partial}: only partly prepared: run python -m common.data {partial} first (docs/data.md)"


def test_ddp_on_sharded_data_equals_one_process(sharded, tmp_path, one_thread):
    """One parity row on the sharded corpus: ddp_train.py at 2 ranks against 1 process (tests/test_parity.py's
    tolerances); the first loss is recomputed from the model and the sharded batch, so the runs read these shards."""
    flags = PARITY + ["--max_iters", str(PARITY_STEPS), "--dataset", sharded]
    records = []
    for nproc, out in ((None, tmp_path / "one"), (2, tmp_path / "two")):
        result = launch("ddp_train.py", nproc, flags + ["--out_dir", str(out)], torchrun=False)
        assert result.returncode == 0, result.stderr[-3000:]
        records.append(run_record(str(out)))
    one, two = records
    assert len(two["loss"]) == PARITY_STEPS and [e[0] for e in two["eval"]] == [0, PARITY_STEPS]
    dloss, dnorm = differences(two, one)
    assert dloss <= TOL and dnorm <= NORM_TOL, (dloss, dnorm)
    config = GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True)
    with torch.no_grad():
        _, loss = GPT(config, seed=1337)(*data.get_batch("train", 0, 8, 32, 1337, sharded))
    assert abs(loss.item() - one["loss"][0]) <= TOL
