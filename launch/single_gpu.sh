#!/usr/bin/env bash
# One machine, one (or all local) GPU(s): the whole pipeline in one process.
#
#   bash launch/single_gpu.sh configs/beauty_qwen3_0p6b.py /scratch/dgr2_0p6b \
#       --config.data.dir=/data/amazon_beauty --config.model.init_from=/models/qwen3-0.6b-sids
#
# which runs exactly:
#   python -m dgr2_jax.main --config=configs/beauty_qwen3_0p6b.py --workdir=/scratch/dgr2_0p6b \
#       --config.hardware.num_devices=0 [extra overrides...]
# with PYTHON (default: python on PATH) as the interpreter, e.g. PYTHON=venv/bin/python.
# SIGTERM during training saves the step in flight and exits with 75; rerunning resumes from it
# (docs/training.md). The mesh uses every visible device (CUDA_VISIBLE_DEVICES=0 for a single
# GPU). Dry run first:
#   bash launch/single_gpu.sh CONFIG WORKDIR --config.dry_run=True
set -euo pipefail
CONFIG=${1:?usage: single_gpu.sh CONFIG WORKDIR [--config.x=y ...]}
WORKDIR=${2:?usage: single_gpu.sh CONFIG WORKDIR [--config.x=y ...]}
shift 2
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
exec "${PYTHON:-python}" -m dgr2_jax.main --config="$CONFIG" --workdir="$WORKDIR" \
    --config.hardware.num_devices=0 "$@"
