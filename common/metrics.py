"""Measurement, kept out of the strategies: metrics.jsonl + TensorBoard + nanoGPT-style progress
lines (rank 0), named wait timers, the saved-activation meter, model-state bytes and --profile.

Lines of <out_dir>/metrics.jsonl (a fresh run truncates it, a resumed run appends):
  step:  {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_ms", "peak_mem_bytes"}; a
         mixture of experts also "aux_loss" (its load-balancing loss, before its coefficient) and
         "expert_load" (the most-loaded expert's slots over the mean, at the worst layer)
  eval:  {"step", "val_loss", "train_loss"}                      (no "loss" key)
  final: {"summary": true, "model_state_bytes", "peak_mem_bytes", "tokens_per_sec" (median),
          "model_state_bytes_per_rank", "peak_mem_bytes_per_rank" (at the last step, before the
          final checkpoint), "checkpoint_peak_mem_bytes_per_rank" (after it, its gather included),
          "<timer>_ms_per_rank" (median per step of each named wait), ...}
"""
import json
import os
import resource
import statistics
import time
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.distributed as dist


def peak_mem_bytes(device):
    """Peak memory of this rank: CUDA's max allocated bytes, or on CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def held_bytes(tensors):
    """Bytes this rank really holds: a DTensor counts its local shard, a freed tensor (storage
    resized to 0) counts 0."""
    total = 0
    for t in tensors:
        if t is not None:
            t = t.to_local() if hasattr(t, "to_local") else t
            total += min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
    return total


def model_state_bytes(optimizer):
    """The model state this rank keeps between steps: the parameters the optimizer updates, their
    gradients and its state (AdamW: exp_avg, exp_avg_sq): 16 bytes a parameter in fp32."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return held_bytes(params) + held_bytes(p.grad for p in params) + held_bytes(state)


class HostClock:
    """CPU: a mark is the host's time, and a span's ends are when the host got there (on CPU an op,
    and a gloo wait, has finished when the host returns)."""

    def mark(self):
        return time.perf_counter()

    def seconds(self, start, end):
        return end - start


class DeviceClock:
    """CUDA: the host only queues kernels, and an NCCL `work.wait()` makes the current stream wait
    without blocking the host, so host time around either is launch time. A mark is a CUDA event
    recorded on the current stream (the one the next kernel, and the wait, are queued on): the
    stream reaches it once everything queued before it has run, so end - start is the stream's
    time in the span, its waits included. seconds() waits for the end event: call it only after
    the step's host sync, where it costs nothing. `event`: the event factory (a test passes a
    fake)."""

    def __init__(self, event=None):
        self.event = event or partial(torch.cuda.Event, enable_timing=True)

    def mark(self):
        event = self.event()
        event.record()  # on torch.cuda.current_stream()
        return event

    def seconds(self, start, end):
        end.synchronize()  # start was queued before end on the stream: it has been reached too
        return start.elapsed_time(end) / 1000  # elapsed_time: ms


class Timers:
    """Seconds spent per step in named spans, e.g. the waits on communication that overlap did not
    hide: a strategy writes `with timers("exposed_comm"): work.wait()`; Metrics.step() closes the
    step and the summary reports each name's median ms per step, per rank. `last_spans` (when
    keep_spans) holds (label or name, start, end) of every span of the last finished step, seconds
    from the step's start, for a timeline. A span keeps its two marks of `clock` (host time on CPU,
    CUDA events on CUDA: setup() calls use_device) and end_step() reads them, after the step."""

    def __init__(self, clock=None):
        self.clock = clock or HostClock()
        self.marks = []  # this step's spans: (name, label, start mark, end mark)
        self.last_spans = []
        self.keep_spans = False
        self.steps = {}
        self.t0 = None  # the step's start mark: start_step() sets it

    def use_device(self, device):
        """Marks of this device's clock from now on (the step, and the record of steps, restart)."""
        self.clock = DeviceClock() if device.type == "cuda" else HostClock()
        self.steps = {}
        self.start_step()

    @contextmanager
    def __call__(self, name, label=None):
        start = self.clock.mark()
        try:
            yield
        finally:
            self.marks.append((name, label, start, self.clock.mark()))

    def start_step(self):
        self.marks = []
        self.t0 = self.clock.mark()

    def end_step(self):
        """Called after the step's work is done (on CUDA: after the step's one host sync)."""
        seconds = {}
        spans = []
        for name, label, start, end in self.marks:
            seconds[name] = seconds.get(name, 0.0) + self.clock.seconds(start, end)
            if self.keep_spans:
                t_start = self.clock.seconds(self.t0, start)
                t_end = self.clock.seconds(self.t0, end)
                spans.append((label or name, t_start, t_end))
        for name, s in seconds.items():
            self.steps.setdefault(name, []).append(1000 * s)
        self.last_spans = spans
        self.start_step()

    def medians_ms(self):
        return {name: statistics.median(ms) for name, ms in self.steps.items()}


timers = Timers()


class SavedActivations:
    """`with SavedActivations() as a:` counts the bytes autograd saves for backward inside it (the
    activations, parameters excluded), once per storage: one forward's activation memory, measured
    the same way on CPU and GPU, whatever the allocator does."""

    in_use = []  # the meters inside their `with` now: hold() counts into each

    def __init__(self):
        self.reset()

    def reset(self):
        self.storages = {}
        self.measured = False

    def _pack(self, t):
        # parameters, and views of them (a Linear saves its weight transposed), are not activations
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's local shard
            try:
                storage = local.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a wrapper without storage (a functional collective's pending
                # result, AsyncCollectiveTensor): its numbers, once
                self.storages[id(local)] = local.numel() * local.element_size()
        return t

    @classmethod
    def hold(cls, *tensors):
        """Counts tensors kept for backward outside autograd's saved tensors: the inputs that
        torch.utils.checkpoint keeps for its recompute (inside it, its own hooks replace these).
        Not inside a compiled graph (a checkpoint within a compiled block): traced, the meter would
        break the graph, and a compiled run's memory is not the eager one it measures."""
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():  # or nothing is kept
            return
        for meter in cls.in_use:
            for t in tensors:
                meter._pack(t)

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        self.in_use.append(self)
        return self

    def __exit__(self, *exc):
        self.in_use.remove(self)
        self.hooks.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self.storages.values())

    def first(self):
        """This meter around the first call that autograd records (e.g. one micro-step's forward,
        not an evaluation's before it), else a no-op."""
        if self.measured or not torch.is_grad_enabled():
            return nullcontext()
        self.measured = True
        return self


# a strategy measures with `with activations.first():`; the summary reports it
activations = SavedActivations()


# Dense (no sparsity) peak FLOP/s of one GPU for bf16, TF32 and plain fp32 matmuls, from NVIDIA's
# datasheets, by a name torch.cuda.get_device_name() contains: the first match wins, so a longer
# name comes before the one it contains ("H100 NVL" and "H100 PCIe" before "H100", "L40S" and
# "L40" before "L4"). "H100" alone is the SXM part, "H200" alone the SXM part.
PEAK_FLOPS = [
    ("H100 NVL", dict(bfloat16=835e12, tf32=417.5e12, float32=60e12)),
    ("H100 PCIe", dict(bfloat16=756e12, tf32=378e12, float32=51e12)),
    ("H100", dict(bfloat16=989e12, tf32=494.5e12, float32=67e12)),
    ("H200 NVL", dict(bfloat16=835e12, tf32=417.5e12, float32=60e12)),
    ("H200", dict(bfloat16=989e12, tf32=494.5e12, float32=67e12)),
    ("A100", dict(bfloat16=312e12, tf32=156e12, float32=19.5e12)),
    ("L40S", dict(bfloat16=362e12, tf32=183e12, float32=91.6e12)),
    ("L40", dict(bfloat16=181e12, tf32=90.5e12, float32=90.5e12)),
    ("L4", dict(bfloat16=121e12, tf32=60e12, float32=30.3e12)),
    ("RTX 4090", dict(bfloat16=165.2e12, tf32=82.6e12, float32=82.6e12)),
]


def peak_flops(device, args):
    """This device's peak FLOP/s for the run's matmuls, or None where unknown (CPUs, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    kind = args.dtype if args.dtype == "bfloat16" or not args.tf32 else "tf32"
    return next((peaks[kind] for gpu, peaks in PEAK_FLOPS if gpu in name), None)


def flops_per_token(config):
    """nanoGPT's (PaLM's appendix B): 6 FLOPs a parameter (wpe left out) for forward and
    backward, plus attention's 12 * n_layer * n_embd * block_size (its masked causal half
    included). A mixture of experts counts the parameters a token uses: k of the E experts."""
    from common.model import GPT  # on the meta device: no memory
    n_params = 0
    for name, p in GPT(config, device="meta").named_parameters():
        if ".experts." in name:
            n_params += p.numel() * config.top_k / config.n_experts
        else:
            n_params += p.numel()
    n_params -= config.block_size * config.n_embd  # wpe
    return 6 * n_params + 12 * config.n_layer * config.n_embd * config.block_size


class MFU:
    """Model FLOPs utilisation: the model's FLOP/s (tokens/s x flops_per_token) over the peak of
    all the job's devices; None where the peak is unknown. Recomputation
    (--activation_checkpointing) is not counted: MFU, not hardware utilisation."""
    def __init__(self, config, args, device, world_size):
        self.flops_per_token = flops_per_token(config)
        peak = peak_flops(device, args)
        self.peak = None if peak is None else peak * world_size

    def __call__(self, tokens_per_sec):
        if self.peak is None:
            return None
        return tokens_per_sec * self.flops_per_token / self.peak


def expert_load(slots, n_experts):
    """Each MoE layer's most-loaded expert's slots over the mean of its experts' (1.0: balanced),
    from the slots per expert of every layer, one list: (L*E,) numbers -> L numbers."""
    layers = [slots[i:i + n_experts] for i in range(0, len(slots), n_experts)]
    return [max(layer) / (sum(layer) / n_experts) for layer in layers]


class Metrics:
    def __init__(self, out_dir, enabled, tensorboard=True, start_step=0, mfu=None):
        """start_step > 0 (a resumed run): keep the lines of steps before it, drop the rest (steps
        logged after the checkpoint by the interrupted run, and its summary), and append. mfu: an
        MFU, for every step's line."""
        self.enabled = enabled
        self.mfu = mfu
        self.tokens_per_sec = []
        self.peak_mem_bytes = None  # at the last step: the training's, before the final checkpoint
        timers.start_step()
        self.file = None
        self.writer = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "metrics.jsonl")
        kept = []
        if start_step > 0 and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if not record.get("summary") and record.get("step", 0) < start_step:
                        kept.append(line)
        # The kept lines go to a new file that replaces the old one by a rename, as the checkpoint
        # does: a crash here leaves the old file whole, never a truncated one.
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.file = open(path, "a")
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

    def step(self, step, loss, lr, grad_norm, tokens, seconds, device, log_interval,
             aux_loss=None, expert_load=None):
        """aux_loss: a mixture of experts' load-balancing loss, logged beside the loss; None (a
        dense GPT): no such key. expert_load: its layers' most-loaded expert's slots over their
        mean (1.0: balanced), logged as their worst and, in TensorBoard, each layer's."""
        timers.end_step()
        self.peak_mem_bytes = peak_mem_bytes(device)
        mfu = self.mfu(tokens / seconds) if self.mfu is not None else None
        record = dict(step=step, loss=loss)
        if aux_loss is not None:
            record["aux_loss"] = aux_loss
        if expert_load is not None:
            record["expert_load"] = max(expert_load)
        record.update(lr=lr, grad_norm=grad_norm, tokens_per_sec=tokens / seconds,
                      step_ms=1000 * seconds, peak_mem_bytes=self.peak_mem_bytes, mfu=mfu)
        self.log(record)
        if self.writer is not None and expert_load is not None:
            for layer, value in enumerate(expert_load):
                self.writer.add_scalar(f"expert_load/layer_{layer}", value, step)
        if self.enabled and (step % log_interval == 0):
            shown = "-" if mfu is None else f"{100 * mfu:.1f}%"  # "-": no known peak (a CPU)
            aux = "" if aux_loss is None else f", aux {aux_loss:.4f}"
            aux += "" if expert_load is None else f", load {max(expert_load):.2f}"
            print(f"iter {step}: loss {loss:.4f}{aux}, lr {lr:.2e}, norm {grad_norm:.3f}, "
                  f"time {1000 * seconds:.1f}ms, {tokens / seconds:,.0f} tok/s, mfu {shown}",
                  flush=True)

    def eval(self, step, losses):
        timers.start_step()  # the evaluation's waits are not the next step's
        self.log(dict(step=step, val_loss=losses["val"], train_loss=losses["train"]))
        if self.enabled:
            train_loss = losses["train"]
            val_loss = losses["val"]
            print(f"step {step}: train loss {train_loss:.4f}, val loss {val_loss:.4f}", flush=True)

    def summary(self, model_state_bytes, device, run=None, **extra):
        """Collective: every rank's model state, peak memory, timer medians and `extra` values are
        gathered, and rank 0 writes them as lists (<key>_per_rank) in the summary line; `run`:
        values of the whole run (rank 0's), written under their own names. Called after the final
        checkpoint: peak_mem_bytes is the training's, measured at the last step, and
        checkpoint_peak_mem_bytes the peak now, the checkpoint's gather included."""
        timer_ms = {f"{k}_ms": round(v, 3) for k, v in timers.medians_ms().items()}
        now = peak_mem_bytes(device)
        training = now if self.peak_mem_bytes is None else self.peak_mem_bytes  # None: no step run
        this_rank = dict(model_state_bytes=model_state_bytes, peak_mem_bytes=training,
                    checkpoint_peak_mem_bytes=now, **timer_ms, **extra)
        if activations.measured:
            this_rank["saved_activation_bytes"] = activations.bytes
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, this_rank)
        median_tokens_per_sec = 0.0
        if self.tokens_per_sec:
            median_tokens_per_sec = statistics.median(self.tokens_per_sec)
        per_rank = {}
        for key in ranks[0]:
            per_rank[f"{key}_per_rank"] = [r.get(key) for r in ranks]
        mfu = self.mfu(median_tokens_per_sec) if self.mfu is not None else None  # at the median
        record = dict(summary=True, model_state_bytes=ranks[0]["model_state_bytes"],
                      peak_mem_bytes=ranks[0]["peak_mem_bytes"],
                      tokens_per_sec=median_tokens_per_sec, mfu=mfu, **per_rank, **(run or {}))
        self.log(record)
        if self.enabled:
            peak_mib = max(record["peak_mem_bytes_per_rank"]) / 2**20
            shown = "" if mfu is None else f" (mfu {100 * mfu:.1f}%)"
            print(f"done: median {record['tokens_per_sec']:,.0f} tok/s{shown}, model state "
                  f"{record['model_state_bytes'] / 2**20:.1f} MiB/rank, peak memory "
                  f"{peak_mib:.0f} MiB/rank (max)", flush=True)

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


class Profiler:
    """--profile: a torch.profiler trace of steps 2..4 of this run (after a step of warm-up), one
    file per rank, <out_dir>/profile/rank<r>.*.pt.trace.json, with CPU ops, CUDA kernels and the
    collectives (gloo/nccl) on one timeline; open it in https://ui.perfetto.dev or TensorBoard.
    Call step() once per training step; without --profile it does nothing."""

    def __init__(self, args, rank):
        self.prof = None
        if args.profile:
            from torch.profiler import ProfilerActivity, profile, schedule
            from torch.profiler import tensorboard_trace_handler
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            steps = schedule(wait=1, warmup=1, active=3, repeat=1)
            trace_dir = os.path.join(args.out_dir, "profile")
            write_trace = tensorboard_trace_handler(trace_dir, worker_name=f"rank{rank}")
            self.prof = profile(activities=activities, schedule=steps, on_trace_ready=write_trace)
            self.prof.start()

    def step(self):
        if self.prof is not None:
            self.prof.step()

    def stop(self):
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
