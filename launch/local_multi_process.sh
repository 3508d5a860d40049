#!/usr/bin/env bash
# N processes on this machine, as if on N hosts: every process runs COMMAND with the JAX launch
# variables set (coordinator on a free local port, its process id, K CPU devices each).
#
#   bash launch/local_multi_process.sh 2 2 python -m dgr2_jax.main \
#       --config=configs/demo.py:smoke --workdir=/tmp/dgr2_mp
#
# runs, for i in 0 1, concurrently:
#   JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i JAX_PLATFORMS=cpu \
#   XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m dgr2_jax.main ...
# and exits with the first failure's status after killing the other processes (a lone survivor
# would otherwise wait for its peers until the coordinator's heartbeat timeout); SIGTERM to the
# script is passed on to every process, and a preempted run exits 75 (bash >= 5.1). Prints and logs
# come from process 0; the others print only an uncaught error. tests/test_multiprocess.py runs
# exactly this script. DGR2_START_DELAYS="0 5" starts process 1 five seconds late;
# DGR2_PORT picks the port. JAX_PLATFORMS other than cpu is kept (e.g. several GPUs per process).
# PYTHON (default: python3 on PATH) runs the free-port lookup; COMMAND names its own interpreter.
set -uo pipefail
N=${1:?usage: local_multi_process.sh NUM_PROCESSES DEVICES_PER_PROCESS COMMAND...}
K=${2:?usage: local_multi_process.sh NUM_PROCESSES DEVICES_PER_PROCESS COMMAND...}
shift 2
[ $# -gt 0 ] || { echo "local_multi_process.sh: no COMMAND" >&2; exit 2; }
PY=${PYTHON:-$(command -v python3 || command -v python)}
PORT=${DGR2_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
[ -n "$PORT" ] || { echo "local_multi_process.sh: no free port from $PY (set PYTHON or DGR2_PORT)" >&2; exit 2; }
read -r -a DELAYS <<< "${DGR2_START_DELAYS:-}"
pids=()
for ((i = 0; i < N; i++)); do
  (
    sleep "${DELAYS[$i]:-0}"
    exec env JAX_COORDINATOR_ADDRESS="127.0.0.1:$PORT" JAX_NUM_PROCESSES="$N" JAX_PROCESS_ID="$i" \
        JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" \
        XLA_FLAGS="--xla_force_host_platform_device_count=$K ${XLA_FLAGS:-}" "$@"
  ) &
  pids+=($!)
done
# INT kills every process. TERM is a preemption notice (as from a scheduler): passed on to every
# process; training saves one step on all of them and each exits with 75 ("requeue me", see
# docs/training.md), which is not a failure: the others are left to finish, and the script exits 75.
trap 'kill -KILL "${pids[@]}" 2>/dev/null' INT
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for ((n = 0; n < N; n++)); do
  unset done_pid
  wait -n -p done_pid
  rc=$?
  if [ -z "${done_pid:-}" ]; then  # woken by the TERM trap, not by a process: wait again
    n=$((n - 1))
    continue
  fi
  if [ "$rc" -eq 75 ]; then
    status=75
  elif [ "$rc" -ne 0 ]; then
    status=$rc
    kill -KILL "${pids[@]}" 2>/dev/null
    break
  fi
done
wait
exit "$status"
