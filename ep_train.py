"""EP: expert parallelism for a mixture-of-experts GPT, written by hand.

Each block's MLP is E experts, k of them per token, picked by a router (common/model.py's MoE). The
experts are sharded over the EP ranks, E/EP a rank; the rest of the model (attention, embeddings,
routers) is on every rank and data-parallel, each rank on its own rows. In each MoE layer a rank
sends every row to the ranks that hold its k experts and gets their outputs back: all-to-alls with
uneven splits, whose sizes are known only after routing, in forward and again in backward.
  memory per rank:  16 bytes a parameter (fp32 params, grads, AdamW) of the Pd non-expert ones,
                    and of Pe/EP of the Pe expert ones (torch DDP holds all Pe on every rank)
  communication:    per MoE layer and micro-step, the counts (8E bytes) and the rows (N*k rows
                    of C values out, as many back in all; again in backward), then per step one
                    all-reduce of the 4Pd non-expert gradient bytes over all ranks; with
                    --data_parallel_size > 1 (EP x DP), one of the 4Pe/EP expert gradient bytes
                    over each shard's replicas. Torch DDP all-reduces 4(Pd + Pe) bytes.

Run:
  python ep_train.py                                    # single process: the reference
  torchrun --standalone --nproc_per_node=2 ep_train.py  # EP 2: 4 of the 8 experts a rank
  torchrun --standalone --nproc_per_node=4 ep_train.py --data_parallel_size 2   # EP 2 x DP 2
  torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-backend=c10d \\
           --rdzv-endpoint=HOST:29500 ep_train.py --n_experts 64 --data_parallel_size 2
  python ep_train.py --implementation pytorch           # torch DDP, every expert on every rank
The dispatch's layout, the bytes, the auxiliary loss: docs/ep.md.
"""
import os
import time

import torch
import torch.distributed as dist

from common.checkpoint import checkpoint, gather_to_rank0, resume, set_adamw_state
from common.config import check_batch_split, die, get_lr, gpt_config, parse_args
from common.data import Batches, get_batch
from common.distributed import autocast, clip_grad_norm_, setup, setup_data, teardown
from common.metrics import MFU, Metrics, Profiler, activations, model_state_bytes, timers
from common.model import GPT, configure_optimizer, invert, materialize_, num_params
from common.model import combine, run_experts, sort_by_expert
from common.recompute import checkpoint_blocks
import peers.torch_ep


# ---- the strategy: experts sharded over the ranks, rows sent to them by all-to-all -----------

class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits, which has no autograd: forward sends send_splits[r]
    rows to rank r and receives recv_splits[r] rows from it; backward sends each row's gradient
    back the way the row came: the same call with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        received = rows.new_empty((sum(recv_splits), rows.size(1)))
        # Rank r gets rows' r-th block: send_splits[r] x C values of rows.element_size() bytes
        # (the rows are sorted by destination, so each block is contiguous); what comes in is
        # laid out by source rank, in rank order, each block in its sender's order.
        with timers("all_to_all"):  # the step's time in them: the summary's median
            dist.all_to_all_single(received, rows, recv_splits, send_splits, group=group)
        return received

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        grad_rows = grad.new_empty((sum(send_splits), grad.size(1)))
        # The forward's bytes the other way: the gradient of each received row goes to the rank
        # it came from, into the place that rank sent it from.
        with timers("all_to_all"):
            dist.all_to_all_single(grad_rows, grad.contiguous(), send_splits, recv_splits,
                                   group=ctx.group)
        return grad_rows, None, None, None


class ExpertParallel:
    """One MoE layer's dispatch_combine over the EP group: each row to the ranks that hold its k
    experts (rank r holds experts r*E/EP .. (r+1)*E/EP - 1), computed there, and back, in place
    of common/model.py's one-process version, which it follows step by step."""

    def __init__(self, experts, config, group):
        self.experts = experts  # this rank's experts: a ModuleDict keyed by global index
        self.n_experts, self.top_k, self.group = config.n_experts, config.top_k, group
        self.ep_size = dist.get_world_size(group)
        self.n_local = config.n_experts // self.ep_size

    def __call__(self, rows, experts, gates):
        ep, n_local = self.ep_size, self.n_local
        order, counts = sort_by_expert(experts, self.n_experts)  # counts (E,)
        # In expert order is in destination order: rank r holds the consecutive experts
        # r*E/EP .. (r+1)*E/EP - 1, so each rank's rows are one consecutive block of send.
        send = rows[order // self.top_k]  # (N*k, C): by destination rank, then by its expert
        counts_in = torch.empty_like(counts)
        # The counts first, in their own all-to-all: rank r gets counts[r*E/EP:(r+1)*E/EP], how
        # many of this rank's rows each of its experts will get (E/EP x 8 bytes to each rank,
        # 8E in all). The rows' all-to-all needs every size before it starts.
        with timers("all_to_all"):  # where a rank first waits for a slower one
            dist.all_to_all_single(counts_in, counts, group=self.group)
        counts_in = counts_in.view(ep, n_local)  # (E,) -> (source rank, local expert)
        per_rank = counts.view(ep, n_local).sum(dim=1)  # (E,) -> (ep,): rows to each rank
        # The host needs the sizes to split the rows: one sync per layer, the price of dropless.
        sizes = torch.cat([per_rank, counts_in.sum(dim=1), counts_in.sum(dim=0)]).tolist()
        send_splits, recv_splits, per_expert = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
        received = AllToAll.apply(send, recv_splits, send_splits, self.group)  # (R, C)
        # Received rows come by source rank, then local expert: a stable sort of their local
        # expert index puts them in expert order, each expert's rows by source rank (the global
        # batch's order in the EP group), as one process orders them.
        local = torch.arange(n_local, device=rows.device).repeat(ep)  # (ep * n_local,)
        local = local.repeat_interleave(counts_in.flatten(), output_size=sum(recv_splits))
        by_expert = local.argsort(stable=True)  # (R,)
        out = run_experts(self.experts.values(), received[by_expert], per_expert)
        returned = AllToAll.apply(out[invert(by_expert)], send_splits, recv_splits, self.group)
        return combine(returned, order, gates)  # returned (N*k, C): in send's order


class EP:
    """The strategy behind the few methods the training loop calls: on every rank the GPT with its
    E/EP experts of each layer (ExpertParallel moving the rows), each rank on its own rows."""
    dp_group = None  # the ranks that split the batch, whose losses the loop averages: all

    def __init__(self, config, args, device, state=None):
        replicas = args.data_parallel_size
        ep_size = dist.get_world_size() // replicas
        # The replicas x EP grid: row d is an EP group (consecutive ranks: one node's fast links)
        # that holds every expert once; column e holds expert shard e's replicas.
        self.grid = torch.arange(dist.get_world_size()).view(replicas, ep_size)
        self.ep_group, _ = dist.new_subgroups_by_enumeration(self.grid.tolist())
        self.replica_group, _ = dist.new_subgroups_by_enumeration(self.grid.t().tolist())
        ep_rank = dist.get_rank() % ep_size
        n_local = config.n_experts // ep_size
        held = [str(i) for i in range(ep_rank * n_local, (ep_rank + 1) * n_local)]
        self.model = GPT(config, device="meta")
        for block in self.model.transformer.h:
            experts = block.mlp.experts
            for name in list(experts):
                if name not in held:
                    del experts[name]  # not held here: the names left are the full model's
            block.mlp.dispatch_combine = ExpertParallel(experts, config, self.ep_group)
        # Every tensor's init depends on (seed, name) only: this rank's experts get the values
        # they have in the one-process model, and no broadcast is needed.
        materialize_(self.model, "", config, args.seed, device)
        self.args, self.device = args, device
        if state is not None:  # a full checkpoint from any script: this rank's tensors of it
            self.model.load_state_dict({name: state[name] for name in self.model.state_dict()})
        checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)
        named = list(self.model.named_parameters())
        self.dense_grads = flat_grads([p for name, p in named if ".experts." not in name])
        self.expert_grads = flat_grads([p for name, p in named if ".experts." in name])

    def configure_optimizer(self, args, state=None):
        betas = (args.beta1, args.beta2)
        named = self.model.named_parameters()
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        if state is not None:  # a checkpoint's AdamW state, keyed by parameter name
            for name, p in self.model.named_parameters():
                set_adamw_state(optimizer, p, state[name], self.to_device)
        return optimizer

    def to_device(self, tensor):
        return tensor.to(self.device, copy=True)

    def forward_backward(self, x, y, sync):
        """One micro-step; returns its (loss, aux_loss). sync: the step's last micro-step."""
        with activations.first(), autocast(self.args, self.device):  # the bytes kept for backward
            _, loss = self.model(x, y)
        aux_loss = self.model.aux_loss()
        # Divided by A*N (N: all ranks), backward writes g/(A*N) of this rank's rows; an expert's
        # gradient also gets, through the all-to-all's backward, those of every row of the EP
        # group that chose it. The sums below then make both the mean over the global batch.
        N = dist.get_world_size()
        objective = loss + self.args.aux_loss_coef * aux_loss
        (objective / (self.args.grad_accum_steps * N)).backward()
        if sync:  # the earlier micro-steps only accumulated
            self.sync_gradients()
        return torch.stack([loss, aux_loss]).detach().float()

    def sync_gradients(self):
        # The non-expert gradients (4Pd bytes) summed over all N ranks: each rank's rows are 1/N
        # of the batch. Async, as is the next: the two travel at once.
        works = [dist.all_reduce(self.dense_grads, async_op=True)]
        # The expert gradients (4Pe/EP bytes) summed over the replicas of this rank's shard: each
        # EP group saw 1/replicas of the batch. Without EP x DP each shard is alone: no call.
        if dist.get_world_size(self.replica_group) > 1:
            works.append(dist.all_reduce(self.expert_grads, group=self.replica_group,
                                         async_op=True))
        with timers("all_reduce_wait"):
            for work in works:
                work.wait()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        with autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return loss.float()

    def clip_grad_norm_(self, max_norm):
        # The expert gradients are sharded over the EP group (and equal over the replicas): their
        # squares summed over the group (one fp32 all-reduce, 4 bytes); the rest is equal on every
        # rank and counted once.
        return clip_grad_norm_([self.expert_grads], [self.dense_grads], max_norm, self.ep_group)

    def full_state(self, optimizer):
        """The full checkpoint on rank 0: EP group 0's ranks send their experts (parameters and
        AdamW state, one message a tensor), rank 0 also the rest (gather_to_rank0)."""
        first_group = dist.get_rank() < self.grid.size(1)
        entries = []
        for name, p in self.model.named_parameters():
            if not first_group or (dist.get_rank() != 0 and ".experts." not in name):
                continue  # rank 0 sends it, or (experts) a rank of EP group 0
            values = {"param": p.detach(), **optimizer.state.get(p, {})}
            for key, value in values.items():
                value = value.to(self.device)
                entries.append((name, key, value.shape, value.dtype, lambda value=value: value))
        return gather_to_rank0(entries, first_group, self.model.config, self.device)

    def describe(self):
        replicas, ep_size = self.grid.shape
        config = self.model.config
        return (f"EP {ep_size} x DP {replicas} grid {self.grid.tolist()} (row = EP group), "
                f"{config.n_experts // ep_size} of {config.n_experts} experts a rank, "
                f"top-{config.top_k}, {num_params(self.model) / 1e6:.2f}M params here")


def flat_grads(params):
    """One flat fp32 buffer that the .grads of params are views of: autograd accumulates straight
    into it, and its all-reduce needs no copy in or out."""
    buffer = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    for p, view in zip(params, buffer.split([p.numel() for p in params])):
        p.grad = view.view_as(p)
    return buffer


class TorchEP(peers.torch_ep.TorchEP, EP):
    """--implementation pytorch: torch DDP on the same model, every expert on every rank
    (peers/torch_ep.py); the other methods are EP's."""


def add_ep_flags(group):
    group.add_argument("--data_parallel_size", type=int, default=1,
                       help="replicas of each expert shard (EP = world size / replicas)")


def check_ep_args(args, world_size):
    """Bad input ends every rank with one line, before anything is built. Returns the number of
    ranks that split the batch: all of them."""
    replicas = args.data_parallel_size
    if args.n_experts <= 0:
        die(f"--n_experts: ep_train.py shards the experts: must be > 0, got {args.n_experts}")
    if replicas <= 0 or world_size % replicas:
        die(f"--data_parallel_size: {replicas} must be > 0 and divide the world size "
            f"({world_size})")
    ep_size = world_size // replicas
    if args.n_experts % ep_size:
        die(f"--n_experts: {args.n_experts} must be divisible by the EP size ({ep_size} = world "
            f"size {world_size} / --data_parallel_size {replicas})")
    check_batch_split(args, world_size)
    return world_size


# ---- training ----------------------------------------------------------------------------

def main(argv=None):
    args = parse_args("ep", add_ep_flags, argv)
    D = check_ep_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rank, world_size, device = setup(args)
    setup_data(args)
    ckpt = resume(args)  # None, or a full checkpoint written by any script at any world size
    config = gpt_config(args)
    B, T, A = args.batch_size, args.block_size, args.grad_accum_steps
    dp_rank = rank * D // world_size
    rows = B // D  # rows per data-parallel rank
    micro = rows // A  # rows per micro-step
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this rank's rows of every global batch

    Strategy = EP if args.implementation == "custom" else TorchEP
    model = Strategy(config, args, device, ckpt and ckpt["model"])
    optimizer = model.configure_optimizer(args, ckpt and ckpt["optimizer"])
    start = ckpt["step"] if ckpt else 0
    mfu = MFU(config, args, device, world_size)  # model FLOPs utilisation, per log line
    metrics = Metrics(args.out_dir, rank == 0, args.tensorboard, start_step=start, mfu=mfu)
    if rank == 0:
        print(f"ep ({args.implementation}): {world_size} rank(s) on {device} in {args.dtype}, "
              f"{model.describe()}; global batch {B} x {T} tokens, "
              f"{A} micro-step(s) of {micro} rows per data-parallel rank", flush=True)

    @torch.no_grad()
    def evaluate():
        """Mean loss over eval_iters fixed batches per split: each data-parallel rank evaluates
        its rows of each batch, and the means are averaged over those ranks (equal rows: the
        global mean)."""
        out = {}
        for split in ("train", "val"):
            total = torch.zeros((), device=device)
            for i in range(args.eval_iters):
                x, y = get_batch(split, i, B, T, args.seed + 1, args.dataset)
                x, y = x[mine].to(device), y[mine].to(device)
                total += model.eval_loss(x, y)
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=model.dp_group)
            out[split] = total.item() / args.eval_iters
        return out

    # ---- training loop -------------------------------------------------------------------
    profiler = Profiler(args, rank)
    batches = Batches(args, mine, device)  # the training batches, one step ahead
    for step in range(start, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            metrics.eval(step, evaluate())
        t0 = time.perf_counter()
        lr = get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batches.get(step)  # this rank's rows, on the device
        loss_sum = torch.zeros(2, device=device)  # (loss, aux_loss)
        for j in range(A):  # gradients are synchronised on the last micro-step only
            part = slice(j * micro, (j + 1) * micro)
            loss_sum += model.forward_backward(x[part], y[part], sync=j == A - 1)
        batches.prefetch(step + 1)  # built and copied while the device runs this step
        # Logged loss: the mean over all B*T tokens of the global batch (equal chunks: mean of
        # means).
        loss_sum /= A
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=model.dp_group)
        norm = model.clip_grad_norm_(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # zero in place: gradients that are views stay views
        loss, aux_loss, norm = torch.cat([loss_sum, norm[None]]).tolist()  # the one host sync
        dt = time.perf_counter() - t0  # the step's kernels have run
        metrics.step(step, loss, lr, norm, B * T, dt, device, args.log_interval, aux_loss)
        profiler.step()
        if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0:
            checkpoint(step + 1, model, optimizer, config, args)
    profiler.stop()

    if args.eval_interval:
        metrics.eval(args.max_iters, evaluate())
    checkpoint(args.max_iters, model, optimizer, config, args)
    metrics.summary(model_state_bytes(optimizer), device)
    metrics.close()


if __name__ == "__main__":
    main()
    teardown()  # after main() has returned and its objects are gone
