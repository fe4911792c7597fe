"""PyTorch's own 4D parallelism, for hybrid_train.py --implementation pytorch.

init_device_mesh(dp, pp, cp, tp) lays the ranks out as hybrid_train.py's grid and makes its groups
(Grid); DTensor's parallelize_module places a plain GPT stage's linears and embeddings by
peers/torch_tp.py's plan (StageGPT's ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding, SP's LayerNorms), and loss_parallel() computes the vocab-parallel
cross-entropy (VocabParallelCrossEntropy); torch.distributed.pipelining's PipelineStage and
Schedule1F1B run the stages (Hybrid.p2p and its 1F1B loop). The tied wte/lm_head's two ends
sum their local shards' gradients, as Hybrid.finish_gradients does.
DP is one flat all-reduce (a SUM: each loss is pre-divided by dp) of the local gradients over the
mesh's dp group after the last micro-step, as Hybrid's. FSDP2's replicate
(torch.distributed._composable.replicate_with_fsdp), which the pipeline stage knows, gives the
same losses, but on torch 2.13 its hooks keep the dp group alive past destroy_process_group
(teardown's warning); fully_shard would shard the stage over dp, which the checkpoint gathering
and the norm here do not expect.
CP: torch's context_parallel needs CUDA's SDPA kernels and is not composed with the pipeline here:
--context_parallel_size > 1 is one error (check_args). These are the methods that differ;
hybrid_train.py's TorchHybrid takes the rest (describe, full_state) from its Hybrid class."""
import types
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from common.checkpoint import set_adamw_state
from common.config import check_torch, die
from common.distributed import autocast, clip_grad_norm_
from common.metrics import activations
from common.model import GPT, compile_forward, configure_optimizer, init_tensor
from common.recompute import torch_checkpoint_blocks
from peers.torch_tp import local, local_output, replicated_input

AXES = ("dp", "pp", "cp", "tp")
WTE_NAME = "transformer.wte.weight"


def check_args(args, sizes):
    if args.implementation != "pytorch":
        return
    check_torch("2.10", "--implementation: pytorch (torch.distributed.pipelining)",
                "on 2.9 its first step's shape inference fails: received data size doesn't match")
    if sizes["cp"] > 1:
        die("--context_parallel_size: --implementation pytorch has no context parallelism: "
            "torch's context_parallel needs CUDA SDPA kernels (flash/efficient/cudnn), and this "
            "peer does not compose it with torch's pipelining; use --implementation custom")


# ---- the stage: a plain GPT piece, then placed on the TP mesh --------------------------------

def rank_ordered(full, tp_size):
    """c_attn's [q; k; v] rows as [q_0; k_0; v_0; q_1; ...]: DTensor's contiguous row chunks then
    hold whole heads, each rank its own heads' q, k and v."""
    return full.unflatten(0, (3, tp_size, -1)).transpose(0, 1).flatten(0, 2)


def head_ordered(full, tp_size):
    """The inverse of rank_ordered()."""
    return full.unflatten(0, (tp_size, 3, -1)).transpose(0, 1).flatten(0, 2)


def local_heads_forward(attn, x):
    """GPT's attention on this TP rank's n_head/tp heads: c_attn's local output is their q, k, v
    for every position (with SP, x is the rank's (b, T/tp, C) and c_attn all-gathers it)."""
    qkv = attn.c_attn(x)  # (b, T, 3C/tp)
    b, T, _ = qkv.shape
    q, k, v = qkv.chunk(3, dim=2)  # each (b, T, C/tp)
    q = q.view(b, T, attn.n_head, -1).transpose(1, 2)  # (b, nh/tp, T, hs)
    k = k.view(b, T, attn.n_head, -1).transpose(1, 2)  # (b, nh/tp, T, hs)
    v = v.view(b, T, attn.n_head, -1).transpose(1, 2)  # (b, nh/tp, T, hs)
    y = attn.attend(q, k, v)
    y = y.transpose(1, 2).reshape(b, T, -1)  # (b, nh/tp, T, hs) -> (b, T, C/tp)
    return attn.resid_dropout(attn.c_proj(y))  # (b, T, C), or (b, T/tp, C) with SP


class TorchStage(nn.Module):
    """Pipeline stage `stage` of the unchanged GPT, full size: its blocks (GPT's names), wte/wpe
    on the first stage, ln_f and lm_head on the last. lm_head is wte itself on a single stage,
    else a copy of it. Every rank builds its stage whole from init_tensor or the full state_dict
    `state`; parallelize_stage() then keeps its TP rank's pieces."""

    def __init__(self, config, stage, n_stages, tp_size, seed, device, state=None):
        super().__init__()
        self.first, self.last = stage == 0, stage == n_stages - 1
        full = GPT(config, device="meta")
        self.full_shapes = {n: p.shape for n, p in full.named_parameters()}  # for the checkpoint
        per_stage = config.n_layer // n_stages
        blocks = {}
        for i in range(stage * per_stage, (stage + 1) * per_stage):
            block = full.transformer.h[i]
            block.attn.n_head //= tp_size  # this rank's heads
            block.attn.forward = types.MethodType(local_heads_forward, block.attn)
            blocks[str(i)] = block
        pieces = dict(h=nn.ModuleDict(blocks))
        if self.first:
            pieces.update(wte=full.transformer.wte, wpe=full.transformer.wpe,
                          drop=full.transformer.drop)
        if self.last:
            pieces.update(ln_f=full.transformer.ln_f)
        self.transformer = nn.ModuleDict(pieces)
        if self.last:  # after transformer, as in GPT: a single stage's tied tensor is named wte
            self.lm_head = full.lm_head
        self.to_empty(device=device)
        self.tie_weights()
        with torch.no_grad():
            for name, p in self.named_parameters():
                name = WTE_NAME if name == "lm_head.weight" else name  # the copy starts as wte
                if state is not None:
                    value = state[name]
                else:
                    value = init_tensor(name, self.full_shapes[name], config, seed)
                if "c_attn" in name:
                    value = rank_ordered(value, tp_size)
                p.copy_(value)

    def tie_weights(self):
        if self.first and self.last:  # one stage: the tie is one tensor
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, x):
        """Token ids on the first stage, else the stage before's output (this TP rank's sequence
        shard with SP); the last stage returns this TP rank's logits, (b, T, vocab/tp)."""
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(pos))
        for block in self.transformer.h.values():
            x = block(x)
        if not self.last:
            return x
        return self.lm_head(self.transformer.ln_f(x))


def parallelize_stage(stage, tp_mesh, sequence_parallel):
    """peers/torch_tp.py's plan on the modules this stage has; the logits stay split by vocabulary
    (local: pipelining passes plain tensors), for loss_parallel()."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the activations between the linears
    col = ColwiseParallel(input_layouts=seq)
    row = RowwiseParallel(output_layouts=seq)
    plan = {}
    for i in stage.transformer.h:
        block = f"transformer.h.{i}."
        plan[block + "attn.c_attn"] = col
        plan[block + "attn.c_proj"] = row
        plan[block + "mlp.c_fc"] = col
        plan[block + "mlp.c_proj"] = row
    if stage.first:
        plan["transformer.wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if stage.last:
        plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1))
    if sequence_parallel:  # LayerNorms on sequence shards; wpe's output reduce-scattered by T
        for name, _ in stage.named_modules():
            if ".ln_" in name or name == "transformer.ln_f":
                plan[name] = SequenceParallel()
        if stage.first:
            plan["transformer.wpe"] = RowwiseParallel(input_layouts=Replicate(),
                                                      output_layouts=Shard(0))
    # every rank holds the whole stage: each keeps its pieces, no communication
    parallelize_module(stage, tp_mesh, plan, src_data_rank=None)
    stage.tie_weights()  # parallelize_module gives wte and lm_head separate DTensor Parameters
    # The modules the plan leaves alone get Replicate DTensor parameters, as in torch_tp.py
    for module in stage.modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, input_fn=replicated_input, output_fn=local_output)


# ---- the strategy behind the loop's methods ------------------------------------------------

class TorchHybrid:
    def __init__(self, config, args, device, state=None):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        self.config, self.args, self.device = config, args, device
        sizes = dict(dp=args.data_parallel_size, pp=args.pipeline_parallel_size,
                     cp=args.context_parallel_size, tp=args.tensor_parallel_size)
        self.mesh = init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=AXES)
        coords = dict(zip(AXES, self.mesh.get_coordinate()))
        self.grid = types.SimpleNamespace(size=sizes, coords=coords)  # Hybrid's names for them
        if args.print_grid and dist.get_rank() == 0:
            print(self.mesh, flush=True)
        self.tp_mesh = self.mesh["tp"]
        self.tp_size = sizes["tp"]
        self.M = args.n_microbatches
        stage, n_stages = coords["pp"], sizes["pp"]
        self.model = TorchStage(config, stage, n_stages, self.tp_size, args.seed, device, state)
        parallelize_stage(self.model, self.tp_mesh, args.sequence_parallel)
        # --compile: each block's forward, DTensor's collectives traced, as in torch_tp.py
        compile_forward(self.model.transformer.h.values(), args.compile)
        torch_checkpoint_blocks(self.model.transformer.h.values(), args.activation_checkpointing)
        self.dp_group = self.mesh.get_group("dp")
        # the gradient norm's group: the ranks of my (dp, cp) place, every stage and TP shard
        self.norm_group = self.mesh["pp", "tp"]._flatten().get_group()
        self.tied_group = None
        if n_stages > 1:  # the pp ends of each (dp, cp, tp) place
            ends = self.mesh.mesh[:, [0, -1]].permute(0, 2, 3, 1).reshape(-1, 2).tolist()
            self.tied_group, _ = dist.new_subgroups_by_enumeration(ends)
        pipeline_stage = PipelineStage(self.model, stage, n_stages, device,
                                       group=self.mesh.get_group("pp"))
        # Pre-scaled like Hybrid's loss: a micro-batch is 1/(M*A) of my rows, and the dp ranks
        # summed hold equal shares, so the dp sum of the gradients below is their mean
        self.loss_scale = 1.0 / (args.grad_accum_steps * self.M * sizes["dp"])
        self.schedule = Schedule1F1B(pipeline_stage, self.M, loss_fn=self.scaled_loss,
                                     scale_grads=False)
        self.loss_ranks = sizes["dp"] * sizes["cp"] * sizes["tp"]

    def scaled_loss(self, logits, targets):
        """The mean cross-entropy from this rank's vocab/tp logit columns, under loss_parallel()."""
        # fp32 kept here: loss_parallel's log-softmax returns the logits' dtype (bf16 under
        # --dtype bfloat16), where the hand-written loss sums in fp32 chunk by chunk
        logits = logits.flatten(0, 1).float()  # (b*T, vocab/tp)
        logits = DTensor.from_local(logits, self.tp_mesh, [Shard(1)], run_check=False)
        loss = F.cross_entropy(logits, targets.flatten())
        return loss.to_local() * self.loss_scale

    def configure_optimizer(self, args, state=None):
        named = list(self.model.named_parameters())
        betas = (args.beta1, args.beta2)
        optimizer = configure_optimizer(named, args.weight_decay, args.learning_rate, betas)
        if state:  # a checkpoint's AdamW state, keyed by GPT name: this rank's DTensor piece
            for name, p in named:
                name = WTE_NAME if name == "lm_head.weight" else name
                set_adamw_state(optimizer, p, state[name],
                                lambda full, n=name, p=p: self.local_piece(n, p, full))
        return optimizer

    def local_piece(self, name, p, full):
        if "c_attn" in name:
            full = rank_ordered(full, self.tp_size)
        full = full.to(self.device, copy=True)
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)

    def run_schedule(self, run, x, y):
        """run: the schedule's step (forwards and backwards) or eval (forwards only), over M
        micro-batches of x (token ids, into the first stage) and y (targets, for the last stage's
        loss). Returns the mean of their losses on the last stage, else 0."""
        losses = []  # each scaled by 1/(M*A*dp)
        inputs = [x] if self.model.first else []
        targets = dict(target=y, losses=losses) if self.model.last else {}
        with loss_parallel(), autocast(self.args, self.device):  # loss_parallel: backward too
            run(*inputs, **targets)
        if not self.model.last:
            return torch.zeros((), device=self.device)
        scale_back = self.args.grad_accum_steps * self.grid.size["dp"]  # loss_scale less its 1/M
        return torch.stack(losses).sum().detach().float() * scale_back

    def forward_backward(self, x, y, sync):
        with activations.first():
            loss = self.run_schedule(partial(self.schedule.step, return_outputs=False), x, y)
        if sync:  # else the gradients accumulate (gradient accumulation's no_sync)
            self.finish_gradients()
        return loss

    def finish_gradients(self):
        """After the last micro-step: each gradient in its parameter's placement (SP's partial
        sums summed over TP), summed over dp (one flat all-reduce, 4 bytes a local parameter),
        and the tied wte/lm_head's two ends summed (vocab/tp*C numbers)."""
        params = list(self.model.parameters())
        for p in params:
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)
        grads = [local(p.grad) for p in params]
        if self.grid.size["dp"] > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)  # pre-divided by dp: sum = mean
            for g, flat_g in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(flat_g.view_as(g))
        if self.tied_group is not None and (self.model.first or self.model.last):
            head = self.model.lm_head if self.model.last else self.model.transformer.wte
            dist.all_reduce(local(head.weight.grad), group=self.tied_group)

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        loss = self.run_schedule(self.schedule.eval, x, y)
        self.model.train()
        return loss

    def clip_grad_norm_(self, max_norm):
        # Squares of the sharded gradients summed over the (pp, tp) ranks; a replicated one counts
        # on TP rank 0 only, the head's copy of wte never; every gradient is clipped.
        counted = []
        tp_rank = self.grid.coords["tp"]
        for name, p in self.model.named_parameters():
            sharded = any(placement.is_shard() for placement in p.placements)
            if name != "lm_head.weight" and (sharded or tp_rank == 0):
                counted.append(local(p.grad))
        norm = clip_grad_norm_(counted, [], 0, self.norm_group)  # 0: measure only
        if max_norm > 0:  # clip_grads_with_norm_'s factor, on the local gradients
            clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in self.model.parameters():
                local(p.grad).mul_(clip)
        return norm

    def full_tensor(self, name, tensor):
        if isinstance(tensor, DTensor):  # all-gathers over TP
            tensor = tensor.full_tensor()
            if "c_attn" in name:
                tensor = head_ordered(tensor, self.tp_size)
        return tensor
