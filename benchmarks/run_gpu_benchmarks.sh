#!/usr/bin/env bash
# The prepared GPU run (one H200; ~8 minutes of device time): decode wall-clock at the paper's
# operating point (prompt 2,200; 128 and 512 new tokens; Qwen3-0.6B and -8B shapes, bf16, random
# weights, forced commit schedules), then the training step's MFU (SFT, CFT, OPD at the 0.6B
# shape, scanned layers, cuDNN attention where it applies). Tables go to stdout and to $OUT.
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
for preset in qwen3_8b qwen3_0p6b; do
  timeout 170 python3 benchmarks/decode_throughput.py --preset=$preset --dtype=bfloat16 --prompt_len=2200 \
    --max_new_tokens=128,512 --batch_sizes=1 --commits=1,2,4,8 --repeats=2 --json_out="$OUT/decode_$preset.json" 2>&1 \
    | grep -v Warning | tee "$OUT/decode_$preset.txt"
done
timeout 200 python3 benchmarks/train_step.py --preset=0p6b_like --scan=true --attention=auto --steps=4 --warmup=2 \
  --losses=sft,cft,opd 2>&1 | tee "$OUT/train_step.txt"
