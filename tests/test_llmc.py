"""llm.c's shards read in place (common/data.py): `--dataset PATH` names a folder of `*_train*.bin` and `*_val*.bin`
files as llm.c's dev/data/fineweb.py and modded-nanogpt's data/cached_fineweb10B.py leave them.

The shards are written here by write_datafile, a writer that follows llm.c's dev/data/data_common.py and shares no
code with the loader: a header of 256 int32 (magic 20240520, version 1, the token count), then the uint16 tokens.
Offline: nothing here opens a connection (a socket guard fails any), and one short run is the only launch.
"""
import math
import os
import socket

import numpy as np
import pytest
import torch

from conftest import TINY, launch, run_record
from common import data
from common.model import GPT, GPTConfig

EOT = 50256  # GPT-2's <|endoftext|>: llm.c puts it before each document, as our shards do
TRAIN_SHARDS = (300, 300, 250)  # tokens in fineweb_train_000001.bin, ...: a window of 33 often crosses two
VAL_TOKENS = 200


def write_datafile(path, toks):
    """llm.c's write_datafile for GPT-2 tokens: 256 int32 of header, then the tokens as uint16."""
    header = np.zeros(256, dtype=np.int32)
    header[0] = 20240520  # magic
    header[1] = 1  # version
    header[2] = len(toks)  # number of tokens after the 256*4 bytes of header
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(toks, dtype=np.uint16).tobytes())


def token_stream(n, seed):
    """n GPT-2 ids, documents of 1 to 60 tokens each starting with EOT; ids above 32,767 are common, so that a
    reader of signed int16 would be caught."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, EOT, size=n)
    starts = np.cumsum(rng.integers(1, 61, size=n))
    ids[starts[starts < n]] = EOT
    ids[0] = EOT
    return ids.astype(np.uint16)


def write_folder(folder, prefix="fineweb"):
    """A folder as modded-nanogpt's cached FineWeb lays it out (the first shard is the validation split), in small;
    returns each split's whole stream."""
    os.makedirs(folder, exist_ok=True)
    stream = token_stream(VAL_TOKENS + sum(TRAIN_SHARDS), seed=1)
    write_datafile(os.path.join(folder, f"{prefix}_val_000000.bin"), stream[:VAL_TOKENS])
    cuts = np.cumsum((VAL_TOKENS,) + TRAIN_SHARDS)
    for index, (start, stop) in enumerate(zip(cuts[:-1], cuts[1:]), start=1):
        write_datafile(os.path.join(folder, f"{prefix}_train_{index:06d}.bin"), stream[start:stop])
    return {"val": stream[:VAL_TOKENS], "train": stream[VAL_TOKENS:]}


def refuse(*args, **kwargs):
    raise AssertionError("a test tried to open a connection")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(data, "_tokens", {})  # the splits read by each test are its own


@pytest.fixture
def shards(tmp_path):
    """(the folder as --dataset takes it: an absolute path, the split streams)."""
    folder = str(tmp_path / "fineweb10B")
    return folder, write_folder(folder)


def test_the_constants_a_writer_needs():
    assert (data.LLMC_MAGIC, data.LLMC_VERSION, data.LLMC_HEADER_INTS) == (20240520, 1, 256)
    assert data.LLMC_HEADER_BYTES == 1024


def test_every_window_reads_the_written_tokens(shards):
    folder, streams = shards
    assert data.prepare(folder) is None
    for split, stream in streams.items():
        split_tokens = data.tokens(split, folder)
        assert len(split_tokens) == len(stream)
        assert np.array_equal(split_tokens[0:len(stream)], stream)
        for length in (1, 33):  # every start: 33 tokens cross a boundary from 33 starts before it
            for start in range(len(stream) - length + 1):
                assert np.array_equal(split_tokens[start:start + length], stream[start:start + length]), start


def test_get_batch_draws_the_documented_windows(shards):
    """get_batch's contract (docs/data.md): rng.integers(0, len(data) - block_size - 1, size=batch_size), seeded with
    (seed, split, step), x the windows and y the same shifted by one; some of them cross a shard boundary."""
    folder, streams = shards
    batch_size, block_size, seed = 8, 32, 1337
    boundaries = np.cumsum(TRAIN_SHARDS)[:-1]
    crossing = 0
    for split, split_id in (("train", 0), ("val", 1)):
        stream = streams[split].astype(np.int64)
        for step in range(20):
            x, y = data.get_batch(split, step, batch_size, block_size, seed, folder)
            rng = np.random.default_rng([seed, split_id, step])
            starts = rng.integers(0, len(stream) - block_size - 1, size=batch_size)
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (batch_size, block_size)
            assert np.array_equal(x.numpy(), np.stack([stream[i:i + block_size] for i in starts]))
            assert np.array_equal(y.numpy(), np.stack([stream[i + 1:i + 1 + block_size] for i in starts]))
            if split == "train":
                crossing += sum(((i < boundaries) & (boundaries <= i + block_size)).any() for i in starts)
    assert crossing > 0


def corrupt(path, how):
    """One shard spoiled as a user's file may be: another magic or version, cut short, or with bytes after its
    tokens; returns what the loader's line must say about it."""
    with open(path, "rb") as f:
        body = f.read()
    header = np.frombuffer(body[:1024], dtype=np.int32).copy()
    count = int(header[2])
    size = len(body)
    if how == "magic":
        header[0] = 20240801  # llm.c's Llama 3 shards: uint32 tokens
        body = header.tobytes() + body[1024:]
        said = "magic 20240801, not 20240520 (llm.c's shards of GPT-2 tokens)"
    elif how == "version":
        header[1] = 2
        body = header.tobytes() + body[1024:]
        said = "version 2, not 1 (llm.c's shards of GPT-2 tokens)"
    elif how == "short":
        body = body[:-2]
        said = f"{size - 2:,} bytes, but its header counts {count:,} tokens: {size:,} bytes with the header"
    elif how == "long":
        body = body + b"\0\0"
        said = f"{size + 2:,} bytes, but its header counts {count:,} tokens: {size:,} bytes with the header"
    else:  # "headless": one of our own headerless shards by mistake, smaller than a header
        body = body[1024:1024 + 600]
        said = "600 bytes, shorter than llm.c's 1024-byte header"
    with open(path, "wb") as f:
        f.write(body)
    return said


@pytest.mark.parametrize("how", ["magic", "version", "short", "long", "headless"])
def test_a_bad_shard_gives_one_line_naming_it(shards, how):
    folder, _ = shards
    path = os.path.join(folder, "fineweb_train_000002.bin")  # a shard in the middle: every header is read
    said = corrupt(path, how)
    assert data.prepare(folder) == f"--dataset {folder}: {path}: {said}"


def test_what_the_folder_must_hold(shards, tmp_path):
    folder, _ = shards
    assert data.prepare(folder, "input.txt") == (f"--data_file: --dataset {folder} holds llm.c's shards, read as "
                                                 f"they are, not tokenised from a text file")
    os.remove(os.path.join(folder, "fineweb_val_000000.bin"))
    assert data.prepare(folder) == f"--dataset {folder}: {folder} holds no llm.c val shards (*_val*.bin)"
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert data.prepare(empty) == (f"--dataset {empty}: no text at {empty}/input.txt; put a text file there, pass "
                                   f"--data_file PATH, or give the path of a folder of llm.c shards")


def test_the_ways_to_name_a_folder(tmp_path, monkeypatch):
    """A relative path from the current folder; a name under data/, a hub corpus's name too when its folder holds
    llm.c's shards and no manifest; llm.c's tinyshakespeare names (one file a split, no index)."""
    monkeypatch.setattr(data, "DATA_ROOT", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    names = {"./fineweb10B": "fineweb", "fineweb10B": "fineweb", "fineweb": "edu_fineweb"}
    folders = {"./fineweb10B": tmp_path / "fineweb10B", "fineweb10B": tmp_path / "data" / "fineweb10B",
               "fineweb": tmp_path / "data" / "fineweb"}
    for dataset, prefix in names.items():
        streams = write_folder(str(folders[dataset]), prefix)
        assert data.data_dir(dataset) in (dataset, str(folders[dataset]))
        assert data.prepare(dataset) is None and data.check_block_size(32, dataset) is None
        assert np.array_equal(data.tokens("train", dataset)[0:len(streams["train"])], streams["train"])
    single = tmp_path / "tinyshakespeare"
    os.makedirs(single)
    stream = token_stream(100, seed=2)
    write_datafile(single / "tiny_shakespeare_val.bin", stream[:40])
    write_datafile(single / "tiny_shakespeare_train.bin", stream[40:])
    assert data.prepare(str(single)) is None
    assert np.array_equal(data.tokens("val", str(single))[0:40], stream[:40])
    assert np.array_equal(data.tokens("train", str(single))[0:60], stream[40:])
    assert data.check_block_size(39, str(single)) == (f"--block_size: 39 is too large for the val split of {single} "
                                                      f"(40 tokens)")


def test_a_run_trains_on_the_folder(shards, tmp_path, monkeypatch):
    """ddp_train.py --dataset <folder>, one process, 2 steps: its first loss is the model's on the folder's batch."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    folder, _ = shards
    out = tmp_path / "out"
    result = launch("ddp_train.py", None, TINY + ["--seed", "1337", "--max_iters", "2", "--dataset", folder,
                                                  "--out_dir", str(out)], torchrun=False)
    assert result.returncode == 0, result.stderr[-3000:]
    record = run_record(str(out))
    assert len(record["loss"]) == 2 and all(math.isfinite(v) for v in record["loss"]), record
    config = GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True)
    with torch.no_grad():
        _, loss = GPT(config, seed=1337)(*data.get_batch("train", 0, 8, 32, 1337, folder))
    assert abs(loss.item() - record["loss"][0]) <= 1e-5
