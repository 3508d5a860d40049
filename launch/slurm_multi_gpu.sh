#!/usr/bin/env bash
# SLURM, one task per GPU across nodes; JAX forms one global mesh over all of them.
#
#   sbatch --nodes=1 --ntasks-per-node=8 --gpus-per-task=1 --cpus-per-task=8 \
#       launch/slurm_multi_gpu.sh configs/beauty_qwen3_8b.py /scratch/dgr2_8b \
#       --config.data.dir=/data/amazon_beauty --config.model.init_from=/models/qwen3-8b-sids
#
# Every task runs exactly:
#   python -m dgr2_jax.main --config=configs/beauty_qwen3_8b.py --workdir=/scratch/dgr2_8b \
#       --config.hardware.num_devices=0 [extra overrides...]
# inside an srun step of more than one task (SLURM_STEP_NUM_TASKS > 1), so dgr2_jax.main calls
# jax.distributed.initialize() first (dgr2_jax.multihost.initialize), which reads the coordinator,
# process count and process id from SLURM (SLURM_JOB_NODELIST, SLURM_NTASKS, SLURM_PROCID). A lone
# `python -m dgr2_jax.main` in the batch script (not under srun) runs as one process and does not
# wait for peers. Process 0 builds data, SIDs, retriever and traces while the others wait, and
# writes every file; every process trains and saves its shards. --kill-on-bad-exit=1 stops the
# other tasks when one fails. The workdir must be on a filesystem every node sees (resume with the
# same number of tasks). Plan it first (no GPUs needed):
#   python launch/dry_run.py --config=configs/beauty_qwen3_8b.py
# PYTHON (default: python on PATH) names the interpreter, e.g. PYTHON=venv/bin/python.
#
# Preemption and the time limit: SLURM sends this script SIGTERM 300 s before the time limit
# (--signal=B:TERM@300; give it at least two training steps plus one checkpoint save), and the
# script passes it on to every task. The tasks save the same training step and exit with 75
# ("requeue me"); the script then requeues the job (--requeue, `scontrol requeue`), whose next run
# is this same command and resumes from that step. A preemption by SLURM signals the tasks itself.
# The log is appended to across requeues (--open-mode=append). See docs/multihost.md.
#SBATCH --job-name=dgr2
#SBATCH --output=dgr2-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:TERM@300
set -euo pipefail
CONFIG=${1:?usage: slurm_multi_gpu.sh CONFIG WORKDIR [--config.x=y ...]}
WORKDIR=${2:?usage: slurm_multi_gpu.sh CONFIG WORKDIR [--config.x=y ...]}
shift 2
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
srun --kill-on-bad-exit=1 "${PYTHON:-python}" -m dgr2_jax.main --config="$CONFIG" --workdir="$WORKDIR" \
    --config.hardware.num_devices=0 "$@" &
STEP=$!
TERMED=0
trap 'TERMED=1; kill -TERM "$STEP" 2>/dev/null' TERM  # srun passes it on to every task
status=0
while :; do  # the trap wakes `wait` before srun has ended: wait again (bash >= 5.1 for -p)
  unset ended
  wait -n -p ended "$STEP" || status=$?
  [ -n "${ended:-}" ] && break
  status=0
done
# 75: every task saved its step. Told to stop and not finished otherwise (a task killed once one
# exited): the latest checkpoint is complete all the same (Orbax renames a save into place).
if [ "$status" -eq 75 ] || { [ "$TERMED" -eq 1 ] && [ "$status" -ne 0 ]; }; then
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
