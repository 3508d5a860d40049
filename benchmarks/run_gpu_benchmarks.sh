#!/usr/bin/env bash
# The GPU benchmark run (one H200 here): decode throughput on a Qwen3-0.6B-shaped model at the
# paper's operating point (~2200-token prompts, 128 generated tokens), then the training step.
# Usage: OUT=/some/dir bash benchmarks/run_gpu_benchmarks.sh   (tables also go to $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/dgr2_bench}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
timeout 330 python3 benchmarks/decode_throughput.py --preset=qwen3_0p6b --dtype=bfloat16 --prompt_len=2200 \
  --max_new_tokens=128 --batch_sizes=1,8 --repeats=3 --hf_baseline --json_out="$OUT/decode.json" 2>&1 \
  | grep -v Warning | tee "$OUT/decode.txt"
timeout 200 python3 benchmarks/train_step.py --preset=0p6b_like --steps=5 --warmup=2 2>&1 | tee "$OUT/train_step.txt"
