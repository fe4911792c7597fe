"""One key block of ring attention by SDPA's fused flash kernel, for cp_train.py's and
hybrid_train.py's context parallelism: kernel plumbing, not the lesson (the scripts' fp32 math
path is). The kernel returns each query's lse = log sum_k exp(score) with the block's output, so
blocks merge exactly as the math path's do, and it never builds the (queries x keys) scores.
Taken on CUDA in bf16/fp16 within the kernel's limits (Ampere on, head size <= 256), unless
--deterministic: the flash backward sums dQ/dK/dV with atomics, in any order.
"""
import torch

FUSED = None  # True/False: force the choice (tests: the CPU flash kernel in fp32)
aten = torch.ops.aten


def fused(q):
    """Whether the blocks of these queries take the flash kernel."""
    if FUSED is not None:
        return FUSED
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.size(-1) <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 0)  # flash: Ampere on
            and not torch.are_deterministic_algorithms_enabled())


def block_attention(q, k, v, causal, scale):
    """One block by the flash kernel, inputs in their dtype: out (q's dtype), lse (B, nh, queries,
    1) fp32, and what the CUDA kernel's backward wants back (cum_seq_q/k, max_q/k, philox seed
    and offset: kept and passed back as torch's own ring attention does)."""
    if q.is_cuda:
        out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal,
                                                                   scale=scale)
        return out, lse.unsqueeze(-1), rest[:6]  # rest[6]: the debug mask, not asked for
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.unsqueeze(-1), []


def block_backward(dout, q, k, v, out, lse, causal, scale, rest):
    """dq, dk, dv of one block by the flash kernel, from the FINAL out and lse of these queries:
    its exp(s - lse) and dS = P (dP - rowsum(dout * out)) are the block's share of the softmax."""
    args = dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.squeeze(-1).contiguous()
    if q.is_cuda:
        return aten._scaled_dot_product_flash_attention_backward(
            *args, *rest[:4], 0.0, causal, *rest[4:], scale=scale)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, 0.0, causal,
                                                                     scale=scale)
