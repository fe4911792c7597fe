"""--init_from: OpenAI's GPT-2 weights, a step-0 checkpoint that every script shards its own way (common/pretrained.py).

No test reaches the network. A randomly initialised transformers GPT2LMHeadModel, saved in the hub's file layout
(models--openai-community--gpt2/snapshots/<commit>/, refs/main) under a temporary HF_HUB_CACHE, stands for OpenAI's
gpt2; HF_HUB_OFFLINE=1 is set for every test and every launch, and the in-process tests also refuse any connection.
The reference is transformers' own model on the very batch the script logs (common.data.get_batch), in fp32.
"""
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import huggingface_hub.constants
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import REPO, launch, read_metrics
from common import pretrained
from common.checkpoint import choose, config_mismatch
from common.config import gpt_config, parse_args
from common.data import GPT2_VOCAB, get_batch
from common.model import GPT

# A small GPT-2: 2 layers, 2 heads, 64 wide, 64 positions, GPT-2's vocabulary (the data's token ids need it)
SIZES = dict(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=GPT2_VOCAB)
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the snapshot refs/main names
# A launch's flags: 2 rows a rank, 32 positions; dropout 0 (GPT-2's config has 0.1: ours is a flag)
RUN = ["--batch_size", "4", "--block_size", "32", "--dropout", "0", "--tensorboard", "false", "--log_interval", "1",
       "--seed", "1337"]
TOL = 1e-5  # relative, on a loss: measured here 0 to 2e-7 (the same fp32 math, summed in other orders)


def refuse(*args, **kwargs):
    raise OSError("test_init_from.py: no network")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(the temporary hub cache, transformers' model saved in it as openai-community/gpt2). Every parameter gets
    random values, biases and LayerNorms included, so that a tensor left out or mapped to the wrong place shows."""
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**SIZES, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       attn_implementation="eager"))  # not the SDPA kernel ours calls
    model.loss_type = "ForCausalLM"  # named, as the class name does not tell transformers (it would warn)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        # Every row of wte given a share against ln_f's bias: each real token's logit about 10 below 0, as GPT-2's
        # logits sit well below 0. A padded token's logit of 0 then takes most of the probability, as it would there.
        model.transformer.wte.weight.add_(0.5)
        model.transformer.ln_f.bias.sub_(0.3)
    repo = root / "models--openai-community--gpt2"
    model.save_pretrained(repo / "snapshots" / COMMIT, safe_serialization=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root, model.eval()


@pytest.fixture(autouse=True)
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub read the variable when transformers imported it, before this: told here too (without it, a
    # download tries the network, and retries against the socket guard for 20 s)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def no_network(monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


def their_logits(model, x, vocab_size):
    """transformers' logits for x, with a logit of 0 for each padded token (a zero row of the tied head)."""
    with torch.no_grad():
        logits = model(x).logits  # (B, T, 50257)
    return F.pad(logits, (0, vocab_size - logits.size(-1)))  # (B, T, vocab_size)


def their_loss(model, x, y):
    """transformers' own loss: its model's cross-entropy of the targets y (x shifted by one, as get_batch gives)."""
    with torch.no_grad():
        return model(x, labels=y, shift_labels=y).loss.item()


def rel(ours, theirs):
    return abs(ours - theirs) / abs(theirs)


def test_the_mapping_pads_with_zero_rows_and_transposes_conv1d(hub, no_network):
    """The state dict every script is given: the Conv1D weights transposed, wpe cut to block_size, wte padded with
    zero rows and lm_head the same tensor; loaded into our GPT with the tanh GELU, it gives transformers' logits."""
    args = parse_args("ddp", None, ["--init_from", "gpt2", "--block_size", "32", "--vocab_size", "50304"])
    config = gpt_config(args)
    assert (config.n_layer, config.n_head, config.n_embd, config.vocab_size, config.gelu) == (2, 2, 64, 50304, "tanh")
    path, error = pretrained.weights_path("gpt2")
    assert error is None and path == os.path.join(hub[0], "models--openai-community--gpt2", "snapshots", COMMIT,
                                                  "model.safetensors")
    ckpt, error = pretrained.checkpoint(path, config)
    assert error is None and ckpt["step"] == 0 and ckpt["optimizer"] is None and ckpt["config"]["gelu"] == "tanh"
    state, theirs = ckpt["model"], hub[1].state_dict()
    wte = state["transformer.wte.weight"]
    assert state["lm_head.weight"] is wte and wte.shape == (50304, 64)
    assert torch.equal(wte[:GPT2_VOCAB], theirs["transformer.wte.weight"])
    assert torch.equal(wte[GPT2_VOCAB:], torch.zeros(50304 - GPT2_VOCAB, 64))
    assert torch.equal(state["transformer.wpe.weight"], theirs["transformer.wpe.weight"][:32])
    assert torch.equal(state["transformer.h.1.mlp.c_fc.weight"], theirs["transformer.h.1.mlp.c_fc.weight"].t())
    ours = GPT(config)
    ours.load_state_dict(state)
    x, y = get_batch("train", 0, 4, 32, 1337, "shakespeare")
    expected = their_logits(hub[1], x, 50304)
    with torch.no_grad():
        logits, loss = ours.eval()(x, y)
    assert ((logits - expected).abs().max() / expected.abs().max()).item() < TOL
    assert rel(loss.item(), F.cross_entropy(expected.view(-1, 50304), y.view(-1)).item()) < TOL


def test_sizes_come_from_the_weights_and_the_default_stays_exact(hub, no_network):
    args = parse_args("ddp", None, ["--init_from", "gpt2"])
    assert (args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size, args.bias) == (
        2, 2, 64, 64, GPT2_VOCAB, True)  # unpadded: the loss is GPT-2's own (pretrained.pad_rows)
    folder = os.path.join(hub[0], "models--openai-community--gpt2", "snapshots", COMMIT)
    assert vars(parse_args("ddp", None, ["--init_from", folder])) == {**vars(args), "init_from": folder}
    plain = parse_args("ddp", None, [])
    assert plain.init_from is None and gpt_config(plain).gelu == "exact"
    assert GPT(gpt_config(plain), device="meta").transformer.h[0].mlp.gelu.approximate == "none"
    assert GPT(gpt_config(args), device="meta").transformer.h[0].mlp.gelu.approximate == "tanh"
    # A checkpoint written before the field existed: the exact GELU, as before
    saved = {k: v for k, v in gpt_config(plain).__dict__.items() if k != "gelu"}
    assert config_mismatch(saved, plain) is None and config_mismatch(saved, args) is not None


def test_a_resume_wins_over_init_from_and_keeps_its_gelu(tmp_path, no_network):
    """--init_from starts a run; --resume (or a restart) continues it from its checkpoint, whose tanh GELU a run
    without --init_from refuses in one line."""
    flags = ["--max_iters", "4", "--out_dir", str(tmp_path)]
    args = parse_args("ddp", None, ["--init_from", "gpt2"] + flags)
    choice, ckpt = choose(args, restarted=False)
    assert choice["flag"] == "--init_from" and ckpt["step"] == 0 and ckpt["optimizer"] is None
    torch.save(dict(model={}, optimizer={}, step=2, config=gpt_config(args).__dict__), tmp_path / "ckpt.pt")
    assert choose(args, restarted=True)[0]["flag"] == "--resume"
    args.resume = True
    assert choose(args, restarted=False)[0]["flag"] == "--resume"
    sizes = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", "64", "--vocab_size", "50257"]
    plain = parse_args("ddp", None, sizes + flags + ["--resume"])
    assert choose(plain, restarted=False)[0]["error"].startswith("--init_from: the checkpoint")


REFUSED = [  # (strategy, flags after --init_from, the start of the one error line)
    ("ddp", ["gpt2", "--n_layer", "3"], "--n_layer: --init_from gpt2 has n_layer=2"),
    ("ddp", ["gpt2", "--n_embd", "128"], "--n_embd: --init_from gpt2 has n_embd=64"),
    ("tp", ["gpt2", "--n_head", "4"], "--n_head: --init_from gpt2 has n_head=2"),
    ("ddp", ["gpt2", "--bias", "false"], "--bias: --init_from gpt2 has bias=True"),
    ("fsdp", ["gpt2", "--block_size", "128"], "--block_size: at most 64 with --init_from gpt2"),
    ("ddp", ["gpt2", "--vocab_size", "50000"], "--vocab_size: at least 50257 with --init_from gpt2"),
    ("ep", ["gpt2"], "--init_from: OpenAI's GPT-2 is a dense GPT"),  # ep's default is 8 experts
    ("ddp", ["gpt2", "--max_iters", "0", "--eval_interval", "0"], "--max_iters: 0 takes no step"),
    ("ddp", ["gpt-3"], "--init_from: expected one of gpt2, gpt2-medium, gpt2-large, gpt2-xl or a folder"),
    # not cached, and HF_HUB_OFFLINE: huggingface_hub refuses to download, and says so in one line
    ("ddp", ["gpt2-xl"], "--init_from: gpt2-xl is not in the Hugging Face cache"),
]


@pytest.mark.parametrize("strategy,flags,error", REFUSED, ids=[" ".join(f) for _, f, _ in REFUSED])
def test_a_flag_against_the_weights_is_refused_in_one_line(strategy, flags, error, no_network, capsys,
                                                           monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # rank 0 prints
    with pytest.raises(SystemExit) as stop:
        parse_args(strategy, None, ["--init_from"] + flags)
    lines = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {error}"), lines


def test_a_run_without_init_from_never_imports_it():
    """A script's imports and its flags, in a fresh interpreter: common/pretrained.py stays unread."""
    code = ("import sys; import ddp_train; from common.config import parse_args; parse_args('ddp', None, []); "
            "print('common.pretrained' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr[-2000:]


def test_fsdp_evaluates_gpt2_at_max_iters_0_with_its_own_loss(hub, tmp_path):
    """The documented command, on 2 ranks of fsdp: --max_iters 0 evaluates the weights, unpadded, and exits 0; both
    splits' losses are transformers' own on the evaluation batch."""
    result = launch("fsdp_train.py", 2, ["--init_from", "gpt2", "--max_iters", "0", "--eval_iters", "1"] + RUN +
                    ["--out_dir", str(tmp_path)], timeout=120, torchrun=False)
    assert result.returncode == 0, result.stderr[-3000:]
    evaluation, summary = read_metrics(tmp_path)
    assert evaluation["step"] == 0 and summary["summary"]
    for split in ("train", "val"):
        x, y = get_batch(split, 0, 4, 32, 1337 + 1, "shakespeare")  # evaluation batches: seed + 1
        assert rel(evaluation[f"{split}_loss"], their_loss(hub[1], x, y)) < TOL, split
    assert not (tmp_path / "ckpt.pt").exists()  # nothing trained, nothing written


def test_tp_trains_from_gpt2_padded_with_the_loss_of_its_logits(hub, tmp_path):
    """2 ranks of tp (the vocabulary split in two, so padded to 50304): the first logged loss is the cross-entropy
    of transformers' logits with the 47 padded tokens' logits 0, which the zero rows give. It is not transformers'
    own loss: a padded token takes probability until training pushes it down (README)."""
    result = launch("tp_train.py", 2, ["--init_from", "gpt2", "--vocab_size", "50304", "--max_iters", "1",
                                       "--eval_interval", "0"] + RUN + ["--out_dir", str(tmp_path)],
                    timeout=120, torchrun=False)
    assert result.returncode == 0, result.stderr[-3000:]
    first = read_metrics(tmp_path)[0]
    x, y = get_batch("train", 0, 4, 32, 1337, "shakespeare")
    padded = F.cross_entropy(their_logits(hub[1], x, 50304).view(-1, 50304), y.view(-1)).item()
    assert first["step"] == 0 and rel(first["loss"], padded) < TOL
    assert padded > their_loss(hub[1], x, y) + 1  # here 14.29 against 11.20: the cost of padding
