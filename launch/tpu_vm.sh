#!/usr/bin/env bash
# Cloud TPU VM (single host or a multi-host slice): the same command on every worker.
#
#   gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all --command \
#     "cd dgr2_jax && bash launch/tpu_vm.sh configs/beauty_qwen3_8b.py gs://bucket/dgr2_8b \
#        --config.data.dir=/data/amazon_beauty --config.model.init_from=/models/qwen3-8b-sids"
#
# which runs exactly, on each worker:
#   python -m dgr2_jax.main --config=configs/beauty_qwen3_8b.py --workdir=WORKDIR \
#       --config.hardware.num_devices=0 [extra overrides...]
# with PYTHON (default: python on PATH) as the interpreter, e.g. PYTHON=venv/bin/python.
# Multi-host slices are detected from TPU_WORKER_HOSTNAMES (several hosts): dgr2_jax.main calls
# jax.distributed.initialize() before anything else (dgr2_jax.multihost.initialize), and
# jax.devices() spans the slice. Worker 0 builds the host-side stages and writes every file; all
# workers train and save their shards. Install first: pip install -e . "jax[tpu]==0.10.2".
# The workdir must be shared by all workers (a GCS path needs the orbax/etils GCS support).
# Preemption (a spot or preemptible TPU, a maintenance event): the workers get SIGTERM, save the
# same training step and exit with 75 ("requeue me"); rerunning this command resumes from it, e.g.
#   until bash launch/tpu_vm.sh CONFIG WORKDIR; do [ $? -eq 75 ] || break; done
# on a VM that stays up, or the same command on the one that replaces it. See docs/multihost.md.
set -euo pipefail
CONFIG=${1:?usage: tpu_vm.sh CONFIG WORKDIR [--config.x=y ...]}
WORKDIR=${2:?usage: tpu_vm.sh CONFIG WORKDIR [--config.x=y ...]}
shift 2
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "${PYTHON:-python}" -m dgr2_jax.main --config="$CONFIG" --workdir="$WORKDIR" \
    --config.hardware.num_devices=0 "$@"
