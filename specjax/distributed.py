"""Multi-process JAX: one program, started once per host (TPU VM worker) or per GPU (SLURM task).

Every process runs the same script. `initialize()` connects them (it must run before anything touches a
device); afterwards `jax.devices()` lists the devices of *all* processes, `sharding.make_mesh()` spans
them, and a jit-compiled function over global arrays runs on all of them at once, each process driving
its own devices (SPMD). Nothing else in specjax changes: meshes, shardings and `generate(..., mesh=mesh)`
are the same code on one process or many.

How the processes find each other, first match wins:
  1. explicit arguments, or the SPECJAX_COORDINATOR / SPECJAX_NUM_PROCESSES / SPECJAX_PROCESS_ID
     environment variables (launch/local_multiprocess.sh sets them);
  2. a cluster JAX detects itself (jax/_src/clusters: SLURM inside `srun`, Open MPI, Cloud TPU VM
     slices and GKE); JAX reads the coordinator, process count and id from the scheduler;
  3. otherwise there is one process and `initialize()` does nothing.

Data: every process must call a compiled function with the same *global* arrays. Either every process
builds the whole batch (simple; fine for prompts), or each process loads only the rows its devices hold
(`process_batch_slice`) and `make_global_batch` assembles the global array without copying across hosts.
Results come back with `to_host`, which gathers arrays that span several processes.

Checkpoints: orbax is multi-host safe. Every process calls `manager.save(...)` / `restore(...)` with the
same arguments (as `specjax.train.train` does); orbax writes each process's shards, lets process 0
write the metadata and commit the step, and barriers between them. The checkpoint directory must be on
a filesystem all hosts share (GCS, NFS). Do not guard saves with `is_main_process()`: that deadlocks.
Guard only host-side side effects that should happen once (printing, writing results.json).
"""

from __future__ import annotations

import logging as std_logging
import os
from typing import Any, Sequence

import jax
import numpy as np
from absl import flags, logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from specjax import sharding

ENV_COORDINATOR = "SPECJAX_COORDINATOR"
ENV_NUM_PROCESSES = "SPECJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SPECJAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return int(value) if value not in (None, "") else None


def detected_cluster() -> tuple[str, int] | None:
  """(name, number of processes) of the cluster JAX would auto-detect (SLURM, Open MPI, TPU, ...), or None.

  Uses JAX's own detectors (jax/_src/clusters), skipping the opt-in ones (mpi4py).
  """
  from jax._src import clusters  # private, but it is exactly what jax.distributed.initialize() consults

  for env in clusters.ClusterEnv._cluster_types:
    if not env.opt_in_only_method and env.is_env_present():
      return env.name, env.get_process_count()
  return None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: Sequence[int] | None = None, *,
               initialization_timeout: int = 300) -> str | None:
  """Connects this process to the others (`jax.distributed.initialize`); a no-op for a single process.

  Call it first thing in main(), before any JAX computation or `jax.devices()`. Arguments left None come
  from SPECJAX_COORDINATOR ("host:port" of process 0), SPECJAX_NUM_PROCESSES and SPECJAX_PROCESS_ID, then
  from the cluster (SLURM, TPU VM slice, ...); outside a cluster all three are needed. `num_processes=1`
  (or SPECJAX_NUM_PROCESSES=1) forces a single process even inside a cluster allocation. On CPU,
  cross-process collectives use gloo.

  Returns how the processes were found ("explicit" or the cluster's name), or None when there is only one
  process (or jax.distributed was already initialized) and nothing was done.
  """
  if jax.distributed.is_initialized():
    return None
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
  process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
  if num_processes == 1:
    return None
  given = [v is not None for v in (coordinator_address, num_processes, process_id)]
  cluster = None if all(given) else detected_cluster()
  if cluster is None and all(given):
    how = "explicit"
  elif cluster is not None and (cluster[1] > 1 or any(given)):
    how = cluster[0]  # JAX fills in from the scheduler what was not given
  elif any(given):
    raise ValueError(f"a multi-process run needs all of coordinator_address ({coordinator_address!r}), "
                     f"num_processes ({num_processes!r}) and process_id ({process_id!r}); set them as "
                     f"arguments, flags or {ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}")
  else:
    return None
  # Cross-process collectives of the CPU backend (recent jax defaults to gloo; older ones had none and
  # failed at the first cross-process all-reduce). A user's choice ("mpi") is kept.
  if jax.config.jax_cpu_collectives_implementation is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, local_device_ids=local_device_ids,
                             initialization_timeout=initialization_timeout)
  logging.info("jax.distributed (%s): process %d of %d, %d local / %d global devices", how,
               jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
  if jax.process_index() != 0:
    std_logging.getLogger("absl").setLevel(std_logging.WARNING)  # one copy of the info logs, from process 0
  return how


def is_main_process() -> bool:
  """True on process 0: the one that prints and writes results files (never guard collective calls)."""
  return jax.process_index() == 0


def process_batch_slice(global_batch: int, mesh: Mesh | None = None,
                        rules: sharding.ShardingRules = sharding.DEFAULT_RULES) -> slice:
  """The rows of a global batch this process should load.

  With a mesh: the rows this process's devices hold when the batch is split over the data axis (all rows
  when the data axis lies within one process, e.g. make_mesh(data=1, model=-1)). Without: an even split by
  process index. Either way `make_global_batch` turns the loaded rows into the global array.
  """
  if mesh is None:
    count, index = jax.process_count(), jax.process_index()
    if global_batch % count:
      raise ValueError(f"global batch {global_batch} is not divisible by the {count} processes")
    rows = global_batch // count
    return slice(index * rows, (index + 1) * rows)
  sharding.check_batch(global_batch, mesh, rules)
  indices = sharding.batch_sharding(mesh, rules).addressable_devices_indices_map((global_batch,))
  starts = sorted({index[0].indices(global_batch)[:2] for index in indices.values()})
  start, stop = starts[0][0], starts[-1][1]
  if sum(b - a for a, b in starts) != stop - start:
    raise ValueError(f"this process's rows {starts} are not contiguous on mesh {dict(mesh.shape)}; "
                     "build the mesh with devices grouped by process (sharding.make_mesh does)")
  return slice(start, stop)


def make_global_batch(local_batch: Any, mesh: Mesh, global_batch: int,
                      rules: sharding.ShardingRules = sharding.DEFAULT_RULES) -> Any:
  """A pytree of global [global_batch, ...] arrays from each process's rows (`process_batch_slice`).

  Single-process, this is `sharding.shard_batch`. Processes whose devices hold the same rows must pass
  the same rows.
  """
  target = sharding.batch_sharding(mesh, rules)
  sharding.check_batch(global_batch, mesh, rules)
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(target, np.asarray(x), (global_batch, *np.shape(x)[1:])),
      local_batch)


def to_host(tree: Any) -> Any:
  """numpy copies of a pytree of arrays on every process, gathering arrays that span several processes.

  `jax.device_get` only reads arrays whose shards are all on this process; an array split across processes
  is all-gathered first (a collective: every process must call `to_host` on the same arrays).
  """

  def fetch(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:  # every process already holds all of it
        return np.asarray(x.addressable_data(0))
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))

  return jax.tree.map(fetch, tree)


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier of this name (a no-op for one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------------- absl flags

_FLAG_NAMES = ("coordinator_address", "num_processes", "process_id")


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines --coordinator_address, --num_processes and --process_id (call once, at import time)."""
  flags.DEFINE_string("coordinator_address", None, f"host:port of process 0 for a multi-process run "
                      f"(default: ${ENV_COORDINATOR}, or detected on SLURM / TPU VMs).", flag_values=flag_values)
  flags.DEFINE_integer("num_processes", None, f"Processes in a multi-process run (default: "
                       f"${ENV_NUM_PROCESSES}, or detected; 1 forces a single process).", flag_values=flag_values)
  flags.DEFINE_integer("process_id", None, f"This process's index in [0, num_processes) (default: "
                       f"${ENV_PROCESS_ID}, or detected).", flag_values=flag_values)


def initialize_from_flags(flag_values: flags.FlagValues = flags.FLAGS, **kwargs) -> str | None:
  """`initialize` with the values of the flags from `define_flags` (None where not given)."""
  return initialize(**{name: flag_values[name].value for name in _FLAG_NAMES}, **kwargs)
