#!/usr/bin/env bash
# Our scripts at world size 1 on one GPU (bf16, GPT-2 124M, 12 x 1024 tokens a step) against
# nanoGPT's train.py in the same call, in priority order, and kernel profiles of ddp and nanoGPT
# (docs/benchmarks/h100_2026-11-26.md); each row is appended to $OUT/table.txt as it finishes, so a
# cut-off run still reports what it measured. From the project root, with .gpu/ holding
# data/tinyshakespeare/input.txt and tiktoken_cache/, and nanoGPT's train.py, model.py and
# configurator.py copied into .gpu/nanogpt/:  bash tests/gpu/bench.sh
export PYTHONUNBUFFERED=1
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
G=$PWD/.gpu  # the carried data, tiktoken cache and nanoGPT
H=$PWD/tests/gpu  # this folder
export TIKTOKEN_CACHE_DIR=$G/tiktoken_cache
mkdir -p data/shakespeare && cp $G/data/tinyshakespeare/input.txt data/shakespeare/
T=${OUT:-/tmp}/table.txt; L=${OUT:-/tmp}/logs; mkdir -p $L; : > $T
say() { echo "$*" | tee -a $T; }
say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
say "$(python3 -c "import torch, triton; print('torch', torch.__version__, triton.__version__)")"
ITERS=${ITERS:-30}
FLAGS="--preset ${PRESET:-gpt2} --bias false --batch_size ${BS:-12} --max_iters $ITERS"
FLAGS="$FLAGS --warmup_iters 2 --eval_interval 0 --log_interval 100 --tensorboard false"
row() {  # row NAME LIMIT SCRIPT FLAGS...
  local name=$1 limit=$2 script=$3; shift 3
  local t0=$SECONDS
  timeout $limit torchrun --standalone --nproc_per_node=1 "$script" $FLAGS "$@" \
    --out_dir "/tmp/gs/$name" >"$L/$name.log" 2>&1
  local rc=$?
  python3 - "$name" "$rc" "/tmp/gs/$name/metrics.jsonl" "$L/$name.log" $((SECONDS - t0)) \
    <<'PY' | tee -a $T
import json, sys, re
name, rc, path, log, wall = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
try:
    rows = [json.loads(l) for l in open(path) if l.strip()]
except OSError:
    rows = []
steps = [r for r in rows if "loss" in r and "step" in r]
summ = next((r for r in rows if r.get("summary")), {})
tps, mfu, peak = summ.get("tokens_per_sec"), summ.get("mfu"), summ.get("peak_mem_bytes")
err = ""
if rc:
    lines = [l.strip() for l in open(log, errors="replace") if re.search(r"Error|error:", l)]
    err = (lines[-1] if lines else f"exit {rc}")[:150]
loss = f"{steps[-1]['loss']:.4f}" if steps else "-"
mfu_s = ('%.1f%%' % (100 * mfu)) if mfu else '-'
peak_s = f"{peak / 2**30:.1f}G" if peak else "-"
print(f"{name:28s} rc={rc:<3d} loss {loss:>7s} {tps or 0:>9,.0f} tok/s mfu {mfu_s:>6s} "
      f"peak {peak_s:>6s} wall {wall}s {err}")
PY
}
nano() {  # nano NAME LIMIT FLAGS...: nanoGPT's train.py, same data/model/batch, median of steps 5+
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  (cd $G/nanogpt && ln -sfn ../../data data && timeout $limit python3 train.py \
    --dataset=shakespeare \
    --batch_size=12 --block_size=1024 --gradient_accumulation_steps=1 --bias=False --eval_iters=1 \
    --eval_interval=100000 --log_interval=1 --max_iters=$ITERS --out_dir=/tmp/nano "$@") \
    >"$L/$name.log" 2>&1
  local rc=$?
  python3 - "$name" "$rc" "$L/$name.log" $((SECONDS - t0)) <<'PY' | tee -a $T
import re, statistics, sys
name, rc, log, wall = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
its = [(int(m[1]), float(m[2]), float(m[3])) for m in
       re.finditer(r"iter (\d+): loss ([\d.]+), time ([\d.]+)ms",
                   open(log, errors="replace").read())]
ms = [t for i, _, t in its if i >= 5]
tps = 12 * 1024 / (statistics.median(ms) / 1000) if ms else 0
loss = f"{its[-1][1]:.4f}" if its else "-"
print(f"{name:28s} rc={rc:<3d} loss {loss:>7s} {tps:>9,.0f} tok/s (nanoGPT train.py) wall {wall}s")
PY
}
E="--compile false"
prof() {  # prof NAME TRACE: kernels per step, GPU busy ms per step, top kernels
  say "== profile $1"; python3 $H/kern.py $2 3 14 | tee -a $T
}
row ddp-eager 100 ddp_train.py --dtype bfloat16 $E
nano nanogpt-eager 100 --compile=False --dtype=bfloat16
row ddp-compiled 200 ddp_train.py --dtype bfloat16
row ddp-eager-prof 100 ddp_train.py --dtype bfloat16 $E --profile true --max_iters 6
prof ours-ddp-eager "$(ls /tmp/gs/ddp-eager-prof/profile/*.json | head -1)"
timeout 100 python3 $H/nanoprof.py $G/nanogpt /tmp/nanoprof.json > $L/nanoprof.log 2>&1
prof nanogpt-eager /tmp/nanoprof.json
row tp-eager 100 tp_train.py --dtype bfloat16 $E
row fsdp-compiled 200 fsdp_train.py --dtype bfloat16
row zero3-s2-compiled 200 zero3_train.py --dtype bfloat16 --stage 2
row pp-mb1-eager 100 pp_train.py --dtype bfloat16 --n_microbatches 1 $E
row hybrid-eager 100 hybrid_train.py --dtype bfloat16 $E
nano nanogpt-compiled 200 --compile=True --dtype=bfloat16
row zero3-eager 100 zero3_train.py --dtype bfloat16 $E
row zero3-eager-prof 100 zero3_train.py --dtype bfloat16 $E --profile true --max_iters 6
prof ours-zero3-eager "$(ls /tmp/gs/zero3-eager-prof/profile/*.json | head -1)"
row fsdp-eager 100 fsdp_train.py --dtype bfloat16 $E
say "done"
