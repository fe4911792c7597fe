"""PyTorch's own pipeline, for pp_train.py (and its copies pp_zb_train.py, pp_vocab_train.py)
--implementation pytorch.

torch.distributed.pipelining: a PipelineStage around each of this rank's chunks (the script's
Stage modules) does the send/recv, and ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B /
ScheduleInterleavedZeroBubble (zb1p) / ScheduleZBVZeroBubble (zbv) order the forwards and backwards
(the zero-bubble ones, pp_zb_train.py's, split by torch's own stage_backward_input/_weight), in
place of the script's schedule_actions, timetable and executor (Pipeline.run). These are the
methods that differ; the script's TorchPipeline takes the rest (building the chunks, evaluation,
the tied gradient, clipping, checkpoint state) from its Pipeline class."""
import torch

from common.config import check_torch, die
from common.distributed import autocast
from common.recompute import torch_checkpoint_blocks
from common.model import cross_entropy


def check_args(args):
    """What torch's pipelining needs, on gloo, beyond the floor and the script's own checks: called
    by the scripts' check_pp_args, so bad input ends every rank before anything is built."""
    if args.implementation != "pytorch":
        return
    zero_bubble = args.schedule in ("zb1p", "zbv")  # pp_zb_train.py's
    if zero_bubble and args.compile:  # torch 2.13
        die("--compile: torch's zero-bubble schedules split a block's backward into two "
            "autograd calls (B keeps the graph for W: retain_graph), which a compiled "
            "backward refuses (donated buffers); use --compile false, --implementation "
            "custom, or another --schedule")
    if zero_bubble:
        args.compile = False  # the default: off here
    if zero_bubble and args.activation_checkpointing != "none":  # torch 2.13, docs/pp.md
        die("--activation_checkpointing: torch's zero-bubble schedule cannot split the backward "
            "of a checkpointed block into B and W (its stage_backward_weight fails); use "
            "--activation_checkpointing none, --implementation custom, or another --schedule")
    check_torch("2.10", "--implementation: pytorch (torch.distributed.pipelining)",
                "on 2.9 its first step's shape inference fails: received data size doesn't match")
    if args.dtype == "bfloat16":
        check_torch("2.11", "--dtype: bfloat16 with --implementation pytorch",
                    "on 2.10 no gradient reaches the last stage's lm_head under autocast")
    if args.schedule == "zbv":
        check_torch("2.12", "--schedule: zbv with --implementation pytorch",
                    "on 2.10 and 2.11 its ScheduleZBVZeroBubble fails on gloo: "
                    "Pair is not connected")


class TorchPipeline:
    checkpoint_blocks = staticmethod(torch_checkpoint_blocks)  # Pipeline.__init__ applies it

    @staticmethod
    def defer_weight_grads(chunk, store):
        """pp_zb_train.py's zb1p and zbv: nothing to do here, torch's schedule splits each backward
        into B and W itself (stage_backward_input, stage_backward_weight), through autograd."""

    def __init__(self, config, args, device, state=None):
        super().__init__(config, args, device, state)  # Pipeline's: this rank's chunks and groups
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B,
                                                  ScheduleInterleavedZeroBubble,
                                                  ScheduleZBVZeroBubble)
        stages = []
        for c, chunk in enumerate(self.chunks):  # chunk c: global stage c*pp_size + r, or V-shaped
            stages.append(PipelineStage(chunk, self.stage_of(c), self.n_stages, device))
        # The loss pre-scaled like Pipeline's: torch's scale_grads would also divide the .grad of
        # earlier micro-steps.
        self.loss_scale = 1.0 / (args.grad_accum_steps * self.M)
        options = dict(scale_grads=False, loss_fn=self.scaled_loss)
        if args.schedule == "interleaved":  # all of this rank's stages
            self.schedule = ScheduleInterleaved1F1B(stages, self.M, **options)
        elif args.schedule == "zb1p":  # torch's zero bubble, B and W split by its own autograd
            self.schedule = ScheduleInterleavedZeroBubble(stages, self.M, **options)
        elif args.schedule == "zbv":
            self.schedule = ScheduleZBVZeroBubble(stages, self.M, **options)
        elif args.schedule == "1f1b":
            self.schedule = Schedule1F1B(stages[0], self.M, **options)
        else:
            self.schedule = ScheduleGPipe(stages[0], self.M, **options)

    def scaled_loss(self, logits, targets):
        loss = cross_entropy(logits.flatten(0, 1), targets.flatten())  # the scripts' own loss
        return loss * self.loss_scale

    def forward_backward(self, x, y, sync):
        last = self.rank == self.loss_rank
        losses = []
        inputs = [x] if self.rank == 0 else []  # token ids enter at the first stage
        targets = dict(target=y, losses=losses) if last else {}  # the loss is the last stage's
        with autocast(self.args, self.device):
            self.schedule.step(*inputs, **targets)
        if sync:
            self.sum_tied_gradient()
        if not last:
            return torch.zeros((), device=self.device)
        loss_sum = torch.stack(losses).sum().detach()
        return loss_sum * self.args.grad_accum_steps  # the losses were scaled by 1/(A*M)
