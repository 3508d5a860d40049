#!/usr/bin/env bash
# The prepared GPU run (one H200), in two parts that each fit one 10-minute device call:
#   PART=1: the operating-point table (prompt 2,200, 128 new tokens, Qwen3-8B and -0.6B shapes,
#           bf16, random weights, attention 'auto'; AR and forced 1/2/4/8-commit schedules at
#           batch 1, AR and 4 commits at batch 8), ~9 minutes;
#   PART=2: the training step's MFU (SFT, CFT, OPD at the 0.6B shape, scanned layers), ~2 minutes,
#           then what the compiled decode loop moves on this device (benchmarks/decode_bytes.py:
#           weight reads, f32 converts, round trips inside the optimised HLO), ~6 minutes.
# The table measured with it is in docs/decoding_accelerator.md ("Measured on an H200").
# Tables go to stdout and to $OUT. Usage: OUT=/some/dir PART=1 bash benchmarks/run_gpu_benchmarks.sh
# (a device without ml_collections: put its wheel in .whl/ and carry .whl).
set -uo pipefail
OUT=${OUT:-/tmp/dgr2_bench}; PART=${PART:-1}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
throughput() {  # preset batch commits seconds
  timeout "$4" python3 benchmarks/decode_throughput.py --preset="$1" --dtype=bfloat16 --attention=auto \
    --prompt_len=2200 --max_new_tokens=128 --batch_sizes="$2" --commits="$3" --repeats=2 \
    --json_out="$OUT/decode_$1_b$2.json" 2>&1 | grep -v -e Warning -e libtpu | tee "$OUT/decode_$1_b$2.txt"
}
if [ "$PART" = 1 ]; then
  throughput qwen3_8b 1 1,2,4,8 200
  throughput qwen3_8b 8 4 190
  throughput qwen3_0p6b 1 1,4 150
else
  timeout 120 python3 benchmarks/train_step.py --preset=0p6b_like --scan=true --attention=auto --steps=4 --warmup=2 \
    --losses=sft,cft,opd 2>&1 | grep -v -e Warning -e libtpu | tee "$OUT/train_step.txt"
  timeout 420 python3 benchmarks/decode_bytes.py --check --programs=ar,diffusion --batch_sizes=1,8 \
    --hlo_dir=/tmp/decode_hlo --json_out="$OUT/decode_bytes.json" 2>&1 | grep -v -e Warning -e libtpu \
    | tee "$OUT/decode_bytes.txt"
fi
