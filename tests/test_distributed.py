"""Multi-process JAX: two local CPU processes (gloo collectives) form one 4-device mesh and compute exactly
what one unsharded process computes; process detection and the launch scripts.

The two processes are started by launch/local_multiprocess.sh (so the script is tested too) running
tests/distributed_worker.py; the single-device reference runs in this process meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from absl import flags

from specjax import distributed
from tests import distributed_worker

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO_ROOT, "launch")
TIMEOUT_S = 300  # a hang (a process stuck in a collective) fails the test instead of blocking CI
CLUSTER_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                "OMPI_MCA_orte_hnp_uri", distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
                distributed.ENV_PROCESS_ID, "JAX_COORDINATOR_ADDRESS")


def run_command(command: list[str], env: dict, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
  """Runs in its own process group, killed as a whole on timeout (the launcher's children included)."""
  proc = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  try:
    output, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    output, _ = proc.communicate()
    raise AssertionError(f"{command} did not finish within {timeout} s:\n{output[-6000:]}")
  return subprocess.CompletedProcess(command, proc.returncode, output, None)


def clean_env(**extra: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS and k != "XLA_FLAGS"}
  env.update(extra)
  return env


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  """Both processes' results, the single-device reference and the wall time of the 2-process run."""
  out_dir = tmp_path_factory.mktemp("two_processes")
  command = ["bash", os.path.join(LAUNCH, "local_multiprocess.sh"), "-n", "2", "-d", "2", "--",
             sys.executable, os.path.join(REPO_ROOT, "tests", "distributed_worker.py"), str(out_dir)]
  start = time.perf_counter()
  proc = subprocess.Popen(command, env=clean_env(PYTHON=sys.executable), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    reference = distributed_worker.compute(mesh=None)  # overlaps with the two processes
    output, _ = proc.communicate(timeout=max(1.0, TIMEOUT_S - (time.perf_counter() - start)))
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    output, _ = proc.communicate()
    raise AssertionError(f"the 2-process run did not finish within {TIMEOUT_S} s:\n{output[-6000:]}")
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  seconds = time.perf_counter() - start
  assert proc.returncode == 0, f"the 2-process run failed (exit {proc.returncode}):\n{output[-8000:]}"
  results = []
  for i in range(2):
    with open(out_dir / f"process_{i}.json") as f:
      results.append(json.load(f))
  return results, reference, seconds


@pytest.mark.slow
def test_two_processes_form_one_global_mesh(two_processes):
  results, _, _ = two_processes
  for i, result in enumerate(results):
    assert result["how"] == "explicit"
    assert (result["process_index"], result["process_count"]) == (i, 2)
    assert (result["local_devices"], result["global_devices"]) == (2, 4)
    assert result["is_main_process"] == (i == 0)
  # data=2 x model=2: each process's devices hold one half of the batch, and it loads only that half.
  assert [r["rows"] for r in results] == [[0, 2], [2, 4]]


@pytest.mark.slow
def test_greedy_generate_across_processes_equals_single_device(two_processes):
  results, reference, _ = two_processes
  assert len(reference["tokens"]) == distributed_worker.GLOBAL_BATCH
  assert all(len(row) == distributed_worker.MAX_NEW_TOKENS for row in reference["tokens"])
  for result in results:
    assert result["tokens"] == reference["tokens"]


@pytest.mark.slow
def test_greedy_speculative_layer_skip_across_processes_equals_single_device(two_processes):
  results, reference, _ = two_processes
  assert reference["speculative_tokens"] == reference["tokens"]  # greedy speculative decoding is lossless
  for result in results:
    assert result["speculative_tokens"] == reference["tokens"]


@pytest.mark.slow
def test_train_steps_across_processes_equal_single_device(two_processes):
  results, reference, _ = two_processes
  for result in results:
    np.testing.assert_allclose(result["losses"], reference["losses"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(result["grad_norms"], reference["grad_norms"], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(result["wq_after"], reference["wq_after"], atol=1e-5, rtol=0)
  assert not np.allclose(reference["wq_after"], 0)


@pytest.mark.slow
def test_two_process_run_is_quick(two_processes):
  _, _, seconds = two_processes
  assert seconds < 240, f"the 2-process run took {seconds:.0f} s"


# ------------------------------------------------------------------------------- process detection


@pytest.fixture
def no_cluster(monkeypatch):
  for name in CLUSTER_VARS:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_initialize_is_a_noop_for_a_single_process(no_cluster):
  assert distributed.detected_cluster() is None
  assert distributed.initialize() is None
  no_cluster.setenv(distributed.ENV_NUM_PROCESSES, "1")
  assert distributed.initialize(coordinator_address="127.0.0.1:1234") is None
  assert distributed.is_main_process()


def test_initialize_needs_coordinator_count_and_id_together(no_cluster):
  with pytest.raises(ValueError, match="coordinator_address"):
    distributed.initialize(num_processes=2, process_id=0)
  no_cluster.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
  with pytest.raises(ValueError, match="process_id"):
    distributed.initialize(num_processes=2)


def set_slurm_env(monkeypatch, num_tasks: int):
  """The variables `srun` sets in each task (what JAX's SLURM detection reads)."""
  for name, value in {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[017-018]",
                      "SLURM_NTASKS": str(num_tasks), "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
    monkeypatch.setenv(name, value)


def test_slurm_tasks_are_detected(no_cluster):
  set_slurm_env(no_cluster, num_tasks=16)
  assert distributed.detected_cluster() == ("slurm", 16)
  set_slurm_env(no_cluster, num_tasks=1)  # a single-task allocation: nothing to connect
  assert distributed.initialize() is None


def test_flags_feed_initialize(no_cluster):
  flag_values = flags.FlagValues()
  distributed.define_flags(flag_values)
  flag_values(["run", "--num_processes=2", "--process_id=1"])
  with pytest.raises(ValueError, match="coordinator_address"):
    distributed.initialize_from_flags(flag_values)
  flag_values(["run", "--num_processes=1"])
  assert distributed.initialize_from_flags(flag_values) is None


def test_process_batch_slice_single_process():
  assert distributed.process_batch_slice(6) == slice(0, 6)
  from specjax import sharding
  assert distributed.process_batch_slice(6, sharding.make_mesh(1, 1)) == slice(0, 6)


# ---------------------------------------------------------------------------------------- scripts


@pytest.mark.slow
@pytest.mark.parametrize("script", ["local_multiprocess.sh", "slurm.sbatch", "tpu_vm.sh"])
def test_launch_script_syntax(script):
  proc = subprocess.run(["bash", "-n", os.path.join(LAUNCH, script)], capture_output=True, text=True, timeout=30)
  assert proc.returncode == 0, proc.stderr


# Prints its line, says so in the ready folder (argv[1]); process 1 then fails once every process has printed
# (a peer stopped before it started would have nothing to show), the others wait to be stopped.
STARTUP_WORKER = """
import os, pathlib, sys, time
index, ready = int(os.environ["SPECJAX_PROCESS_ID"]), pathlib.Path(sys.argv[1])
print(f"process {index} of {os.environ['SPECJAX_NUM_PROCESSES']} at {os.environ['SPECJAX_COORDINATOR']}")
(ready / str(index)).touch()
if index == 1:
  while len(list(ready.iterdir())) < 3:
    time.sleep(0.01)
  sys.exit(7)
time.sleep(60)
"""


@pytest.mark.slow
def test_local_multiprocess_stops_the_others_when_one_fails(tmp_path):
  """The failing process's status comes back at once, and nothing the stopped processes printed is lost.

  Python block-buffers stdout into the launcher's pipe and a stopped process never flushes it, so this
  fails unless the launcher makes Python's output unbuffered.
  """
  env = clean_env(PYTHON=sys.executable)
  env.pop("PYTHONUNBUFFERED", None)  # the launcher must set it itself
  command = ["bash", os.path.join(LAUNCH, "local_multiprocess.sh"), "-n", "3", "--", sys.executable, "-c",
             STARTUP_WORKER, str(tmp_path)]
  start = time.perf_counter()
  proc = run_command(command, env, timeout=60)
  assert proc.returncode == 7, proc.stdout
  assert time.perf_counter() - start < 30, proc.stdout  # did not wait for the sleeping processes
  assert sorted(os.listdir(tmp_path)) == ["0", "1", "2"]
  for i in range(3):
    assert f"[{i}] process {i} of 3 at 127.0.0.1:" in proc.stdout, proc.stdout


def write_executable(path, text: str) -> None:
  path.write_text(text)
  path.chmod(0o755)


FAKE_SRUN = """#!/usr/bin/env bash
# srun stand-in: logs its arguments, then starts FAKE_SRUN_TASKS local tasks with the variables srun sets
# (all on "localhost"), each running FAKE_SRUN_TASK instead of the real command.
printf '%s\\n' "$@" > "$FAKE_SRUN_LOG"
pids=()
for ((i = 0; i < FAKE_SRUN_TASKS; i++)); do
  SLURM_STEP_NODELIST=localhost SLURM_NTASKS="$FAKE_SRUN_TASKS" SLURM_PROCID="$i" SLURM_LOCALID="$i" \\
    "$PYTHON" -c "$FAKE_SRUN_TASK" > "$FAKE_SRUN_LOG.task$i" 2>&1 &
  pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""

SLURM_TASK = """
import json, os
from specjax import distributed
how = distributed.initialize(initialization_timeout=60)
import jax, numpy as np
from jax.experimental import multihost_utils
total = multihost_utils.process_allgather(np.array([jax.process_index() + 1]), tiled=True)
print("RESULT", json.dumps({"how": how, "index": jax.process_index(), "count": jax.process_count(),
                            "sum": int(total.sum()), "port": os.environ["JAX_COORDINATOR_PORT"]}))
"""


def free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_slurm_script_joins_its_tasks_through_jax_slurm_detection(tmp_path):
  """slurm.sbatch under a stand-in srun: the tasks find each other from the SLURM_* variables alone."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  write_executable(bin_dir / "srun", FAKE_SRUN)
  log = tmp_path / "srun.log"
  port = str(free_port())
  env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=sys.executable, FAKE_SRUN_LOG=str(log),
                  FAKE_SRUN_TASKS="2", FAKE_SRUN_TASK=SLURM_TASK, SLURM_JOB_ID="4242", SLURM_JOB_NAME="specjax",
                  REPO=REPO_ROOT, WORKDIR=str(tmp_path / "workdir"), JAX_COORDINATOR_PORT=port,
                  CONFIG="configs/spec_bench.py", JAX_PLATFORMS="cpu")
  proc = run_command(["bash", os.path.join(LAUNCH, "slurm.sbatch"), "--config.max_new_tokens=8"], env,
                     timeout=120)
  tasks = [(tmp_path / f"srun.log.task{i}").read_text() for i in range(2)]
  assert proc.returncode == 0, proc.stdout + "\n".join(tasks)
  assert log.read_text().split("\n")[:-1] == [
      "--kill-on-bad-exit=1", sys.executable, "-m", "experiments.run", "--config=configs/spec_bench.py",
      f"--workdir={tmp_path / 'workdir'}", "--config.mesh_shape=(1,-1)", "--config.max_new_tokens=8"]
  assert (tmp_path / "workdir").is_dir()
  for i, output in enumerate(tasks):
    result = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])
    assert result == {"how": "slurm", "index": i, "count": 2, "sum": 3, "port": port}


FAKE_GCLOUD = """#!/usr/bin/env bash
# gcloud stand-in: logs each call (a JSON list of its arguments per line); lists the archive it is asked to
# copy; fails the experiment run when FAKE_GCLOUD_FAIL_RUN=1.
"$PYTHON" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" >> "$FAKE_GCLOUD_LOG"
for arg in "$@"; do
  case "$arg" in
    *.tar.gz) [[ -f "$arg" ]] && tar -tzf "$arg" > "$FAKE_GCLOUD_LOG.archive" ;;
    --command=*experiments.run*) [[ "${FAKE_GCLOUD_FAIL_RUN:-0}" == 1 ]] && exit 5 ;;
  esac
done
exit 0
"""


def run_tpu_script(tmp_path, fail_run: bool, args: tuple[str, ...] = ("--config.max_new_tokens=8",)):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  write_executable(bin_dir / "gcloud", FAKE_GCLOUD)
  log = tmp_path / "gcloud.log"
  env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=sys.executable, FAKE_GCLOUD_LOG=str(log),
                  PROJECT="proj",
                  ZONE="us-central2-b", ACCELERATOR_TYPE="v4-16", NAME="specjax-test",
                  RESULTS_DIR=str(tmp_path / "results"), FAKE_GCLOUD_FAIL_RUN="1" if fail_run else "0")
  proc = run_command(["bash", os.path.join(LAUNCH, "tpu_vm.sh"), *args], env, timeout=60)
  calls = [json.loads(line) for line in log.read_text().splitlines()]
  return proc, calls


@pytest.mark.slow
def test_tpu_vm_script_creates_installs_runs_copies_back_and_deletes(tmp_path):
  proc, calls = run_tpu_script(tmp_path, fail_run=False)
  assert proc.returncode == 0, proc.stdout
  assert [c[3] for c in calls] == ["create", "scp", "ssh", "ssh", "scp", "delete"]
  assert all(c[:3] == ["compute", "tpus", "tpu-vm"] and "--zone=us-central2-b" in c and "--project=proj" in c
             for c in calls)
  create, copy, install, run, results, delete = calls
  assert create[4] == "specjax-test" and "--accelerator-type=v4-16" in create
  assert "--worker=all" in copy and "--worker=all" in install and "--worker=all" in run
  archive = (tmp_path / "gcloud.log.archive").read_text().split()
  assert "specjax/distributed.py" in archive and "pyproject.toml" in archive
  assert any("pip install" in arg and "-e ~/specjax" in arg for arg in install)
  assert ("--command=cd ~/specjax && python3 -m experiments.run --config=configs/quickstart.py "
          r"--workdir=workdirs/specjax-test --config.mesh_shape=\(1\,-1\) --config.max_new_tokens=8 ") in run
  assert "--worker=0" in results and "--recurse" in results and str(tmp_path / "results") in results
  assert delete[4] == "specjax-test" and "--quiet" in delete


@pytest.mark.slow
def test_tpu_vm_script_deletes_the_slice_when_the_run_fails(tmp_path):
  proc, calls = run_tpu_script(tmp_path, fail_run=True, args=("--config.mesh_shape=(2,4)",))
  assert proc.returncode == 5
  assert [c[3] for c in calls] == ["create", "scp", "ssh", "ssh", "delete"]
  run = next(arg for arg in calls[3] if arg.startswith("--command="))
  assert run.count("--config.mesh_shape") == 1 and r"--config.mesh_shape=\(2\,4\)" in run  # the caller's wins
