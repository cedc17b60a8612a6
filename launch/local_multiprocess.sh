#!/usr/bin/env bash
# Runs N copies of a command as one multi-process JAX program on this machine (CPU, gloo collectives):
# the same setup as N hosts, for trying multi-host code on a laptop or in CI.
#
#   launch/local_multiprocess.sh              # 2 processes: the quickstart, SmolLM2 split over both
#   launch/local_multiprocess.sh -n 2 -d 2 -- python -m experiments.run --config=configs/quickstart.py \
#       --config.mesh_shape="(1,4)" --config.max_new_tokens=16 --workdir=/tmp/quickstart-2proc
#   launch/local_multiprocess.sh -n 2 -- python -c \
#       'from specjax import distributed; distributed.initialize(); import jax; print(jax.devices())'
#
# Each process gets SPECJAX_COORDINATOR=127.0.0.1:PORT, SPECJAX_NUM_PROCESSES=N, SPECJAX_PROCESS_ID=i
# (read by specjax.distributed.initialize()), JAX_PLATFORMS=cpu and D host devices
# (--xla_force_host_platform_device_count), so the global mesh has N * D devices.
# Output lines are prefixed with "[i]". If one process fails, the others are stopped and its exit
# status is returned (a multi-process program cannot finish without all of its processes); Python's
# output is unbuffered (PYTHONUNBUFFERED=1), so what a stopped process printed is not lost with it.
set -euo pipefail

NUM_PROCESSES=2
DEVICES_PER_PROCESS=1
PORT=""

usage() {
  sed -n '2,/^set /p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  echo "options: -n NUM_PROCESSES (default 2)  -d DEVICES_PER_PROCESS (default 1)  -p PORT (default: a free one)"
}

while getopts "n:d:p:h" opt; do
  case "$opt" in
    n) NUM_PROCESSES="$OPTARG" ;;
    d) DEVICES_PER_PROCESS="$OPTARG" ;;
    p) PORT="$OPTARG" ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ $# -eq 0 ]]; then  # the quickstart with SmolLM2 split over all N * D devices (tensor parallel)
  set -- python -m experiments.run --config=configs/quickstart.py "--config.mesh_shape=(1,-1)"
fi

PYTHON="${PYTHON:-python}"
if [[ -z "$PORT" ]]; then
  PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi

export JAX_PLATFORMS=cpu
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${DEVICES_PER_PROCESS}"
export SPECJAX_COORDINATOR="127.0.0.1:${PORT}"
export SPECJAX_NUM_PROCESSES="${NUM_PROCESSES}"
# Into a pipe Python buffers stdout in blocks, and a process stopped by SIGTERM never flushes them.
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"

pids=()
stop_all() {
  for pid in ${pids[@]+"${pids[@]}"}; do
    kill "$pid" 2>/dev/null || true
  done
}
trap 'stop_all' EXIT
trap 'stop_all; exit 130' INT TERM

prefix() {  # prefixes each line with the process index, line by line (portable `sed -u`)
  local line
  while IFS= read -r line || [[ -n "$line" ]]; do
    printf '[%s] %s\n' "$1" "$line"
  done
}

echo "local_multiprocess: ${NUM_PROCESSES} processes x ${DEVICES_PER_PROCESS} CPU devices, coordinator" \
     "${SPECJAX_COORDINATOR}: $*" >&2
for ((i = 0; i < NUM_PROCESSES; i++)); do
  SPECJAX_PROCESS_ID="$i" "$@" > >(prefix "$i") 2>&1 &
  pids+=("$!")
done

# Poll rather than `wait -n` (bash >= 4.3): the first failure stops the rest, which would otherwise
# block in their next collective until jax's heartbeat timeout.
status=0
finished=()
while ((${#finished[@]} < NUM_PROCESSES)); do
  for i in "${!pids[@]}"; do
    [[ -n "${finished[$i]:-}" ]] && continue
    kill -0 "${pids[$i]}" 2>/dev/null && continue
    rc=0
    wait "${pids[$i]}" || rc=$?
    finished[i]=1
    if ((rc != 0)); then
      echo "local_multiprocess: process $i exited with status ${rc}; stopping the others" >&2
      status=$rc
      break 2
    fi
  done
  sleep 0.5
done
stop_all
wait 2>/dev/null || true
exit "$status"
