"""PyTorch's own tensor parallelism, for tp_train.py --implementation pytorch.

torch.distributed.tensor.parallel's parallelize_module makes the unchanged GPT's parameters DTensors
on the TP mesh, with the split tp_train.py's TPGPT writes by hand: ColwiseParallel for c_attn and
c_fc (CopyToTP's f), RowwiseParallel for the c_projs and the vocabulary-split wte (ReduceFromTP's
g), SequenceParallel LayerNorms with --sequence_parallel; torch's loss_parallel() computes the
vocab-parallel cross-entropy (VocabParallelCrossEntropy) and DTensor.full_tensor() gathers the
checkpoint (full_tensor). These are the methods that differ; tp_train.py's TorchTP takes the rest
(the grid's dropout streams, the DP sum, optimizer, checkpoint format, describe) from its
TensorParallel class, and gives this class the script's head split (shard, unshard), attention
(TPAttention) and dropout fork (fork_dropouts)."""
import types
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from common.distributed import autocast, clip_grad_norm_
from common.metrics import activations
from common.model import GPT, compile_forward
from common.recompute import torch_checkpoint_blocks


def parallelize_torch(model, tp_mesh, sequence_parallel, loss_parallel):
    """The GPT made tensor-parallel in place: every linear and embedding placed by a DTensor plan
    (c_attn's rows already rank-ordered: TorchTP.rank_ordered)."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the activations between the linears
    col = ColwiseParallel(input_layouts=seq)
    row = RowwiseParallel(output_layouts=seq)
    logits_layout = Shard(-1) if loss_parallel else Replicate()
    plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=logits_layout,
                                       use_local_output=not loss_parallel)}
    for i in range(len(model.transformer.h)):
        block = f"transformer.h.{i}."
        plan[block + "attn.c_attn"] = col
        plan[block + "attn.c_proj"] = row
        plan[block + "mlp.c_fc"] = col
        plan[block + "mlp.c_proj"] = row
    if sequence_parallel:  # LayerNorms on sequence shards; wpe's output reduce-scattered by T
        for name, _ in model.named_modules():
            if ".ln_" in name:
                plan[name] = SequenceParallel()
        by_position = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        plan["transformer.wpe"] = by_position
    parallelize_module(model, tp_mesh, plan)
    model.tie_weights()  # parallelize_module gives wte and lm_head separate DTensor Parameters
    # AdamW's multi-tensor paths (foreach, its default on CUDA, and fused) update all parameters in
    # one call, which refuses a mix of DTensor and Tensor. So, as torchtitan does, the modules the
    # plan leaves alone (without SP: the LayerNorms and wpe) get Replicate DTensor parameters too:
    # distribute_module replicates them (each rank keeps its own equal copy: no communication),
    # their input becomes a Replicate DTensor and their output local again. The arithmetic is
    # unchanged, and their gradients come back Replicate: the full gradient on every TP rank, as the
    # plain tensors' did.
    for module in model.modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, input_fn=replicated_input, output_fn=local_output)


def replicated_input(module, inputs, mesh):
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def local_output(module, output, mesh):
    return output.to_local()


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class TorchTP:
    """GPT's parameters become DTensors on the TP mesh (the same column/row/vocabulary split as
    TPGPT's, SequenceParallel LayerNorms), torch's loss_parallel() computes the vocab-parallel
    cross-entropy; the DP group sums the local gradients with one all-reduce."""

    def __init__(self, config, args, device, state=None):
        self.args, self.device = args, device
        self.tp_size = args.tensor_parallel_size
        self.grid = torch.arange(dist.get_world_size()).view(-1, self.tp_size)  # D x tp_size
        mesh = init_device_mesh(device.type, tuple(self.grid.shape), mesh_dim_names=("dp", "tp"))
        self.tp_group = mesh.get_group("tp")
        self.dp_group = mesh.get_group("dp")
        self.share_rng(resumed=state is not None)
        self.model = GPT(config, seed=args.seed, device=device)
        if state is not None:
            self.model.load_state_dict(state)
        self.use_local_heads(self.model, mesh["tp"].get_local_rank())
        with torch.no_grad():  # ColwiseParallel's contiguous chunks: whole heads per rank
            for name, p in self.model.named_parameters():
                if "c_attn" in name:
                    p.copy_(self.rank_ordered(name, p))
        parallelize_torch(self.model, mesh["tp"], args.sequence_parallel, args.loss_parallel)
        # --compile: each block's forward with the plan's hooks of its modules: DTensor's
        # collectives are traced (torch's functional collectives), as torchtitan compiles blocks;
        # SDPA runs eagerly, as in TensorParallel (its dropout's tp_rank_rng)
        compile_forward(self.model.transformer.h, args.compile, eager=["attn.attend"])
        torch_checkpoint_blocks(self.model.transformer.h, args.activation_checkpointing)

    def rank_ordered(self, name, full):
        """c_attn's [q; k; v] rows in rank order [q_0; k_0; v_0; q_1; ...] (every rank's shard(),
        stacked), so that DTensor's contiguous chunks hold whole heads."""
        if "c_attn" not in name:
            return full
        return torch.cat([self.shard(name, full, r, self.tp_size) for r in range(self.tp_size)])

    def head_ordered(self, name, full):
        """The inverse of rank_ordered(): unshard() of the stacked shards."""
        return self.unshard(name, full.chunk(self.tp_size))

    def use_local_heads(self, model, tp_rank):
        """The plain GPT's attentions run the script's TPAttention.forward on this rank's
        n_head/tp_size heads, and with SP its dropouts draw from the rank's own stream, as in
        TPGPT."""
        for block in model.transformer.h:
            block.attn.n_head = block.attn.n_head // self.tp_size
            block.attn.tp_rank = tp_rank
            block.attn.forward = types.MethodType(self.attention.forward, block.attn)
            block.attn.attend = types.MethodType(self.attention.attend, block.attn)
        if self.args.sequence_parallel:
            self.fork_dropouts(model, tp_rank)

    def local_piece(self, name, p, full):
        """DTensor: each rank cuts its piece from its own full copy (src_data_rank=None: no
        communication)."""
        if not isinstance(p, DTensor):
            return torch.empty_like(p).copy_(full)
        full = self.rank_ordered(name, full).to(self.device, copy=True)
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)

    def forward_backward(self, x, y, sync):
        # torch's loss_parallel() covers forward and backward
        vocab_parallel = loss_parallel() if self.args.loss_parallel else nullcontext()
        with vocab_parallel:
            with activations.first(), autocast(self.args, self.device):
                _, loss = self.model(x, y)
            (loss / (self.args.grad_accum_steps * len(self.grid))).backward()  # see sum_over_dp
        if sync:
            # Gradients may come back in another placement than their parameter: SequenceParallel's
            # LayerNorms (and the row biases') as Partial(sum), the sharded wpe's as Replicate.
            params = list(self.model.parameters())
            for p in params:
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(placements=p.placements)
            self.sum_over_dp([local(p.grad) for p in params])
        return local(loss).detach().float()

    @torch.no_grad()
    def eval_loss(self, x, y):
        self.model.eval()
        vocab_parallel = loss_parallel() if self.args.loss_parallel else nullcontext()
        with vocab_parallel, autocast(self.args, self.device):
            _, loss = self.model(x, y)
        self.model.train()
        return local(loss).float()

    def clip_grad_norm_(self, max_norm):
        sharded, replicated = [], []
        for p in self.model.parameters():
            if isinstance(p, DTensor) and any(s.is_shard() for s in p.placements):
                sharded.append(local(p.grad))
            else:
                replicated.append(local(p.grad))
        return clip_grad_norm_(sharded, replicated, max_norm, self.tp_group)

    def full_tensor(self, name, t):
        if isinstance(t, DTensor):  # full_tensor() all-gathers; c_attn's rows are put back in order
            t = t.full_tensor()
            if "c_attn" in name:
                t = self.head_ordered(name, t)
        return t
