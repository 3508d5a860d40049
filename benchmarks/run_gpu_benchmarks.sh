#!/usr/bin/env bash
# The prepared GPU run: every figure of the docs' generated GPU tables, in one device call.
#
#   OUT=/some/dir GIT_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_gpu_benchmarks.sh
#
# Sub-runs, in priority order (NAME: what; seconds expected on an H100, from a cold compile cache).
# Each starts only while BUDGET (default 470 s, counted from the start) leaves it its minimum, runs
# under `timeout` capped at what is left, and a failure or timeout stops nothing else:
#   probe        device, versions, and a while loop under the command-buffer flags (falls back to
#                XLA's defaults, logged, if it fails)                                        ~20
#   ar_b1_new    8B shape, batch 1, prompt 2,200, 128 new tokens: AR with fused q/k/v and gate/up
#                and the decode loop in CUDA graphs (the defaults)                           ~90
#   ar_b1_old    the same AR, unfused, XLA's default command buffers (the loop not graphed)  ~80
#   replay_b1    8B batch 1: the schedule SCHEDULE replayed (and AR at its lengths)           ~90
#   fp8_b1       8B batch 1 AR with float8 (e4m3) weights                                    ~80
#   train_0p6b_nothing_saveable  SFT, CFT, OPD steps at the 0.6B shape (batch 8 x 2,048, bf16,
#                scanned, attention auto; one process per row)                               ~120
#   flash_check  the Pallas block-sparse flash attention against 'xla' on the GPU             ~40
#   train_0p6b_pallas  the same train rows with the Pallas attention                         ~120
#   profile      8B batch 1 AR: 16 steps under the profiler, device time per op group        ~70
#   bytes_8b     decode_bytes.py on this device's compiled 8B AR step, bf16 and float8 weights ~60
#   train_0p6b_dots_saveable  the train rows with remat dots_saveable                        ~120
#   replay_b8    8B batch 8: the replayed schedule and AR                                    ~100
#   attn_kernel  decode attention alone: split-key kernel, cuDNN and 'xla' (ms, max difference) ~40
#   train_opd_one_group  OPD with every replay segment in one cuDNN call (the memory before)  ~50
#   ar_0p6b_b1   0.6B shape, batch 1: AR and forced 4 commits/step                           ~50
#   train_1p7b   one SFT and one OPD step at the 1.7B shape                                  ~70
#   ar_b1_fused_xla / ar_b1_unfused_cb   the two factors of ar_b1_new alone                   ~80 each
#   mem_8b       8B batch 1: one decode call's device memory compiled for this device, given the
#                checkpoint's f32 tree or the host-prepared one (decode_memory.py; nothing runs) ~40
# About 470 s reach the first train rows; the rest is a second call: the script ends by printing
# the PARTS=... line that runs what it skipped.
#
# Environment: OUT (results), GIT_COMMIT (the device's copy has no .git), BUDGET (seconds), PARTS
# (names to run, default all), SCHEDULE (a recorded schedule.json; default
# benchmarks/results/schedule_demo.json), PREFIX (of the output files, e.g. h100_), SMOKE=1 (tiny
# shapes and prompts: the script's own check on a CPU, minutes, no figures worth keeping), PYTHON (the
# interpreter of every sub-run and helper, default python3 on PATH; recorded commands say python3).
# Writes $OUT/{decode,kernels,train,profile}.json (benchmarks/gpu_tables.py's format: the device,
# JAX version, commit and every sub-run's own JSON, status and, if it failed, its last lines) after
# every sub-run, and $OUT/log.txt. Copy the JSON to benchmarks/results/ and run
# `python benchmarks/gpu_tables.py` to regenerate the docs' tables.
# (A device without ml_collections: put its wheel in .whl/ and carry .whl.)
set -uo pipefail
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/dgr2_bench}; BUDGET=${BUDGET:-470}; PARTS=${PARTS:-}; PREFIX=${PREFIX:-}
SCHEDULE=${SCHEDULE:-benchmarks/results/schedule_demo.json}
mkdir -p "$OUT"; LOG=$OUT/log.txt; : > "$LOG"
PARTS_DIR=$(mktemp -d /tmp/dgr2_parts.XXXXXX)
T0=$SECONDS; SKIPPED=""; DONE=""
log() { echo "[$((SECONDS - T0))s] $*" | tee -a "$LOG"; }

if [ -d .whl ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
# One persistent compile cache for the sub-runs: programs they share (prefill, init, window costs) compile once.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/dgr2_jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-2}
BASE_FLAGS=${XLA_FLAGS:-}
export GIT_COMMIT=${GIT_COMMIT:-unknown}; export DGR2_GIT_COMMIT=$GIT_COMMIT   # the benchmarks' JSON name it
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
log "commit ${GIT_COMMIT:-unknown}, budget ${BUDGET}s, parts ${PARTS:-all}"

# ---- the command-buffer flags, checked on this device before anything relies on them ---------------
# The +/- form of the command types keeps XLA's other defaults; the explicit list is the fallback
# for an XLA that would not take it.
probe() {
  XLA_FLAGS="$BASE_FLAGS $1" timeout 150 "$PYTHON" benchmarks/run_meta.py --out "$PARTS_DIR/env.json" >> "$LOG" 2>&1
}
EXPLICIT="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
CB=0
for CB_FLAGS in "$("$PYTHON" -m dgr2_jax.decode.xla_flags 1)" "$EXPLICIT --xla_gpu_graph_min_graph_size=1"; do
  if probe "$CB_FLAGS"; then
    CB=1; log "command buffers: '$CB_FLAGS' ran the probe's while loop and matched NumPy"; break
  fi
  log "command buffers: the probe failed under '$CB_FLAGS'"
done
if [ $CB = 0 ]; then
  log "command buffers: every sub-run uses XLA's defaults (DGR2_COMMAND_BUFFERS=0)"
  probe "" || log "the probe failed without the flags too: see above"
fi

has_flag() { grep -q -E "[\"'](--)?$2[\"']" "$1"; }   # does script $1 define flag $2 (absl or argparse)

# run NAME PART MIN_S MAX_S CB LABEL CMD...: CB 1 = the decode loop in CUDA graphs (if the probe passed),
# 0 = XLA's defaults. @JSON@ in CMD is replaced by the sub-run's JSON path.
run() {
  local name=$1 part=$2 min=$3 max=$4 cb=$5 label=$6; shift 6
  if [ -n "$PARTS" ] && [[ " $PARTS " != *" $name "* ]]; then return 0; fi
  local left=$((BUDGET - (SECONDS - T0)))
  if [ "$left" -lt "$min" ]; then
    log "skip $name: ${left}s of the budget left, it needs ${min}s"; SKIPPED="$SKIPPED $name"; return 0
  fi
  local t=$((max < left ? max : left)) flags="$BASE_FLAGS" cbenv=0 args=() a
  if [ "$cb" = 1 ] && [ "$CB" = 1 ]; then flags="$BASE_FLAGS $CB_FLAGS"; cbenv=1; fi
  for a in "$@"; do args+=("${a//@JSON@/$PARTS_DIR/$name.json}"); done
  log "run $name (timeout ${t}s, command buffers $([ $cbenv = 1 ] && echo loops || echo 'xla default')): ${args[*]}"
  local s=$SECONDS
  XLA_FLAGS="$flags" DGR2_COMMAND_BUFFERS=$cbenv timeout -k 10 "$t" "${args[@]}" > "$PARTS_DIR/$name.log" 2>&1
  local rc=$?
  grep -v -e Warning -e libtpu -e "^ *warnings.warn" "$PARTS_DIR/$name.log" | tail -n 80 >> "$LOG"
  local shown="${*/#"$PYTHON"/python3}"   # the command as the docs' tables show it, whatever PYTHON is
  "$PYTHON" - "$PARTS_DIR/$name.status" "$name" "$part" "$label" "$rc" "$((SECONDS - s))" "$t" "$cbenv" "$flags" \
      "$shown" <<'EOF'
import json, sys
path, name, part, label, rc, secs, limit, cb, flags, cmd = sys.argv[1:]
cmd = f"DGR2_COMMAND_BUFFERS={cb} " + " ".join(w for w in cmd.split() if w != "--json_out=@JSON@")
json.dump(dict(name=name, part=part, label=label, rc=int(rc), seconds=int(secs), timeout_s=int(limit),
               command_buffers="loops" if cb == "1" else "xla default", xla_flags=flags.strip(), command=cmd),
          open(path, "w"))
EOF
  log "$name: exit status $rc after $((SECONDS - s))s$([ $rc = 124 ] && echo ' (timed out)')"
  DONE="$DONE $name"
  "$PYTHON" benchmarks/gpu_tables.py collect --parts="$PARTS_DIR" --out="$OUT" --prefix="$PREFIX" > /dev/null \
    || log "collect failed"
}

# ---- the sub-runs, in priority order ---------------------------------------------------------------
M8=qwen3_8b; M06=qwen3_0p6b; PL=2200; NEW=128; ASHAPE=8b; RESP=1024; T06=0p6b_like; T17=1p7b_like; FLASH_SMALL=(); B8=qwen3_8b
if [ "${SMOKE:-0}" = 1 ]; then
  M8=tiny; M06=tiny; PL=64; NEW=32; ASHAPE=tiny; RESP=64; T06=tiny; T17=tiny; FLASH_SMALL=(--small); B8=qwen3_0p6b
fi
DT=benchmarks/decode_throughput.py
DEC=("$PYTHON" $DT --dtype=bfloat16 --attention=auto --prompt_len=$PL --json_out=@JSON@)
FUSED=(); UNFUSED=(); FP8=()
if has_flag $DT fuse_projections; then FUSED=(--fuse_projections=true); UNFUSED=(--fuse_projections=false)
else log "decode_throughput.py has no --fuse_projections: the fused/unfused rows run its default"; fi
if has_flag $DT weight_dtype; then FP8=(--weight_dtype=float8_e4m3fn); fi
REPLAY=(--commits=4 --max_new_tokens=$NEW); RL="forced 4 commits per step (no recorded schedule) and AR"
if [ -f "$SCHEDULE" ] && has_flag $DT schedule; then
  REPLAY=(--schedule="$SCHEDULE"); RL="replayed schedule and AR at its lengths"
else
  log "no schedule $SCHEDULE (or no --schedule flag): the replay rows force 4 commits per step instead"
fi
NOWIN=(); if has_flag $DT window_costs; then NOWIN=(--nowindow_costs); fi   # the window-cost loops: not in a table
DEC+=("${NOWIN[@]}")

run ar_b1_new decode 60 150 1 "8B, batch 1, AR: fused projections, decode loop in CUDA graphs" \
  "${DEC[@]}" --preset=$M8 --batch_sizes=1 --max_new_tokens=$NEW --commits= --repeats=3 "${FUSED[@]}"
run ar_b1_old decode 60 150 0 "8B, batch 1, AR: unfused, XLA's default command buffers (before)" \
  "${DEC[@]}" --preset=$M8 --batch_sizes=1 --max_new_tokens=$NEW --commits= --repeats=3 "${UNFUSED[@]}"
run replay_b1 decode 60 150 1 "8B, batch 1: $RL" \
  "${DEC[@]}" --preset=$M8 --batch_sizes=1 --repeats=3 "${REPLAY[@]}" "${FUSED[@]}"
if [ ${#FP8[@]} -gt 0 ]; then
  run fp8_b1 decode 60 130 1 "8B, batch 1, AR: float8 e4m3 weights" \
    "${DEC[@]}" --preset=$M8 --batch_sizes=1 --max_new_tokens=$NEW --commits= --repeats=3 "${FP8[@]}" "${FUSED[@]}"
else
  log "decode_throughput.py has no --weight_dtype: fp8_b1 not run"
fi
TS=benchmarks/train_step.py
TRAIN=("$PYTHON" $TS --scan=true)
if has_flag $TS json_out; then TRAIN+=(--json_out=@JSON@); fi
if has_flag $TS row_timeout; then TRAIN+=(--row_timeout=100); fi   # one stuck row (one process each) ends alone
train() {  # NAME POLICY ATTENTION LABEL [extra train_step args]
  local name=$1 pol=$2 attn=$3 label=$4; shift 4
  local remat=(); if has_flag $TS remat_policies; then remat=(--remat_policies=$pol); fi
  run "$name" train 60 200 0 "$label" "${TRAIN[@]}" --attention="$attn" --preset=$T06 --steps=3 --warmup=1 "${remat[@]}" "$@"
}
train train_0p6b_nothing_saveable nothing_saveable auto "train steps at the 0.6B shape, remat nothing_saveable, attention auto (batch 8 x 2,048, bf16, scanned)" --losses=sft,cft,opd
if [ -f benchmarks/flash_check.py ]; then
  run flash_check kernels 30 90 0 "Pallas block-sparse flash attention against 'xla'" \
    "$PYTHON" benchmarks/flash_check.py --json_out=@JSON@ "${FLASH_SMALL[@]}"
else
  log "no benchmarks/flash_check.py: flash_check not run"
fi
train train_0p6b_pallas nothing_saveable pallas "train steps at the 0.6B shape, remat nothing_saveable, Pallas block-sparse flash attention" --losses=sft,cft,opd
run profile profile 50 120 1 "8B, batch 1, AR: 16 steps under the profiler" \
  "$PYTHON" benchmarks/decode_profile.py --preset=$M8 --dtype=bfloat16 --attention=auto --batch=1 \
  --prompt_len=$PL --new_tokens=16 --calls=2 --json_out=@JSON@
run bytes_8b kernels 40 150 1 "what the compiled 8B AR step reads on this device (bf16 and float8 weights: float8 reads 1.0 = the convert folded into the matmul)" \
  "$PYTHON" benchmarks/decode_bytes.py --shapes=$B8 --programs=ar --batch_sizes=1 --xla_cost=false \
  --hlo_dir=/tmp/dgr2_hlo --check --json_out=@JSON@
train train_0p6b_dots_saveable dots_saveable auto "train steps at the 0.6B shape, remat dots_saveable, attention auto" --losses=sft,cft,opd
run replay_b8 decode 70 160 1 "8B, batch 8: $RL" \
  "${DEC[@]}" --preset=$M8 --batch_sizes=8 --repeats=2 "${REPLAY[@]}" "${FUSED[@]}"
run attn_kernel kernels 30 90 1 "decode attention, one layer at the 8B shape: split-key kernel, cuDNN, 'xla'" \
  "$PYTHON" benchmarks/decode_attention.py --shape=$ASHAPE --batch_sizes=1,8 --widths=1,32,64 \
  --routes=splitkey,cudnn,xla --prompt_len=$PL --response_len=$RESP --repeats=20 --json_out=@JSON@
if has_flag $TS segment_groups; then
  train train_opd_one_group nothing_saveable auto "OPD at the 0.6B shape with every replay segment in one cuDNN call (before)" --losses=opd --segment_groups=one
fi
run ar_0p6b_b1 decode 40 100 1 "0.6B, batch 1: AR and 4 commits per step" \
  "${DEC[@]}" --preset=$M06 --batch_sizes=1 --max_new_tokens=$NEW --commits=4 --repeats=3 "${FUSED[@]}"
if grep -q "1p7b_like" $TS; then
  run train_1p7b train 50 120 0 "one SFT and one OPD step at the 1.7B shape" \
    "${TRAIN[@]}" --preset=$T17 --steps=1 --warmup=1 --losses=sft,opd
else
  log "train_step.py has no 1p7b_like preset: train_1p7b not run"
fi
run ar_b1_fused_xla decode 60 130 0 "8B, batch 1, AR: fused projections, XLA's default command buffers" \
  "${DEC[@]}" --preset=$M8 --batch_sizes=1 --max_new_tokens=$NEW --commits= --repeats=3 "${FUSED[@]}"
run ar_b1_unfused_cb decode 60 130 1 "8B, batch 1, AR: unfused, decode loop in CUDA graphs" \
  "${DEC[@]}" --preset=$M8 --batch_sizes=1 --max_new_tokens=$NEW --commits= --repeats=3 "${UNFUSED[@]}"
if [ -f benchmarks/decode_memory.py ]; then
  run mem_8b kernels 30 120 0 "device memory of one 8B decode call at batch 1 (compiled for this device, nothing allocated): the checkpoint's f32 tree handed to the decoder, or the tree prepared on the host" \
    "$PYTHON" benchmarks/decode_memory.py --shape=$B8 --batch_sizes=1 --json_out=@JSON@
fi

log "done:${DONE:- nothing}"
if [ -n "$SKIPPED" ]; then
  log "not run for the budget:$SKIPPED"
  echo "to run them: PARTS=\"${SKIPPED# }\" OUT=... GIT_COMMIT=$GIT_COMMIT bash benchmarks/run_gpu_benchmarks.sh" \
    | tee -a "$LOG"
fi
ls -la "$OUT" | tee -a "$LOG"
