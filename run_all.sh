#!/usr/bin/env bash
# nanodist smoke test and benchmark.
#   ./run_all.sh           every strategy script present, custom and pytorch, a few steps on 2 ranks;
#                          prints one table and exits non-zero if any run fails or diverges from the
#                          single-process reference (python ddp_train.py with the same flags).
#   ./run_all.sh --bench   a longer config; custom and pytorch runs alternate for $ROUNDS rounds in one
#                          invocation, next to one process using every core on the same global batch
#                          (the limit on one machine); prints tokens/s, peak memory and the ratios.
#   ./run_all.sh --dry-run the plan (each run, its ranks and device), without running anything.
# Devices: with no GPU every run is on the CPU (gloo); with at least NPROC GPUs, on the GPUs (nccl).
# With fewer GPUs than NPROC (one GPU: NCCL refuses two ranks on one device) the NPROC-rank smoke
# runs on the CPU, which still checks parity, and every script also runs at world size 1 on the GPU,
# in bf16, against a one-process GPU reference (runs/smoke-gpu); --bench refuses there.
# Environment: NPROC (ranks, default 2), ROUNDS (bench rounds, default 3), PYTHON (default python3),
#              ONLY (a subset of strategies, e.g. ONLY="ddp zero3 pp"; default: every script),
#              GPUS (the GPU count to plan for; default torch.cuda.device_count()).
set -uo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-2}
ROUNDS=${ROUNDS:-3}
# This invocation, as common.report markdown prints it beside the machine, torch and commit
COMMAND="NPROC=$NPROC ROUNDS=$ROUNDS ${ONLY:+ONLY=\"$ONLY\" }${GPUS:+GPUS=$GPUS }./run_all.sh $*"
MODE=smoke
DRY=0
for arg in "$@"; do
  case $arg in
    --bench) MODE=bench ;;
    --dry-run) DRY=1 ;;
    *) echo "error: run_all.sh: unknown argument $arg (--bench, --dry-run)" >&2; exit 2 ;;
  esac
done

# What it needs: the packages, and the data (prepared below, before the runs). Offline, the scripts
# read the text and the tokenizer from the folder NANODIST_OFFLINE_DIR names (docs/offline.md); by
# default ../shared beside the checkout, when it holds the text.
"$PYTHON" -c "import torch, tiktoken, numpy, tensorboard" 2>/dev/null || "$PYTHON" -m pip install -q -r requirements.txt || exit 1
if [ "$MODE" = bench ] && [ "$DRY" = 0 ]; then  # the bench also times preparing the corpora
  "$PYTHON" -c "import pyarrow, huggingface_hub" 2>/dev/null || "$PYTHON" -m pip install -q -r requirements-data.txt || exit 1
fi
if [ -z "${NANODIST_OFFLINE_DIR:-}" ] && [ -f ../shared/data/tinyshakespeare/input.txt ]; then
  export NANODIST_OFFLINE_DIR=$(cd ../shared && pwd)
fi

SCRIPTS=$(for s in ${ONLY:-ddp ddp_diloco fsdp fsdp_hsdp zero3 zero3_tuning tp tp_overlap pp pp_zb pp_vocab cp hybrid ep}; do [ -f "${s}_train.py" ] && echo "$s"; done)
has() { [[ " $(echo $SCRIPTS) " == *" $1 "* ]]; }
GPUS=${GPUS:-$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")}
DEVICE=cpu   # where the NPROC-rank runs go
GPU_ROWS=0   # 1: every script also at world size 1 on the GPU
if [ "$GPUS" -ge "$NPROC" ]; then
  DEVICE=cuda
elif [ "$GPUS" -gt 0 ]; then
  if [ "$MODE" = bench ]; then
    echo "error: run_all.sh --bench: $NPROC ranks need $NPROC GPUs, this machine has $GPUS;" \
         "run NPROC=$GPUS ./run_all.sh --bench, or CUDA_VISIBLE_DEVICES= ./run_all.sh --bench" \
         "for the CPU" >&2
    exit 2
  fi
  GPU_ROWS=1
  echo "$GPUS GPU(s) for $NPROC ranks: the $NPROC-rank runs use the CPU (gloo);" \
       "every script also runs at world size 1 on the GPU"
fi
[ "$DRY" = 1 ] || "$PYTHON" -m common.data || exit 1  # no text or tokenizer: one line, before any run
RUNS=runs/$MODE
[ "$DRY" = 1 ] || { rm -rf "$RUNS" runs/smoke-gpu && mkdir -p "$RUNS"; }
record_setup() {  # RUNS/setup.json: the machine, torch version, commit and COMMAND of its runs
  [ "$DRY" = 1 ] || "$PYTHON" -m common.report setup "$RUNS" "$COMMAND"
}
record_setup
# Each run evaluates before its first step and after its last (--eval_interval = --max_iters, two
# batches a split): the smoke compares both with the reference's.
COMMON="--eval_iters 2 --tensorboard false --log_interval 10"
if [ "$MODE" = smoke ]; then
  FLAGS="$COMMON --max_iters 10 --eval_interval 10"  # the default model: 4 layers, 128 wide, batch 16 x 64
else
  FLAGS="$COMMON --max_iters 30 --eval_interval 30 --warmup_iters 5"
fi

run() {  # run NAME NPROC SCRIPT FLAGS...: one training run into $RUNS/NAME, on $DEVICE
  local name=$1 nproc=$2 script=$3; shift 3
  local dir=$RUNS/$name
  if [ "$DRY" = 1 ]; then
    printf '  %-30s %s rank(s) on %-4s %s %s\n' "$RUNS/$name" "$nproc" "$DEVICE" "$script" "$*"
    return
  fi
  mkdir -p "$dir"
  echo "$DEVICE x$nproc" >"$dir/device"
  if [ "$nproc" = 1 ]; then
    "$PYTHON" "$script" "$@" --device "$DEVICE" --out_dir "$dir" >"$dir/log.txt" 2>&1
  else
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$nproc" "$script" "$@" \
      --device "$DEVICE" --out_dir "$dir" >"$dir/log.txt" 2>&1
  fi
  local code=$?
  echo $code >"$dir/exit_code"
  printf '  %-30s exit %s\n' "$name ($DEVICE)" "$code"
}

variant() {  # variant SCRIPT [NPROC]: flags that exercise a tier-2 script's knobs beyond its defaults
  # (each tier-2 script's defaults already run its variant)
  case $1 in
    zero3_tuning) echo "--persistence_threshold 1024 --reduce_bucket_mb 1 --max_reuse_distance 0" ;;
    fsdp_hsdp) [ $(( ${2:-1} % 2 )) = 0 ] && echo "--replicate_size 2" ;;  # 2 replicas (1: fsdp's run)
  esac
}

run_strategies() {  # run_strategies SUFFIX NPROC: every script, custom then pytorch, on $DEVICE
  for s in $SCRIPTS; do
    [ "$s" = ep ] && continue  # a mixture of experts: against its own one-process reference (below)
    # DiLoCo's replicas train apart: no one-process run to equal (the smoke runs its one replica below)
    [ "$s" = ddp_diloco ] && [ "$MODE" = smoke ] && continue
    for impl in custom pytorch; do
      # torch's context_parallel: CUDA SDPA kernels only
      [ "$s-$impl" = cp-pytorch ] && [ "$DEVICE" = cpu ] && continue
      [ "$s-$impl" = pp_vocab-pytorch ] && continue  # --vocab_parallel: custom only
      [ "$s-$impl" = zero3_tuning-pytorch ] && continue  # DeepSpeed's knobs: custom only (FSDP2 is zero3's)
      [ "$s-$impl" = tp_overlap-pytorch ] && continue  # --tp_overlap: custom only (torch's async TP: CUDA)
      [ "$s-$impl" = ddp_diloco-pytorch ] && continue  # torch has no DiLoCo
      run "$s-$impl$1" "$2" "${s}_train.py" $FLAGS $(variant "$s" "$2") --implementation $impl
    done
  done
}

echo "nanodist $MODE: $NPROC ranks on $DEVICE, strategies: $(echo $SCRIPTS)"
if [ "$MODE" = smoke ]; then
  run reference 1 ddp_train.py $FLAGS
  run_strategies "" "$NPROC"
  if has ddp_diloco; then  # one replica, outer lr 1 and no momentum: plain AdamW, the reference
    run ddp_diloco@1replica-custom 1 ddp_diloco_train.py $FLAGS --outer_lr 1 --outer_momentum 0
  fi
  if has hybrid; then  # all four axes at once: dp 2 x tp 2 x pp 2 x cp 2 (16 CPU ranks unless 16 GPUs)
    DEVICE_WAS=$DEVICE
    [ "$GPUS" -ge 16 ] && DEVICE=cuda || DEVICE=cpu
    run hybrid@dp2tp2pp2cp2-custom 16 hybrid_train.py $FLAGS --data_parallel_size 2 \
      --tensor_parallel_size 2 --pipeline_parallel_size 2 --context_parallel_size 2 --sequence_parallel
    DEVICE=$DEVICE_WAS
  fi
  if has ep; then  # the mixture of experts (E = 8, k = 2) against its own one-process reference
    RUNS=runs/smoke-moe
    [ "$DRY" = 1 ] || { rm -rf "$RUNS" && mkdir -p "$RUNS"; }
    record_setup
    run reference 1 ep_train.py $FLAGS  # one process: every expert, E = 8 by default
    for impl in custom pytorch; do run "ep-$impl" "$NPROC" ep_train.py $FLAGS --implementation $impl; done
    RUNS=runs/smoke
  fi
  if [ "$GPU_ROWS" = 1 ]; then  # world size 1 on the GPU, in bf16 as GPU users train it
    RUNS=runs/smoke-gpu DEVICE=cuda
    [ "$DRY" = 1 ] || mkdir -p "$RUNS"
    record_setup
    FLAGS="$FLAGS --dtype bfloat16"
    run reference 1 ddp_train.py $FLAGS
    run_strategies "" 1
    RUNS=runs/smoke DEVICE=cpu
  fi
else
  for r in $(seq 1 "$ROUNDS"); do
    run "limit-1proc-r$r" 1 ddp_train.py $FLAGS  # one process, all cores, same global batch
    run_strategies "-r$r" "$NPROC"
    if has ep; then  # EP against torch DDP (every expert on every rank) and one process, E = 8, k = 2
      run "limit@e8-1proc-r$r" 1 ep_train.py $FLAGS --n_experts 8
      for impl in custom pytorch; do
        run "ep@e8-$impl-r$r" "$NPROC" ep_train.py $FLAGS --n_experts 8 --implementation $impl
      done
    fi
    # Variants compared with each other in the same rounds (common.report prints their ratios): ZeRO's
    # stages 1 and 2 (stage 3 is zero3 above) and stage 1's peer, DDP + ZeroRedundancyOptimizer; the
    # pipeline at 1F1B with 8 micro-batches, with and without the head split over the stages.
    if has zero3; then
      run "zero3-stage1-custom-r$r" "$NPROC" zero3_train.py $FLAGS --stage 1
      run "zero3-stage1-pytorch-r$r" "$NPROC" zero3_train.py $FLAGS --stage 1 --implementation pytorch
      run "zero3-stage2-custom-r$r" "$NPROC" zero3_train.py $FLAGS --stage 2
    fi
    # DDP where the gradient all-reduce is a large part of the step: global batch 8 at block 128, and
    # 4 micro-steps of accumulation; each against one process on all cores at the same config
    # (runs named <strategy>@<config>: common.report compares them with limit@<config>).
    if has ddp; then
      for config in "b8t128:--batch_size 8 --block_size 128" "accum4:--grad_accum_steps 4"; do
        tag=${config%%:*}
        run "limit@$tag-1proc-r$r" 1 ddp_train.py $FLAGS ${config#*:}
        for impl in custom pytorch; do
          run "ddp@$tag-$impl-r$r" "$NPROC" ddp_train.py $FLAGS ${config#*:} --implementation $impl
        done
      done
    fi
    # TP with sequence parallelism, custom and DTensor, and tp_overlap_train.py with SP (without: tp_overlap
    # above): each vs one process (limit) and vs plain TP in the same rounds.
    if has tp; then
      for impl in custom pytorch; do
        run "tp-sp-$impl-r$r" "$NPROC" tp_train.py $FLAGS --sequence_parallel --implementation $impl
      done
    fi
    if has tp_overlap; then
      run "tp-sp-overlap-custom-r$r" "$NPROC" tp_overlap_train.py $FLAGS --sequence_parallel
    fi
    # hybrid_train.py's grids of 4 ranks (CPU, or 4 GPUs) against the single-strategy scripts on the
    # same 4 ranks (runs named <strategy>@<grid>: common.report's COMPARE pairs them)
    if has hybrid && { [ "$GPUS" -ge 4 ] || [ "$GPUS" = 0 ]; }; then
      for grid in "dp4:--data_parallel_size 4" "pp4:--pipeline_parallel_size 4" \
                  "dp2tp2:--data_parallel_size 2 --tensor_parallel_size 2" \
                  "dp2cp2:--data_parallel_size 2 --context_parallel_size 2" \
                  "tp2pp2:--tensor_parallel_size 2 --pipeline_parallel_size 2" \
                  "pp2cp2:--pipeline_parallel_size 2 --context_parallel_size 2"; do
        run "hybrid@${grid%%:*}-custom-r$r" 4 hybrid_train.py $FLAGS ${grid#*:}
      done
      run "ddp@dp4-custom-r$r" 4 ddp_train.py $FLAGS
      run "pp@pp4-custom-r$r" 4 pp_train.py $FLAGS --schedule 1f1b
      run "tp@dp2tp2-custom-r$r" 4 tp_train.py $FLAGS --data_parallel_size 2 --tensor_parallel_size 2
      run "cp@dp2cp2-custom-r$r" 4 cp_train.py $FLAGS --context_parallel_size 2
    fi
    BAL="--n_embd 512 --n_head 8 --n_layer 13 --block_size 32 --batch_size 8 --max_iters 10"  # balanced stages
    if has pp; then
      run "pp-1f1b-m8-custom-r$r" "$NPROC" pp_train.py $FLAGS --schedule 1f1b --n_microbatches 8
    fi
    if has pp_vocab; then
      run "pp-1f1b-m8-vocab-custom-r$r" "$NPROC" pp_vocab_train.py $FLAGS --schedule 1f1b --n_microbatches 8 \
        --vocab_parallel
    fi
    if has pp_zb; then
      # the zero-bubble schedules (ZB-H1, ZB-V), hand-written and torch's, against 1F1B at 8 micro-batches, on
      # the default model and on one whose stages balance (--stage_layers: the head weighs about 9 blocks)
      for schedule in zb1p zbv; do
        for impl in custom pytorch; do
          run "pp-$schedule-m8-$impl-r$r" "$NPROC" pp_zb_train.py $FLAGS --schedule $schedule --n_microbatches 8 \
            --implementation $impl
        done
      done
      for schedule in zb1p:11,2 zbv:1,5,6,1; do
        run "pp-${schedule%%:*}-m8@balanced-custom-r$r" "$NPROC" pp_zb_train.py $FLAGS $BAL --schedule ${schedule%%:*} \
          --stage_layers ${schedule#*:} --n_microbatches 8
      done
    fi
    if has pp; then  # 1F1B on the balanced model: the zero-bubble rows' baseline
      run "pp-1f1b-m8@balanced-custom-r$r" "$NPROC" pp_train.py $FLAGS $BAL --schedule 1f1b --stage_layers 11,2 \
        --n_microbatches 8
    fi
  done
  # Each strategy's own claims, one run each (runs/bench-extra): FSDP's exposed communication with
  # prefetch on and off; ZeRO-3's broadcast/reduce waits per rank (wte kept or not, prefetch off);
  # TP 2D at 4 ranks, and TP's exposed communication with and without --tp_overlap; the pipeline
  # bubble, compute per stage and activation memory per schedule and micro-batch count; CP's modes at
  # a block of 1024 (where attention matters) against one process on every core, ring with and
  # without zigzag, and the saved activations of one process.
  RUNS=runs/bench-extra
  [ "$DRY" = 1 ] || { rm -rf "$RUNS" && mkdir -p "$RUNS"; }  # --dry-run touches no run
  record_setup
  extra() { has "${3%_train.py}" && run "$@"; }
  extra fsdp-custom-prefetch "$NPROC" fsdp_train.py $FLAGS --prefetch true
  extra fsdp-custom-noprefetch "$NPROC" fsdp_train.py $FLAGS --prefetch false
  extra zero3-custom "$NPROC" zero3_train.py $FLAGS  # where its time goes: broadcast/reduce waits
  extra zero3-custom-noreuse "$NPROC" zero3_tuning_train.py $FLAGS --max_reuse_distance 0
  extra zero3-custom-noprefetch "$NPROC" zero3_train.py $FLAGS --prefetch false
  for impl in custom pytorch; do
    extra tp-$impl-2d-dp2-tp2-sp 4 tp_train.py $FLAGS --implementation $impl --tensor_parallel_size 2 --sequence_parallel
  done
  # TP's exposed communication (the waits on its collectives), tp_train.py against tp_overlap_train.py,
  # SP off and on, on the small preset and 4x wider
  for wide in "" "--n_embd 512 --n_head 8 --max_iters 12 --warmup_iters 2"; do
    for sp in false true; do
      for script in tp:false tp_overlap:true; do
        extra "tp-custom-sp-$sp-overlap-${script#*:}${wide:+-c512}" "$NPROC" ${script%%:*}_train.py $FLAGS $wide \
          --sequence_parallel $sp
      done
    done
  done
  for schedule in gpipe 1f1b; do
    for m in 2 4 8; do
      extra pp-custom-$schedule-m$m 2 pp_train.py $FLAGS --schedule $schedule --n_microbatches $m --print_schedule
    done
  done
  # The head split over the ranks (small preset), and a model where uneven stages alone balance the head
  # (n_layer >= vocab / (12 n_embd): 13 blocks of 512; the head weighs about 9 of them).
  extra pp-custom-1f1b-m8-vocab 2 pp_vocab_train.py $FLAGS --schedule 1f1b --n_microbatches 8 --vocab_parallel \
    --print_schedule
  for schedule in 1f1b:11,2:pp zb1p:11,2:pp_zb zbv:1,5,6,1:pp_zb; do  # balanced stages' bubble, against each formula
    layers=${schedule#*:}
    extra pp-custom-${schedule%%:*}-m8-stagelayers 2 ${layers#*:}_train.py $FLAGS --schedule ${schedule%%:*} \
      --n_microbatches 8 --stage_layers ${layers%%:*} \
      --print_schedule --n_embd 512 --n_head 8 --n_layer 13 --block_size 32 \
      --batch_size 8 --max_iters 10 --warmup_iters 2
  done
  # --activation_checkpointing none/selective/full per strategy (custom) at block 256 with dropout 0.1
  # (CPU's SDPA then takes its math path, which keeps the T x T probabilities that selective drops):
  # tokens/s, peak memory and the bytes kept for backward; common.report prints each mode against none.
  AC="--block_size 256 --batch_size 8 --dropout 0.1 --max_iters 12 --warmup_iters 2"
  for s in $SCRIPTS; do
    case $s in
      cp) mode_flags="--cp_mode ulysses" ;; pp) mode_flags="--schedule 1f1b" ;; *) mode_flags=$(variant "$s" "$NPROC") ;;
    esac
    for ac in none selective full; do
      extra "ac-$s-$ac" "$NPROC" "${s}_train.py" $FLAGS $AC $mode_flags --activation_checkpointing $ac
    done
  done
  CP="--block_size 1024 --batch_size 2 --max_iters 10 --warmup_iters 2"  # about 2 s a step here
  if has cp; then
    run cp-limit-1proc-T1024 1 ddp_train.py $FLAGS $CP
    extra cp-custom-1proc-T1024 1 cp_train.py $FLAGS $CP  # saved activations of one process, same meter
    for mode in ring allgather ulysses; do
      extra cp-custom-$mode-T1024 "$NPROC" cp_train.py $FLAGS $CP --cp_mode $mode
    done
    extra cp-custom-ring-contiguous-T1024 "$NPROC" cp_train.py $FLAGS $CP --load_balance false
  fi
fi
[ "$DRY" = 1 ] && exit 0
echo
"$PYTHON" -m common.report "$MODE" runs/$MODE
status=$?
if [ "$MODE" = smoke ] && has ep; then
  echo
  "$PYTHON" -m common.report smoke runs/smoke-moe || status=1
fi
if [ "$GPU_ROWS" = 1 ]; then
  echo
  "$PYTHON" -m common.report smoke-gpu runs/smoke-gpu || status=1
fi
if [ "$MODE" = bench ]; then
  echo
  "$PYTHON" -m common.report extra runs/bench-extra || status=1
  echo  # tokenising local parquet into shards against tiktoken's batch encoder on the same documents
  "$PYTHON" -m common.prepare --bench || status=1
fi
exit $status
