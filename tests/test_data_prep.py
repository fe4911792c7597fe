"""The hub's corpora (common/prepare.py) and the loader that spans their shards (common/data.py).

A small corpus is written in the hub's own file format (parquet files with a `text` column, several row groups each)
and prepared through the same code path as the hub's, with only the two hub calls (list_files, download) replaced.
No test reaches the network: HF_HUB_OFFLINE=1, and a socket guard fails any connection. The expected tokens are
recomputed here with tiktoken: <|endoftext|> before each document, a literal "<|endoftext|>" in a text read as text,
a null text an empty document.
"""
import ast
import hashlib
import json
import math
import os
import pathlib
import runpy
import shutil
import signal
import socket
import sys
import time
import traceback
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
    None,  # a null text (a missing value in the parquet column): an empty document too
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
    return [[encoding.eot_token] + (encoding.encode_ordinary(text) if text is not None else []) for text in TEXTS]


def fake_commit(revision):
    """The commit the fake hub resolves a branch or tag to (a commit resolves to itself)."""
    return revision if prepare.is_commit(revision) else hashlib.sha1(revision.encode()).hexdigest()


def fake_hub(patch, corpus, asked=None, listed=None, resolved=None):
    """The hub's three calls answered from the corpus folder, recording what was asked."""
    def resolve(source):
        (resolved if resolved is not None else []).append(source.revision)
        return fake_commit(source.revision)

    def list_files(source):
        (listed if listed is not None else []).append((source.repo, source.revision))
        return list(NAMES)

    def download(source, name):
        (asked if asked is not None else []).append((source.repo, source.revision, name))
        return os.path.join(corpus, name)
    patch.setattr(prepare, "resolve", resolve)
    patch.setattr(prepare, "list_files", list_files)
    patch.setattr(prepare, "download", download)


def run_prepare(corpus, out, workers, dataset="fineweb_edu", revision=None, flags=()):
    """prepare.main on the corpus, with the hub answered from the corpus folder; the revision (the pinned one, or
    --revision) resolved once, and its commit listed and downloaded. Returns the names downloaded, in order."""
    asked, listed, resolved = [], [], []
    with pytest.MonkeyPatch.context() as patch:
        fake_hub(patch, corpus, asked, listed, resolved)
        code = prepare.main([dataset, "--data_dir", str(out), "--workers", str(workers), "--shard_tokens",
                             str(SHARD)] + (["--revision", revision] if revision else []) + list(flags))
    source = prepare.SOURCES[dataset]
    revision = revision or source.revision
    commit = fake_commit(revision)
    assert code == 0 and resolved == [revision] and listed == [(source.repo, commit)]
    assert set(asked) <= {(source.repo, commit, name) for name in NAMES}
    return [name for _, _, name in asked]


def folder_bytes(folder):
    """{name: bytes} of every file in folder."""
    return {name: pathlib.Path(folder, name).read_bytes() for name in sorted(os.listdir(folder))}


def split_ids(folder, split):
    manifest = json.loads(pathlib.Path(folder, data.MANIFEST).read_text())
    files = [s["file"] for s in manifest["shards"] if s["split"] == split]
    return np.concatenate([np.fromfile(os.path.join(folder, f), dtype=np.uint16) for f in files])


def refuse(*args, **kwargs):
    raise AssertionError("a network call in an offline test")


def first_task_last(task):
    """prepare.tokenise, the pool's task, with the corpus's first task held until the second is done: the results
    come out of order whatever the load, and only taking them in task order gives the corpus order."""
    marks = pathlib.Path(os.environ["TEST_DATA_PREP_MARKS"])
    if task[2] == 0:  # the first task (its first document is the corpus's first)
        deadline = time.monotonic() + 30
        while not (marks / "second").exists():
            assert time.monotonic() < deadline, "the second task never finished"
            time.sleep(0.005)
        (marks / "first").touch()  # after the second: the disorder happened
    result = TOKENISE(task)
    if task[2] == ROW_GROUP:  # the second task
        (marks / "second").touch()
    return result


TOKENISE = prepare.tokenise


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


def test_each_document_is_its_eot_then_its_text(sharded, corpus):
    assert pq.read_table(os.path.join(corpus, NAMES[0])).column("text").null_count == 1  # a real null is read
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
    os.makedirs(tmp_path / "marks")
    with pytest.MonkeyPatch.context() as patch:  # --parquet_dir: the files from a folder, not the hub
        patch.setattr(prepare, "list_files", None)
        patch.setattr(prepare, "download", None)
        # The first task finishes after the second (the workers, forked, inherit both patches).
        patch.setattr(prepare, "tokenise", first_task_last)
        patch.setenv("TEST_DATA_PREP_MARKS", str(tmp_path / "marks"))
        assert prepare.main(["fineweb_edu", "--data_dir", str(tmp_path / "local"), "--workers", "2",
                             "--shard_tokens", str(SHARD), "--parquet_dir", str(corpus)]) == 0
    assert sorted(os.listdir(tmp_path / "marks")) == ["first", "second"]
    two = folder_bytes(data.data_dir(sharded))
    assert folder_bytes(tmp_path / "one") == two
    assert folder_bytes(tmp_path / "local") == two


def test_openwebtext_val_is_nanogpts_split(corpus, tmp_path):
    # datasets 5.2.0's Dataset.train_test_split(test_size=0.0005, seed=2357) on 20,000 rows, as nanoGPT calls it
    # (recorded: datasets is not a dependency)
    assert np.flatnonzero(prepare.val_documents(20000)).tolist() == [
        1602, 3666, 3969, 6134, 7518, 8851, 13717, 14082, 14140, 19177]
    run_prepare(corpus, tmp_path, workers=2, dataset="openwebtext")
    # The documented rule, written here rather than read from prepare.val_documents, which is under test: the first
    # ceil(0.0005 n) entries of default_rng(2357).permutation(n); for these 41 documents, document 18 (recorded).
    val_docs = set(np.random.default_rng(2357).permutation(len(TEXTS))[:math.ceil(0.0005 * len(TEXTS))].tolist())
    assert len(TEXTS) == 41 and val_docs == {18}
    docs = documents()
    expected = {split: [t for k, doc in enumerate(docs) if (k in val_docs) == (split == "val") for t in doc]
                for split in ("train", "val")}
    for split in ("train", "val"):  # each split's documents in the corpus order
        assert split_ids(str(tmp_path), split).tolist() == expected[split]


# Where the prepare is killed (SIGKILL): in the download of the second file (FineWeb-Edu: once a shard is named;
# OpenWebText downloads every file before it tokenises); mid-shard, after a task's tokens went to the partial file of
# the third shard or a later one; after the third shard is published but before the manifest names it; after the
# manifest names it; before the last manifest, the one saying complete; and (OpenWebText, whose val split is written
# beside the train one, the size of the whole run) after every train shard, before the val shard is published.
KILL_POINTS = [(dataset, point) for dataset in ("fineweb_edu", "openwebtext")
               for point in ("mid_download", "mid_shard", "shard_before_manifest", "after_manifest", "before_complete")]
KILL_POINTS += [("openwebtext", "before_val"), ("openwebtext", "val_grown")]
OWT_VAL = 0.1  # the val share of the killed OpenWebText runs: 5 documents, 4 shards, written among train's


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(point):
    """Hooks prepare (in the forked child only) to die at `point` (mid_download: in killed_prepare's download)."""
    if point == "mid_shard":
        add = prepare.Stream.add

        def add_then_die(self, *args):
            add(self, *args)
            if self.index >= 2 and self.entry is not None and self.entry["tokens"] > 0:
                die()
        prepare.Stream.add = add_then_die
    elif point == "val_grown":  # the val split's partial shard longer than the manifest records
        add = prepare.Stream.add

        def add_then_die(self, *args):
            add(self, *args)
            recorded = self.manifest["progress"].get("val", {}).get("partial")
            if self.stream == "val" and recorded and self.entry and self.entry["tokens"] > recorded["tokens"]:
                die()
        prepare.Stream.add = add_then_die
    elif point == "before_val":
        finish = prepare.Stream.finish

        def die_before_val(self):
            if self.stream == "val":
                die()
            finish(self)
        prepare.Stream.finish = die_before_val
    elif point != "mid_download":
        write = prepare.write_manifest

        def write_or_die(folder, manifest):
            if point == "before_complete" and manifest["complete"]:
                die()
            if point == "shard_before_manifest" and len(manifest["shards"]) == 3:
                die()  # the shard is published: data.publish came first
            write(folder, manifest)
            if point == "after_manifest" and len(manifest["shards"]) == 3:
                die()
        prepare.write_manifest = write_or_die


def killed_prepare(corpus, out, dataset, point):
    """The wait status of prepare.main run in a forked child (this process's modules: no import to wait for) that
    kills itself at `point`; its pool's workers, in its session, are killed after it."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(60)  # a point never reached ends the child by SIGALRM, not SIGKILL

            def download(source, name):  # mid_download: the second file's (FineWeb-Edu: once a shard is named)
                while point == "mid_download" and name == NAMES[1]:
                    if dataset == "openwebtext" or (out / data.MANIFEST).exists():
                        die()
                    time.sleep(0.005)
                return os.path.join(corpus, name)
            prepare.NANOGPT_TEST_SIZE = OWT_VAL
            prepare.resolve = lambda source: fake_commit(source.revision)
            prepare.list_files = lambda source: list(NAMES)
            prepare.download = download
            kill_at(point)
            prepare.main([dataset, "--data_dir", str(out), "--workers", "2", "--shard_tokens", str(SHARD)])
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(70)  # never back into pytest
    try:
        return os.waitpid(pid, 0)[1]
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def owt(corpus, tmp_path_factory):
    """The corpus prepared, never killed, as openwebtext: its bytes."""
    folder = tmp_path_factory.mktemp("owt")
    with pytest.MonkeyPatch.context() as patch:
        go_offline(patch)
        patch.setattr(prepare, "NANOGPT_TEST_SIZE", OWT_VAL)
        run_prepare(corpus, folder, workers=2, dataset="openwebtext")
    manifest = json.loads(pathlib.Path(folder, data.MANIFEST).read_text())
    assert len([s for s in manifest["shards"] if s["split"] == "val"]) >= 2
    return folder_bytes(folder)


@pytest.mark.parametrize("dataset,point", KILL_POINTS)
def test_a_prepare_killed_at_any_point_resumes_to_the_same_bytes(sharded, owt, corpus, tmp_path, capfd, dataset,
                                                                 point):
    """The rerun ends with the bytes of a run never killed, and tokenises again only the documents from where the
    last published shard ends (the document it ends in included): the val split's partial shard of OpenWebText is
    continued from where the manifest recorded it. A file wholly before that document is not downloaded again."""
    out = tmp_path / "out"
    status = killed_prepare(corpus, out, dataset, point)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (status, capfd.readouterr().err[-2000:])
    final = folder_bytes(data.data_dir(sharded)) if dataset == "fineweb_edu" else owt
    partials = [name for name in os.listdir(out) if ".partial." in name]
    shards = {name for name in os.listdir(out) if name.endswith(".bin")}
    all_shards = {name for name in final if name.endswith(".bin")}
    if point == "mid_download" and dataset == "openwebtext":  # before any shard: nothing to keep
        assert not (out / data.MANIFEST).exists() and not shards
        named, restart = set(), 0
    else:
        manifest = json.loads((out / data.MANIFEST).read_text())
        named = {shard["file"] for shard in manifest["shards"]}
        assert not manifest["complete"] and named
        restart = max(shard["end"][0] for shard in manifest["shards"])
    for name in shards:  # each shard on disk, named or not, is complete and final
        assert (out / name).read_bytes() == final[name], name
    if point == "mid_download":  # any moment of the main thread: a shard may be published and not yet named
        assert len(partials) <= 1 + (dataset == "openwebtext") and shards >= named
        assert len(shards) <= len(named) + 1
    elif point == "mid_shard":
        assert len(named) >= 2 and shards == named
        assert any(os.path.getsize(out / name) > 0 for name in partials)  # the shard it was writing
    elif point == "shard_before_manifest":
        assert len(named) == 2 and shards == named | {"train_000002.bin"}
    elif point == "after_manifest":
        assert len(named) == 3 and shards == named
    elif point == "before_complete":  # every shard named
        assert partials == [] and shards == named == all_shards
    elif point == "before_val":  # every train shard named, the val split's last shard in its partial file
        last = max(name for name in all_shards if name.startswith("val_"))
        assert shards == named == all_shards - {last} and partials == [f"{last}.partial.{socket.gethostname()}"]
    elif point == "val_grown":
        assert len(partials) == 2  # the train and val shards being written, the val one longer than recorded
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepare, "NANOGPT_TEST_SIZE", OWT_VAL)
        downloaded = run_prepare(corpus, out, workers=2, dataset=dataset)
    printed = capfd.readouterr().out
    if named:
        assert f"resuming after {len(named)} published shards, at document " in printed
        at = int(printed.split(", at document ")[1].split("\n")[0].replace(",", ""))
        assert at >= restart  # no further back than the end of the last published shard
        restart = at
    redone = int(printed.split(" tokenised ")[1].split(" tokens")[0].replace(",", ""))
    assert redone == sum(len(doc) for doc in documents()[restart:])  # the documents from there on, only
    # The documents before each file's end (write_corpus), recorded in the manifest once its footer is read
    ends = (len(TEXTS) // 2, len(TEXTS))
    assert downloaded == [name for name, end in zip(NAMES, ends) if not named or end > restart], restart
    assert folder_bytes(out) == final  # the partial file of the killed run removed, too


def test_a_branch_that_moved_stops_the_rerun_with_one_line(corpus, tmp_path):
    """A branch or tag is resolved to its commit once and recorded; a rerun (or another node) that finds the branch
    at another commit stops with one line, and goes on with --revision set to the recorded commit."""
    out = tmp_path / "moved"
    status = killed_prepare(corpus, out, "openwebtext", "after_manifest")
    assert os.WIFSIGNALED(status)
    manifest = json.loads((out / data.MANIFEST).read_text())
    branch = prepare.SOURCES["openwebtext"].revision
    assert manifest["revision"] == branch and manifest["commit"] == fake_commit(branch)
    before = folder_bytes(out)
    moved = "f" * 40
    with pytest.MonkeyPatch.context() as patch:
        fake_hub(patch, corpus)
        patch.setattr(prepare, "resolve", lambda source: moved)
        with pytest.raises(SystemExit) as stop:
            prepare.main(["openwebtext", "--data_dir", str(out), "--workers", "1", "--shard_tokens", str(SHARD)])
    assert stop.value.code == (f"error: openwebtext: Skylion007/openwebtext@{branch} is commit {moved} now, but "
                               f"{out} holds shards of commit {manifest['commit']}: pass --revision "
                               f"{manifest['commit']} to finish it, or delete the folder to prepare the new one")
    assert folder_bytes(out) == before
    run_prepare(corpus, out, workers=1, dataset="openwebtext", revision=manifest["commit"])
    assert json.loads((out / data.MANIFEST).read_text())["complete"]


def test_a_prepare_refuses_to_mix_sources_and_reads_revision(sharded, corpus, tmp_path):
    """--revision is the revision listed, downloaded and recorded; a folder prepared from one source (dataset,
    repository, revision, files, --shard_tokens) refuses another, with one line, and is left as it was."""
    out = tmp_path / "rev"
    run_prepare(corpus, out, workers=1, revision="other-revision")
    final = folder_bytes(data.data_dir(sharded))
    prepared = folder_bytes(out)
    manifest = json.loads(prepared.pop(data.MANIFEST))
    assert manifest["revision"] == "other-revision" and manifest["complete"]
    assert prepared == {name: b for name, b in final.items() if name != data.MANIFEST}  # the same tokens
    prepared = folder_bytes(out)
    refusal = (f"error: {{}}: {out} holds shards of another source, --shard_tokens or --format (its "
               f"{data.MANIFEST}); delete the folder, or pass the flags it was prepared with")
    pinned, recorded = prepare.SOURCES["fineweb_edu"].revision, fake_commit("other-revision")
    moved = (f"error: fineweb_edu: HuggingFaceFW/fineweb-edu@{pinned} is commit {pinned} now, but {out} holds "
             f"shards of commit {recorded}: pass --revision {recorded} to finish it, or delete the folder to "
             f"prepare the new one")
    for dataset, flags, names, line in [
            ("fineweb_edu", [], NAMES, moved),  # the pinned revision: another commit
            ("fineweb_edu", ["--revision", "other-revision", "--shard_tokens", "32"], NAMES, refusal),
            ("fineweb_edu", ["--revision", "other-revision", "--format", "llmc"], NAMES, refusal),
            ("fineweb_edu", ["--revision", "other-revision"], NAMES[:1], refusal),  # other files
            ("fineweb", ["--revision", "other-revision"], NAMES, refusal)]:  # another repository
        with pytest.MonkeyPatch.context() as patch:
            fake_hub(patch, corpus)
            patch.setattr(prepare, "list_files", lambda source: list(names))
            with pytest.raises(SystemExit) as stop:
                prepare.main([dataset, "--data_dir", str(out), "--workers", "1", "--shard_tokens", str(SHARD)]
                             + flags)
        assert stop.value.code == line.format(dataset), flags
        assert folder_bytes(out) == prepared


def test_llmc_format_shards_hold_the_same_tokens_behind_llmcs_header(sharded, corpus, tmp_path):
    """--format llmc: each shard is llm.c's write_datafile output (256 int32: magic 20240520, version 1, the token
    count, zeros; then the uint16 tokens), named <dataset>_<split>_<index>.bin, with the raw shards' tokens; the
    manifest records the format, and --verify checks every shard's SHA-256."""
    run_prepare(corpus, tmp_path / "llmc", workers=2, flags=["--format", "llmc"])
    raw = folder_bytes(data.data_dir(sharded))
    written = folder_bytes(tmp_path / "llmc")
    manifest = json.loads(written[data.MANIFEST])
    assert manifest["format"] == "llmc"
    shards = sorted(name for name in raw if name.endswith(".bin"))
    assert sorted(name for name in written if name.endswith(".bin")) == [f"fineweb_edu_{name}" for name in shards]
    for name in shards:
        header = np.frombuffer(written[f"fineweb_edu_{name}"][:1024], dtype="<i4")
        tokens = len(raw[name]) // 2
        assert header[:3].tolist() == [20240520, 1, tokens] and not header[3:].any()
        assert written[f"fineweb_edu_{name}"][1024:] == raw[name]
    folder = str(tmp_path / "llmc")  # a path: --dataset reads it where it is
    assert data.prepare(folder) is None
    for split in ("train", "val"):  # what training reads: the same tokens as from the raw shards
        assert np.array_equal(data.tokens(split, folder)[0:len(data.tokens(split, sharded))],
                              data.tokens(split, sharded)[0:len(data.tokens(split, sharded))])
        assert len(data.tokens(split, folder)) == len(data.tokens(split, sharded))
        data._tokens.pop((folder, split), None)
    assert prepare.main(["fineweb_edu", "--data_dir", str(tmp_path / "llmc"), "--verify"]) == 0
    with open(tmp_path / "llmc" / f"fineweb_edu_{shards[3]}", "r+b") as f:
        f.seek(1030)
        f.write(b"\x00")  # one byte of a token changed
    with pytest.raises(SystemExit) as stop:
        prepare.main(["fineweb_edu", "--data_dir", str(tmp_path / "llmc"), "--verify"])
    assert stop.value.code == (f"error: fineweb_edu: {tmp_path / 'llmc' / f'fineweb_edu_{shards[3]}'} is missing, "
                               f"or differs from its manifest's SHA-256")


def test_verify_prints_the_manifests_digest(sharded, capfd):
    """Two folders hold the same shards when --verify passes on both and prints the same digest: the manifest's,
    which names every shard's SHA-256."""
    folder = data.data_dir(sharded)
    manifest = json.loads(pathlib.Path(folder, data.MANIFEST).read_text())
    for shard in manifest["shards"]:
        assert shard["sha256"] == hashlib.sha256(pathlib.Path(folder, shard["file"]).read_bytes()).hexdigest()
    capfd.readouterr()
    assert prepare.main(["fineweb_edu", "--data_dir", folder, "--verify"]) == 0
    digest = hashlib.sha256(pathlib.Path(folder, data.MANIFEST).read_bytes()).hexdigest()
    assert capfd.readouterr().out == (f"fineweb_edu: {len(manifest['shards'])} shards match "
                                      f"{os.path.join(folder, data.MANIFEST)}, whose SHA-256 is {digest}\n")


def test_progress_lines_give_the_share_done_and_the_time_left(corpus, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(prepare, "PROGRESS_S", -1.0)  # a line after every task
    run_prepare(corpus, tmp_path / "progress", workers=1)
    lines = [line for line in capfd.readouterr().out.splitlines() if "% of the files" in line]
    shares = [float(line.split(": ")[1].split("%")[0]) for line in lines]
    # 2 files of 20 and 21 documents, row groups of 4: the share at each task's end, by file then row group
    expected = [100 * (k + (g + 1) / groups) / 2 for k, groups in enumerate((5, 6)) for g in range(groups)]
    assert shares == pytest.approx([round(e, 1) for e in expected], abs=0.051)
    assert all(", about " in line and line.endswith(" min left") for line in lines[1:])


def test_each_failure_says_whether_a_rerun_fixes_it(tmp_path):
    import concurrent.futures.process
    assert prepare.failure(concurrent.futures.process.BrokenProcessPool("x")).endswith(
        "run again, with fewer --workers if memory ran out, to resume")
    full = OSError(28, "No space left on device")
    assert prepare.failure(full) == ("the disk is full ([Errno 28] No space left on device); free some "
                                     "(docs/data.md: Disk) and run again to resume")
    assert prepare.failure(ConnectionError("reset")).endswith("run again to resume, once the cause is fixed")
    assert "delete it from huggingface_hub's cache" in prepare.failure(pa.ArrowInvalid("bad footer"))
    assert prepare.failure(KeyError("text")).endswith("running again will not fix this")


def test_a_second_prepare_of_the_same_folder_stops_with_one_line(corpus, tmp_path):
    import fcntl
    os.makedirs(tmp_path / "locked")
    pid = os.fork()
    if pid == 0:  # another process holds the folder's lock
        with open(tmp_path / "locked" / "prepare.lock", "w") as lock:
            fcntl.lockf(lock, fcntl.LOCK_EX)
            (tmp_path / "held").touch()
            time.sleep(30)
        os._exit(0)
    try:
        while not (tmp_path / "held").exists():
            time.sleep(0.01)
        with pytest.MonkeyPatch.context() as patch:
            fake_hub(patch, corpus)
            with pytest.raises(SystemExit) as stop:
                prepare.main(["fineweb_edu", "--data_dir", str(tmp_path / "locked"), "--workers", "1"])
        assert stop.value.code == (f"error: fineweb_edu: another python -m common.prepare is writing "
                                   f"{tmp_path / 'locked'}: wait for it to end")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_missing_or_short_shard_is_written_again(sharded, corpus, tmp_path, capfd):
    """A complete folder with a shard deleted, or cut short, resumes from that shard: the rest are written again,
    with the same bytes."""
    final = folder_bytes(data.data_dir(sharded))
    out = tmp_path / "cut"
    shutil.copytree(data.data_dir(sharded), out)
    names = [s["file"] for s in json.loads(final[data.MANIFEST])["shards"]]
    os.remove(out / names[5])
    capfd.readouterr()
    run_prepare(corpus, out, workers=2)
    assert "resuming after 5 published shards" in capfd.readouterr().out
    assert folder_bytes(out) == final
    with open(out / names[2], "r+b") as f:
        f.truncate(SHARD)  # half its tokens
    run_prepare(corpus, out, workers=2)
    assert "resuming after 2 published shards" in capfd.readouterr().out
    assert folder_bytes(out) == final


def test_the_loader_reads_a_window_across_shards(sharded, tmp_path):
    stream = np.array([t for doc in documents() for t in doc], dtype=np.uint16)
    train = data.tokens("train", sharded)
    assert isinstance(train, data.Shards) and all(isinstance(part, np.memmap) for part in train.parts)
    assert len(train) == len(stream) - SHARD and len(train.parts) > 2
    for boundary in train.starts[1:-1]:  # the last boundary is one token from the end: the last shard holds one
        stop = min(boundary + 5, len(train))
        assert np.array_equal(train[boundary - 5: stop], stream[SHARD + boundary - 5: SHARD + stop])
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


def _die_in_worker(task):
    """A tokenise that kills the worker running it (module level: the pool sends it to the worker by name)."""
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_that_dies_ends_the_prepare_at_once_with_one_line(corpus, tmp_path, monkeypatch):
    """A tokenising worker killed mid-task (as the OOM killer kills it: SIGKILL) ends the prepare within seconds, with
    one error line and a non-zero exit, where a multiprocessing.Pool waits for the dead worker's result forever. The
    workers are forks of this process: each runs _die_in_worker as its tokenise."""
    def too_long(signum, frame):
        raise TimeoutError("the prepare still waits for its dead worker after 60 s")
    monkeypatch.setattr(prepare, "tokenise", _die_in_worker)
    fake_hub(monkeypatch, corpus)
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(60)
    started = time.monotonic()
    try:
        with pytest.raises(SystemExit) as stop:
            prepare.main(["fineweb_edu", "--data_dir", str(tmp_path / "out"), "--workers", "2", "--shard_tokens",
                          str(SHARD)])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 30
    assert str(stop.value.code) == ("error: fineweb_edu: a tokenising worker died (killed: out of memory?); run "
                                    "again, with fewer --workers if memory ran out, to resume")
    assert "\n" not in str(stop.value.code)


def test_the_loader_never_imports_the_preparer_and_the_old_spelling_runs_it(monkeypatch):
    """common/data.py imports common.prepare nowhere (no import circle: training never loads the preparer's libraries),
    and `python -m common.data <dataset> [flags]`, the older spelling, runs `python -m common.prepare` with the same
    arguments in a process of its own and returns its exit status."""
    tree = ast.parse(open(os.path.join(REPO, "common", "data.py")).read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "common"
                for alias in node.names}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "prepare" not in imported and "common.prepare" not in imported, imported
    called = []
    monkeypatch.setattr(data.subprocess, "call", lambda command: called.append(command) or 3)
    assert data.main(["fineweb_edu", "--workers", "2"]) == 3
    assert called == [[sys.executable, "-m", "common.prepare", "fineweb_edu", "--workers", "2"]]


def test_a_missing_library_is_one_line_and_training_needs_neither(sharded, monkeypatch):
    installed = {name: sys.modules[name] for name in ("pyarrow", "huggingface_hub")}
    for name in installed:  # an import of either fails, as where it is not installed
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "common.prepare")  # run below as `python -m` runs it, from its source
    monkeypatch.setattr(sys, "argv", ["prepare.py", "fineweb_edu"])
    with pytest.raises(SystemExit) as stop:  # python -m common.prepare fineweb_edu, in this process
        runpy.run_module("common.prepare", run_name="__main__")
    assert stop.value.code == ("error: python -m common.prepare fineweb_edu needs huggingface_hub: "
                               "pip install -r requirements-data.txt (pyarrow, huggingface_hub)")
    monkeypatch.setitem(sys.modules, "resource", None)  # Windows: no resource module
    for name, module in installed.items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(SystemExit) as stop:
        runpy.run_module("common.prepare", run_name="__main__")
    assert stop.value.code == ("error: python -m common.prepare fineweb_edu needs Python's resource module, which "
                               "Windows lacks: it runs on Linux and macOS (on Windows: in WSL)")
    assert data.prepare(sharded) is None and data.check_block_size(32, sharded) is None
    data._tokens.pop((sharded, "train"), None)  # read again, without either library
    assert data.get_batch("train", 0, 8, 32, 1337, sharded)[0].shape == (8, 32)


def test_training_asks_to_prepare_first(sharded, monkeypatch, tmp_path):
    first = "run python -m common.prepare fineweb_edu first (docs/data.md)"
    root = tmp_path / "data"
    os.makedirs(root / "fineweb_edu")
    monkeypatch.setattr(data, "DATA_ROOT", str(root))
    assert data.prepare("fineweb_edu") == f"--dataset fineweb_edu: not prepared: {first}"
    assert data.prepare("fineweb_edu", "input.txt").startswith("--data_file: --dataset fineweb_edu is prepared by")
    shutil.copytree(os.path.join(REPO, "data", sharded), root / "fineweb_edu", dirs_exist_ok=True)
    assert data.prepare("fineweb_edu") is None
    last = json.loads((root / "fineweb_edu" / data.MANIFEST).read_text())["shards"][-1]["file"]
    with open(root / "fineweb_edu" / last, "r+b") as f:
        f.truncate(os.path.getsize(root / "fineweb_edu" / last) - 2)  # one token short (the last shard holds one)
    assert data.prepare("fineweb_edu") == (f"--dataset fineweb_edu: {root / 'fineweb_edu' / last} is missing or cut "
                                           f"short: {first}")


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
    assert error == (f"error: --dataset {partial}: only partly prepared: run python -m common.prepare {partial} first "
                     f"(docs/data.md)")


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
    for record in records:  # both runs whole and finite, whatever differences does: a max over pairs of floats lets
        # a NaN after the first through, and a zip of lists of different lengths compares the shorter only
        assert len(record["loss"]) == len(record["grad_norm"]) == PARITY_STEPS, record
        assert [e[0] for e in record["eval"]] == [0, PARITY_STEPS], record
        values = record["loss"] + record["grad_norm"] + [loss for e in record["eval"] for loss in e[1:]]
        assert all(math.isfinite(v) for v in values), record
    dloss, dnorm = differences(two, one)
    assert dloss <= TOL and dnorm <= NORM_TOL, (dloss, dnorm)
    config = GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True)
    with torch.no_grad():
        _, loss = GPT(config, seed=1337)(*data.get_batch("train", 0, 8, 32, 1337, sharded))
    assert abs(loss.item() - one["loss"][0]) <= TOL
