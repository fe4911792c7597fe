"""The training contract's flags, their checks, and nanoGPT's learning-rate schedule.

Every strategy script calls `parse_args(strategy, add_flags)`: the same core flags and defaults
everywhere, plus the strategy's own. Boolean flags accept `--name` and `--name=true|false`.
Bad input ends the run with one line `error: --flag: constraint` printed by rank 0, on every rank,
before anything is built (`die`).
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from common.model import PRESETS, GPTConfig
from common.data import GPT2_VOCAB
from common.recompute import MODES

# The oldest torch the scripts run correctly on (docs/torch-versions.md). Below it gloo gets data
# parallelism's mean wrong: before 2.8 it refuses ReduceOp.AVG, and in 2.8 its reduce-scatter sums
# where AVG asks for the mean, so fsdp's gradients (and torch FSDP2's) are N times too large.
TORCH_FLOOR = "2.9"


def is_rank0():
    return os.environ.get("RANK", "0") == "0"


DIE_GRACE_S = 10  # how long the other ranks give rank 0 to print the error line (see die)


def die(message):
    """One clear error line from rank 0, a non-zero exit on every rank. Call it on all ranks
    (checks are deterministic), so no rank is left waiting in a collective; the process group, if
    there is one yet, is destroyed before the exit (see common.distributed.teardown).
    The other ranks exit only after DIE_GRACE_S: torchrun stops the whole job at the first rank
    that fails, so a rank that exited first would get rank 0 killed before it printed (under load
    it did). Rank 0 exits at once and torchrun then ends the others: the grace only bounds a rank 0
    that never gets here."""
    if is_rank0():
        print(f"error: {message}", file=sys.stderr, flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if not is_rank0():
        time.sleep(DIE_GRACE_S)
    sys.exit(2)


def str2bool(v):
    if isinstance(v, bool):
        return v
    if v.lower() in ("true", "1", "yes"):
        return True
    if v.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line from rank 0 instead of usage + message from every rank
        die(message)


def add_bool(group, name, default, help):
    group.add_argument(name, type=str2bool, nargs="?", const=True, default=default,
                       metavar="true|false", help=f"{help} (default: {default})")


def script_name(strategy):
    """The calling script's name without _train.py (pp_zb for pp_zb_train.py), read from the frame
    that called parse_args; `strategy` when the caller is not a *_train.py script (a test)."""
    caller = os.path.basename(sys._getframe(2).f_globals.get("__file__", ""))
    return caller[:-len("_train.py")] if caller.endswith("_train.py") else strategy


def parse_args(strategy, add_flags=None, argv=None):
    p = _Parser(description=f"nanodist {strategy}: train nanoGPT on Shakespeare.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model (defaults from --preset; a flag overrides it)")
    m.add_argument("--preset", choices=sorted(PRESETS), default="small",
                   help="small: 4 layers, 128 wide, block 64 (CPU); gpt2: GPT-2 124M")
    m.add_argument("--init_from", default=None, metavar="gpt2|gpt2-medium|gpt2-large|gpt2-xl|DIR",
                   help="start from OpenAI's GPT-2 weights: the Hugging Face hub's cache "
                        "(huggingface_hub downloads them there if it is installed), or a folder "
                        "holding config.json and model.safetensors; the model's sizes are theirs "
                        "(a size flag given must agree) and its GELU GPT-2's tanh one. A resume "
                        "(--resume, --resume_from, a restart) wins: it continues the run")
    for name, typ in (("n_layer", int), ("n_head", int), ("n_embd", int), ("block_size", int),
                      ("vocab_size", int), ("dropout", float)):
        m.add_argument(f"--{name}", type=typ, default=None)
    add_bool(m, "--bias", None, "biases in Linear and LayerNorm")
    add_moe_flags(p.add_argument_group("mixture of experts"), strategy in MOE_STRATEGIES)
    b = p.add_argument_group("batch")
    b.add_argument("--batch_size", type=int, default=16, help="global sequences per optimizer step")
    b.add_argument("--grad_accum_steps", type=int, default=1, help="micro-steps per optimizer step")
    o = p.add_argument_group("optimizer")
    o.add_argument("--max_iters", type=int, default=200,
                   help="optimizer steps, numbered 0..max_iters-1")
    o.add_argument("--learning_rate", type=float, default=1e-3)
    o.add_argument("--min_lr", type=float, default=1e-4)
    o.add_argument("--warmup_iters", type=int, default=20)
    o.add_argument("--lr_decay_iters", type=int, default=None, help="default: max_iters")
    add_bool(o, "--decay_lr", True, "warmup + cosine decay; false: constant learning_rate")
    o.add_argument("--weight_decay", type=float, default=0.1)
    o.add_argument("--beta1", type=float, default=0.9)
    o.add_argument("--beta2", type=float, default=0.95)
    o.add_argument("--grad_clip", type=float, default=1.0,
                   help="clip the global grad norm; 0 disables")
    r = p.add_argument_group("run")
    r.add_argument("--seed", type=int, default=1337)
    r.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda + nccl when a GPU is present, else cpu + gloo")
    r.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype (bfloat16: autocast; parameters and optimizer stay fp32); "
                        "None: bfloat16 on CUDA where the GPU computes in it, else float32")
    add_bool(r, "--tf32", True, "on CUDA, fp32 matmuls and convolutions in TF32 (nanoGPT's "
             "default, several times faster on A100/H100); no effect on CPU")
    r.add_argument("--activation_checkpointing", choices=MODES, default="none",
                   help="keep fewer activations and recompute them in backward: full: each "
                        "block's (only its input is kept); selective: the attention core's "
                        "(common/recompute.py)")
    add_bool(r, "--compile", None, "torch.compile what the strategy's hooks and collectives "
             "allow (docs/compile.md); None: on with CUDA, where it pays back its "
             "compile time (tens of seconds), off on CPU, where a short run does not")
    add_bool(r, "--deterministic", False, "deterministic kernels: torch.use_deterministic_"
             "algorithms, cuBLAS's fixed workspace and, on CUDA, SDPA's math backend; on CUDA, "
             "bit-identical reruns and resumes need it")
    r.add_argument("--eval_interval", type=int, default=50,
                   help="evaluate every N steps and at the end; 0: never")
    r.add_argument("--eval_iters", type=int, default=10, help="batches per evaluation")
    r.add_argument("--log_interval", type=int, default=10, help="print every N steps")
    r.add_argument("--out_dir", default=os.path.join("out", script_name(strategy)),
                   help="out/<the script's name less _train.py>: every script its own")
    r.add_argument("--dataset", default="shakespeare",
                   help="data/<dataset>/ (its train and val tokens); a value with a / in it: the "
                        "path of a folder, e.g. of llm.c's .bin shards")
    r.add_argument("--data_file", default=None, help="tokenise this text file into data/<dataset>/")
    r.add_argument("--implementation", choices=["custom", "pytorch"], default="custom",
                   help="custom: the hand-written strategy; pytorch: PyTorch's own, same loop")
    r.add_argument("--checkpoint_interval", type=int, default=0,
                   help="write out_dir/ckpt.pt every N steps; it is always written at the end")
    add_bool(r, "--resume", False, "continue from out_dir/ckpt.pt (written by any script); "
             "a torchrun restart after a failure resumes by itself")
    r.add_argument("--resume_from", default=None, metavar="PATH",
                   help="continue from this full checkpoint instead of out_dir/ckpt.pt (a path "
                        "every node can read); implies --resume")
    r.add_argument("--timeout_s", type=float, default=300,
                   help="collective timeout: a rank waiting longer on a dead peer fails "
                        "instead of hanging")
    add_bool(r, "--tensorboard", True, "also log the metrics to TensorBoard under out_dir")
    add_bool(r, "--profile", False, "write a torch.profiler trace of steps 2-4 per rank to "
             "out_dir/profile (open in ui.perfetto.dev or TensorBoard)")
    if add_flags is not None:
        add_flags(p.add_argument_group(strategy))
    check_torch()
    args = p.parse_args(argv)
    if args.init_from is not None:  # the sizes of the weights, before the preset's
        from common.pretrained import take_sizes  # only here: a run without it never imports it
        error = take_sizes(args)
        if error is not None:
            die(error)
    preset = PRESETS[args.preset]
    for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout", "bias"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.lr_decay_iters is None:
        args.lr_decay_iters = max(1, args.max_iters)  # --max_iters 0 takes no step
    if args.dtype is None:  # resolved here, before any script's checks read it (pp's torch gate)
        args.dtype = default_dtype(args)
    check_core_args(args)
    check_moe_args(args, strategy)
    if args.init_from is not None and args.n_experts:
        die(f"--init_from: OpenAI's GPT-2 is a dense GPT, not a mixture of --n_experts "
            f"{args.n_experts}")
    return args


# The strategies that train a mixture of experts (--n_experts > 0), with their default E
MOE_STRATEGIES = {"ep": 8}


def add_moe_flags(group, supported):
    """Every script has the flags; the ones that do not train a mixture of experts refuse them
    (check_moe_args), and their help says where the flags are."""
    where = "" if supported else "ep_train.py's; "
    group.add_argument("--n_experts", type=int, default=None,
                       help=where + "E > 0: each block's MLP is E experts; 0: the dense GPT; "
                            "None: 8")
    group.add_argument("--top_k", type=int, default=None, help=where + "experts a token; None: 2")
    group.add_argument("--expert_hidden", type=int, default=None, help=where + "each expert's "
                       "hidden width; None: 4 * n_embd // top_k (the dense MLP's FLOPs a token)")
    group.add_argument("--aux_loss_coef", type=float, default=None, help=where + "weight of the "
                       "load-balancing loss in what backward runs on; None: 0.01")


def check_moe_args(args, strategy):
    """Fills in the MoE flags' defaults, or ends the run with one line: a strategy without MoE
    refuses them, and a dense run (--n_experts 0) refuses the others."""
    moe_flags = ("n_experts", "top_k", "expert_hidden", "aux_loss_coef")
    if strategy not in MOE_STRATEGIES:
        for name in moe_flags:
            if getattr(args, name) is not None:
                die(f"--{name}: {strategy} trains the dense GPT; a mixture of experts "
                    "trains in ep_train.py (in one process too)")
    if args.n_experts is None:
        args.n_experts = MOE_STRATEGIES.get(strategy, 0)
    if args.n_experts < 0:
        die(f"--n_experts: must be >= 0, got {args.n_experts}")
    if args.n_experts == 0:
        for name in moe_flags[1:]:
            if getattr(args, name) is not None:
                die(f"--{name}: only for a mixture of experts (--n_experts > 0)")
        return
    if args.top_k is None:
        args.top_k = 2
    if args.top_k < 1:
        die(f"--top_k: must be >= 1, got {args.top_k}")
    if args.top_k > args.n_experts:
        die(f"--top_k: must be <= --n_experts ({args.n_experts}), got {args.top_k}")
    if args.expert_hidden is None:
        args.expert_hidden = max(1, 4 * args.n_embd // args.top_k)
    if args.expert_hidden <= 0:
        die(f"--expert_hidden: must be > 0, got {args.expert_hidden}")
    if args.aux_loss_coef is None:
        args.aux_loss_coef = 0.01
    if args.aux_loss_coef < 0:
        die(f"--aux_loss_coef: must be >= 0, got {args.aux_loss_coef}")
    if args.compile:  # the experts' row counts change every step: a recompile each time
        die("--compile: not with --n_experts (each expert's row count changes every step)")
    args.compile = False  # the default (on with CUDA): off


def uses_cuda(args):
    """Whether this run computes on CUDA (nccl): --device cuda, or auto with a GPU present."""
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def default_dtype(args):
    """--dtype's default: bfloat16 on CUDA where the GPU computes in it (compute capability 8.0+:
    A100, H100, ...), as nanoGPT trains there; float32 on an older GPU, which only emulates bf16
    (nanoGPT's float16 would need a gradient scaler); float32 on CPU, whose runs keep their losses.
    Asked of cuda:0, before setup picks this rank's GPU: a node's GPUs are of one kind."""
    if uses_cuda(args) and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bfloat16"
    return "float32"


def check_torch(needed=TORCH_FLOOR, what="nanodist",
                why="before it gloo's ReduceOp.AVG is missing or, in reduce-scatter, a sum"):
    """One error line if this torch is older than `needed`: the floor, or a PyTorch peer's need."""
    if TorchVersion(torch.__version__) < needed:
        die(f"{what} needs torch >= {needed}, this is {torch.__version__} ({why}); "
            f"pip install 'torch>={needed}'")


def check_core_args(args):
    positive = ["n_layer", "n_head", "n_embd", "block_size", "vocab_size", "batch_size",
                "grad_accum_steps", "learning_rate", "eval_iters", "log_interval", "lr_decay_iters"]
    positive.append("timeout_s")
    for name in positive:
        if not getattr(args, name) > 0:
            die(f"--{name}: must be > 0, got {getattr(args, name)}")
    if args.max_iters < 0 or (args.max_iters == 0 and args.init_from is None):
        die(f"--max_iters: must be > 0 (0, to evaluate the weights, with --init_from), "
            f"got {args.max_iters}")
    if args.max_iters == 0 and not args.eval_interval:
        die("--max_iters: 0 takes no step and only evaluates: not with --eval_interval 0")
    non_negative = ("min_lr", "warmup_iters", "weight_decay", "grad_clip", "eval_interval",
                    "checkpoint_interval")
    for name in non_negative:
        if getattr(args, name) < 0:
            die(f"--{name}: must be >= 0, got {getattr(args, name)}")
    if not 0 <= args.dropout < 1:
        die(f"--dropout: must be in [0, 1), got {args.dropout}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(args, name) < 1:
            die(f"--{name}: must be in [0, 1), got {getattr(args, name)}")
    if args.n_embd % args.n_head:
        die(f"--n_head: n_embd ({args.n_embd}) must be divisible by n_head ({args.n_head})")
    if args.implementation == "pytorch" and args.activation_checkpointing == "selective":
        if args.compile:  # torch 2.13
            die("--compile: not with torch's selective activation checkpointing, whose op policy "
                "(a dispatch mode) does not see the ops of a compiled block: its recompute gave "
                "NaN; use --activation_checkpointing full, or --implementation custom")
        args.compile = False  # the default: off here
    if args.vocab_size < GPT2_VOCAB:
        die(f"--vocab_size: must be >= {GPT2_VOCAB} (the GPT-2 tokenizer's vocabulary), "
            f"got {args.vocab_size}")


def check_batch_split(args, dp_size):
    """The contract's batch split: dp rank r takes rows [r*B/D, (r+1)*B/D), micro-step j the j-th
    of grad_accum_steps equal chunks of those."""
    if args.batch_size % (dp_size * args.grad_accum_steps):
        die(f"--batch_size: {args.batch_size} must be divisible by data-parallel size ({dp_size}) "
            f"x --grad_accum_steps ({args.grad_accum_steps})")


def gpt_config(args):
    config = GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size,
                       n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       dropout=args.dropout, bias=args.bias)
    if args.init_from is not None:  # OpenAI's weights learned GPT-2's GELU
        config.gelu = "tanh"
    if args.n_experts:  # a mixture of experts; dense: the fields' zeros
        config.n_experts, config.top_k = args.n_experts, args.top_k
        config.expert_hidden = args.expert_hidden
    return config


def get_lr(step, args):
    """nanoGPT: linear warmup, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if not args.decay_lr:
        return args.learning_rate
    if step < args.warmup_iters:
        return args.learning_rate * (step + 1) / (args.warmup_iters + 1)
    if step > args.lr_decay_iters:
        return args.min_lr
    ratio = (step - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio)))
    return args.min_lr + coeff * (args.learning_rate - args.min_lr)
