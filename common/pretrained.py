"""--init_from: OpenAI's GPT-2 (gpt2, gpt2-medium, gpt2-large, gpt2-xl) as a step-0 checkpoint.

The weights come from the Hugging Face hub's cache, as huggingface_hub lays it out
(models--openai-community--gpt2/snapshots/<commit>/, refs/main naming the commit), downloaded there
by huggingface_hub when it is installed and they are missing; or from a folder holding config.json
and model.safetensors (or pytorch_model.bin), read offline. They become our GPT's state dict as
nanoGPT's from_pretrained maps them, and each script shards that dict as it shards a checkpoint's.
Only a run given --init_from imports this file.
"""
import json
import os

import torch

from common.model import GPT

# The names --init_from takes, and the hub repositories that hold them
REPOS = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large",
                                                          "gpt2-xl")}
WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # in a folder, the first one there
# GPT-2's Conv1D layers keep their weights as (in, out): nn.Linear's (out, in) is the transpose
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# What a GPT-2 file may hold that our GPT has not: the causal mask's buffers (the attention is
# causal anyway) and the head, which is wte (tied)
IGNORED = (".attn.bias", ".attn.masked_bias", "lm_head.weight")
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # GPT-2's activation, as transformers names it
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # safetensors'


def hub_cache():
    """Where huggingface_hub keeps what it downloads, by its own rules: $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (XDG_CACHE_HOME: ~/.cache)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    home = os.environ.get("HF_HOME") or os.path.join(cache, "huggingface")
    return os.path.join(home, "hub")


def weights_in(folder):
    """The weights file in `folder` beside its config.json, or None."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return None
    for name in WEIGHTS:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def cached(name):
    """The snapshot folder of `name` in the hub's cache that holds config.json and the weights, or
    None. Under the repository's folder, or under transformers' older one (models--gpt2)."""
    for repo in (REPOS[name], name):
        root = os.path.join(hub_cache(), "models--" + repo.replace("/", "--"))
        try:
            with open(os.path.join(root, "refs", "main")) as f:
                commit = f.read().strip()
        except OSError:
            continue
        folder = os.path.join(root, "snapshots", commit)
        if weights_in(folder) is not None:
            return folder
    return None


def download(name):
    """(the snapshot folder huggingface_hub downloaded `name`'s config.json and model.safetensors
    into, None), or (None, the one-line reason it could not)."""
    try:
        from huggingface_hub import hf_hub_download  # only to download: reading needs none
    except ImportError:
        return None, (f"--init_from: {name} is not in the Hugging Face cache ({hub_cache()}); "
                      "pip install -r requirements-data.txt (huggingface_hub) to download it, or "
                      "pass a folder holding config.json and model.safetensors")
    try:
        path = hf_hub_download(REPOS[name], "config.json")
        hf_hub_download(REPOS[name], "model.safetensors")  # beside it: the same snapshot
    except Exception as e:
        first_line = str(e).splitlines()[0][:200] if str(e) else ""
        return None, (f"--init_from: {name} is not in the Hugging Face cache ({hub_cache()}) and "
                      f"downloading {REPOS[name]} failed ({type(e).__name__}: {first_line})")
    return os.path.dirname(path), None


def find(name):
    """(the folder holding `name`'s config.json and weights, None), or (None, the one-line reason).
    `name`: one of REPOS (the hub's cache, downloaded on a miss) or a folder."""
    if name in REPOS:
        folder = cached(name)
        return (folder, None) if folder is not None else download(name)
    if not os.path.isdir(name):
        return None, f"--init_from: expected one of {', '.join(REPOS)} or a folder, got {name}"
    if weights_in(name) is None:
        return None, (f"--init_from: {name} must hold config.json and one of "
                      f"{', '.join(WEIGHTS)}")
    return name, None


def take_sizes(args):
    """The model's sizes from --init_from's config.json, into the flags not given: n_layer, n_head,
    n_embd, bias (GPT-2 has biases), block_size (its n_positions) and vocab_size (its vocabulary,
    unpadded, as nanoGPT's from_pretrained: see pad_rows). Returns None, or the one line naming a
    given flag that disagrees with the weights."""
    folder, error = find(args.init_from)
    if error is not None:
        return error
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
        sizes = dict(n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"], bias=True)
        n_positions, vocab = hf["n_positions"], hf["vocab_size"]
    except (OSError, ValueError, KeyError) as e:
        return f"--init_from: {path} is not a GPT-2 config.json ({type(e).__name__}: {e})"
    activation = hf.get("activation_function", "gelu_new")
    if activation not in TANH_GELUS:
        return f"--init_from: {path} has activation_function {activation}, not GPT-2's gelu_new"
    for flag, value in sizes.items():
        given = getattr(args, flag)
        if given is None:
            setattr(args, flag, value)
        elif given != value:
            return (f"--{flag}: --init_from {args.init_from} has {flag}={value}, the size of its "
                    f"weights; got {given}")
    if args.block_size is None:
        args.block_size = n_positions
    if args.block_size > n_positions:
        return (f"--block_size: at most {n_positions} with --init_from {args.init_from} (its "
                f"position table), got {args.block_size}")
    if args.vocab_size is None:
        args.vocab_size = vocab
    if args.vocab_size < vocab:
        return (f"--vocab_size: at least {vocab} with --init_from {args.init_from} (its "
                f"vocabulary), got {args.vocab_size}")
    return None


def read_safetensors(path):
    """{name: tensor} of a .safetensors file, read without the safetensors package: 8 bytes (the
    header's length, little-endian), a JSON header {name: {dtype, shape, data_offsets}}, then the
    tensors' bytes. The tensors are views of the file mapped copy-on-write: nothing is read from
    disk before it is used. The header is padded to 8 bytes, so every tensor starts aligned."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    mapped = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))
    data = torch.empty(0, dtype=torch.uint8).set_(mapped)[8 + length:]  # bytes after the header
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        tensors[name] = data[begin:end].view(DTYPES[entry["dtype"]]).view(entry["shape"])
    return tensors


def read_weights(path):
    """{HF name: tensor} of a model.safetensors or a pytorch_model.bin."""
    if path.endswith(".safetensors"):
        return read_safetensors(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # torch's legacy (not zip) format, which cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def pad_rows(wte, vocab_size):
    """wte (V, C) with zero rows appended up to vocab_size (--vocab_size above the weights').
    The padded tokens never occur in the data, but the tied head gives each a logit of 0 in every
    softmax: the loss is GPT-2's own only unpadded (GPT-2's logits sit far below 0)."""
    padded = wte.new_zeros(vocab_size, wte.size(1))
    padded[:wte.size(0)] = wte
    return padded


def gpt_state(weights, config):
    """Our GPT's state dict (both tied names, one tensor) from GPT-2's `weights` (transformers'
    names, with or without the "transformer." prefix), or the one line saying what does not fit.
    nanoGPT's mapping: the Conv1D weights transposed (views), the rest as they are; wpe cut to
    config.block_size; wte padded with zero rows to config.vocab_size."""
    hf = {}
    for key, value in weights.items():
        if not key.endswith(IGNORED):
            hf[key.removeprefix("transformer.")] = value
    state = {}
    for name, meta in GPT(config, device="meta").state_dict().items():
        if name == "lm_head.weight":
            continue  # wte, below
        key = name.removeprefix("transformer.")
        if key not in hf:
            return None, f"--init_from: the weights have no {key}"
        value = hf.pop(key).float()  # fp32 parameters, whatever the file holds
        if name.endswith(CONV1D):
            value = value.t()  # (in, out) -> (out, in)
        if name == "transformer.wpe.weight":
            value = value[:config.block_size]
        if name == "transformer.wte.weight":
            value = pad_rows(value, config.vocab_size)
        if value.shape != meta.shape:
            return None, (f"--init_from: {key} is {tuple(value.shape)} in the weights, "
                          f"{tuple(meta.shape)} in the model")
        state[name] = value
    if hf:
        return None, f"--init_from: the weights hold {sorted(hf)[0]}, which GPT-2 has not"
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state, None


def weights_path(name):
    """(the weights file --init_from `name` names, None), or (None, the one-line reason)."""
    folder, error = find(name)
    if error is not None:
        return None, error
    return weights_in(folder), None


def checkpoint(path, config):
    """(a full checkpoint at step 0 holding the weights at `path` and no optimizer state, None), or
    (None, the one-line reason). `config`: gpt_config(args), the model they are mapped to."""
    try:
        weights = read_weights(path)
    except Exception as e:
        first_line = str(e).splitlines()[0][:200] if str(e) else ""
        return None, f"--init_from: cannot read {path} ({type(e).__name__}: {first_line})"
    state, error = gpt_state(weights, config)
    if error is not None:
        return None, f"{error} ({path})"
    return dict(model=state, optimizer=None, step=0, config=config.__dict__.copy()), None
