"""metrics.jsonl + TensorBoard + nanoGPT-style progress lines, written by rank 0.

Lines of <out_dir>/metrics.jsonl (a fresh run truncates it, a resumed run appends):
  step:  {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_ms", "peak_mem_bytes"}
  eval:  {"step", "val_loss", "train_loss"}                      (no "loss" key)
  final: {"summary": true, "model_state_bytes", "peak_mem_bytes", "tokens_per_sec" (median),
          "model_state_bytes_per_rank", "peak_mem_bytes_per_rank", ...}
"""
import json
import os
import resource
import statistics

import torch


def peak_mem_bytes(device):
    """Peak memory of this rank: CUDA's max allocated bytes, or on CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer):
    return tensor_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


class SavedActivations:
    """`with SavedActivations() as a:` counts the bytes autograd saves for backward inside it (the
    activations, parameters excluded), once per storage: one forward's activation memory, measured
    the same way on CPU and GPU, whatever the allocator does."""

    def __init__(self):
        self.storages = {}

    def _pack(self, t):
        if not isinstance(t, torch.nn.Parameter):
            storage = getattr(t, "_local_tensor", t).untyped_storage()  # a DTensor's local shard
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self.storages.values())


class Metrics:
    def __init__(self, out_dir, enabled, tensorboard=True, start_step=0):
        """start_step > 0 (a resumed run): keep the lines of steps before it, drop the rest (steps
        logged after the checkpoint by the interrupted run, and its summary), and append."""
        self.enabled = enabled
        self.tokens_per_sec = []
        self.file = self.writer = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "metrics.jsonl")
        kept = []
        if start_step > 0 and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if line.strip() and not json.loads(line).get("summary")
                        and json.loads(line).get("step", 0) < start_step]
        self.file = open(path, "w")
        self.file.writelines(kept)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(out_dir)

    def log(self, record):
        if "tokens_per_sec" in record and "summary" not in record:
            self.tokens_per_sec.append(record["tokens_per_sec"])
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None and "summary" not in record:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])

    def step(self, step, loss, lr, grad_norm, tokens, seconds, device, log_interval):
        record = dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_sec=tokens / seconds,
                      step_ms=1000 * seconds, peak_mem_bytes=peak_mem_bytes(device))
        self.log(record)
        if self.enabled and (step % log_interval == 0):
            print(f"iter {step}: loss {loss:.4f}, lr {lr:.2e}, norm {grad_norm:.3f}, "
                  f"time {1000 * seconds:.1f}ms, {tokens / seconds:,.0f} tok/s", flush=True)

    def eval(self, step, losses):
        self.log(dict(step=step, val_loss=losses["val"], train_loss=losses["train"]))
        if self.enabled:
            print(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)

    def summary(self, model_state_bytes_per_rank, peak_mem_bytes_per_rank, **extra):
        record = dict(summary=True, model_state_bytes=model_state_bytes_per_rank[0],
                      peak_mem_bytes=peak_mem_bytes_per_rank[0],
                      tokens_per_sec=statistics.median(self.tokens_per_sec) if self.tokens_per_sec else 0.0,
                      model_state_bytes_per_rank=model_state_bytes_per_rank,
                      peak_mem_bytes_per_rank=peak_mem_bytes_per_rank, **extra)
        self.log(record)
        if self.enabled:
            print(f"done: median {record['tokens_per_sec']:,.0f} tok/s, model state "
                  f"{record['model_state_bytes'] / 2**20:.1f} MiB/rank, peak memory "
                  f"{max(peak_mem_bytes_per_rank) / 2**20:.0f} MiB/rank (max)", flush=True)

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()
