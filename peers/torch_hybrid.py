"""PyTorch's own 4D parallelism, for hybrid_train.py --implementation pytorch (in progress)."""
from common.config import die


def check_args(args, sizes):
    if args.implementation == "pytorch":
        die("--implementation: pytorch is not built yet")


class TorchHybrid:
    pass
