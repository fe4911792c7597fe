"""--dtype bfloat16 for every script, custom and pytorch, at 2 ranks: the loss tracks the fp32
single-process reference, and the custom strategies move what they say in bf16 (fsdp's all-gather of
parameters, zero3's broadcast of parameters, tp's all-reduce of activations, cp's ring of K/V), with gradients reduced
in fp32 everywhere.

Tolerance. bf16 keeps 8 significant bits, a relative rounding of 2^-9 = 0.2% per value. The weights,
gradients and AdamW state stay fp32; bf16 enters through the inputs of the matmuls and attention of
each forward and backward, and the loss is a mean over B*T = 256 tokens, over which those roundings
largely average out. Measured here (the parity config: 15 steps, 2 ranks, CPU; each run prints its
figure), the largest |loss_bf16 - loss_fp32| of the 10 runs was 6e-4 (fsdp and zero3), 1e-4 to 2e-4
for the others. TOL = 5e-3 is 8 times that, room for other CPUs' bf16 kernels, and far below what a
wrong strategy does: the loss falls by 0.17 a step on average here, so a step trained on the wrong
rows, shards or learning rate moves it by 1e-2 or more. What the loss cannot show (a sum of
gradients over ranks rounded to bf16 would differ by about 1e-4 at 2 ranks) the collective counts do.
"""
import pytest

from conftest import PARITY, PARITY_STEPS, peer_needs, probe, step_losses

FLAGS = PARITY + ["--max_iters", str(PARITY_STEPS)]
TOL = 5e-3
RUNS = [(s, i) for s in ["ddp_train.py", "fsdp_train.py", "zero3_train.py", "tp_train.py", "pp_train.py"]
        for i in ("custom", "pytorch") if (s, i) != ("zero3_train.py", "pytorch")] + [("cp_train.py", "custom")]
# Not zero3's pytorch: it is FSDP2 with fsdp's MixedPrecisionPolicy, run as fsdp's. cp's pytorch: CUDA only.
# What each custom strategy must send in bf16: "collective:dtype" keys of tests/probe.py's counts.
BF16_TRAFFIC = {"fsdp_train.py": "all_gather_single:torch.bfloat16", "zero3_train.py": "broadcast:torch.bfloat16",
                "tp_train.py": "all_reduce:torch.bfloat16", "cp_train.py": "batch_isend_irecv:torch.bfloat16"}  # ring's K/V
# Gradients are reduced in fp32 by every script (no bf16 rounding of a sum over ranks).
FP32_GRADIENTS = {"ddp_train.py": "all_reduce:torch.float32", "fsdp_train.py": "reduce_scatter_single:torch.float32",
                  "zero3_train.py": "reduce:torch.float32", "cp_train.py": "all_reduce:torch.float32"}


@pytest.mark.parametrize("script,implementation", [pytest.param(*r, marks=peer_needs(*r, "bfloat16")) for r in RUNS],
                         ids=[f"{s[:-9]}-{i}" for s, i in RUNS])
def test_bf16_tracks_fp32_and_sends_bf16(script, implementation, shared_run, tmp_path):
    reference = step_losses(shared_run("ddp_train.py", None, FLAGS)[0])
    ranks = probe(script, 2, [*FLAGS, "--dtype", "bfloat16", "--implementation", implementation,
                              "--out_dir", str(tmp_path)], tmp_path)
    losses = step_losses(tmp_path)
    delta = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"{script} {implementation} bf16: max |loss - fp32 reference| over {len(losses)} steps = {delta:.4f}")
    assert len(losses) == PARITY_STEPS and delta <= TOL
    sent = [r["collectives"] for r in ranks]
    if implementation == "custom" and script in BF16_TRAFFIC:
        assert all(s.get(BF16_TRAFFIC[script], 0) > 0 for s in sent), sent
    if implementation == "custom" and script in FP32_GRADIENTS:
        assert all(s.get(FP32_GRADIENTS[script], 0) > 0 for s in sent), sent
    if script == "ddp_train.py":  # the replicas stay bit-identical under bf16 too
        assert ranks[0]["digests"] == ranks[1]["digests"]
