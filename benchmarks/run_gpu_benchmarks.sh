#!/usr/bin/env bash
# The prepared GPU run (one H200; ~12 minutes of device time): what the compiled decode loop moves
# on this device (benchmarks/decode_bytes.py: weight reads, f32 converts, round trips, and the
# copies / converts / all-gathers inside the loop of the optimised HLO, which is dumped), the
# operating-point table (prompt 2,200, 128 new tokens, Qwen3-0.6B and -8B shapes, bf16, random
# weights, attention 'auto'; AR and forced 1/2/4/8-commit schedules at batch 1 and 8), then the
# training step's MFU (SFT, CFT, OPD at the 0.6B shape, scanned layers, attention 'auto').
# Tables go to stdout and to $OUT.
# Usage: OUT=/some/dir bash benchmarks/run_gpu_benchmarks.sh
set -uo pipefail
OUT=${OUT:-/tmp/dgr2_bench}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
timeout 420 python3 benchmarks/decode_bytes.py --check --programs=ar,diffusion --hlo_dir="$OUT/decode_hlo" \
  --json_out="$OUT/decode_bytes.json" 2>&1 | grep -v Warning | tee "$OUT/decode_bytes.txt"
for preset in qwen3_8b qwen3_0p6b; do
  timeout 200 python3 benchmarks/decode_throughput.py --preset=$preset --dtype=bfloat16 --attention=auto \
    --prompt_len=2200 --max_new_tokens=128 --batch_sizes=1,8 --commits=1,2,4,8 --repeats=2 \
    --json_out="$OUT/decode_$preset.json" 2>&1 | grep -v Warning | tee "$OUT/decode_$preset.txt"
done
timeout 200 python3 benchmarks/train_step.py --preset=0p6b_like --scan=true --attention=auto --steps=4 --warmup=2 \
  --losses=sft,cft,opd 2>&1 | tee "$OUT/train_step.txt"
