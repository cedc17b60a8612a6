"""Device meshes and logical-axis sharding rules for parameters, KV caches and batches.

Every array names its dimensions with *logical* axes (`specjax.model.param_shapes`: "vocab", "embed",
"heads", "kv_heads", "head_dim", "mlp", "norm"; activations and caches: "batch", "cache_seq").
`ShardingRules` maps each logical axis to a mesh axis ("data", "model") or to None (replicated); it is
the only place a sharding decision is made, so trying another layout is one mapping, not a rewrite.

The default is data parallelism over "data" and Megatron-style tensor parallelism over "model":
attention is split by heads (wq/wk/wv by output head, wo by input head), the MLP by its hidden units
(w_gate/w_up by column, w_down by row) and the embedding / LM head by vocabulary entry. XLA inserts the
all-reduces after wo and w_down.

Fallback: a dimension whose size is not a multiple of its mesh axis size (SmolLM2's 9 query heads and
3 KV heads over model=4) is replicated instead, with one absl warning per (axis, size, mesh axis). The
program stays correct; it only loses that dimension's memory and compute split. Batches must divide the
"data" axis: `check_batch` raises rather than padding (padding would change a sampled batch's random
draws, so sharded and unsharded runs would no longer agree).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from specjax import int8, ops
from specjax.config import ModelConfig
from specjax.model import KVCache, Params, is_spec, param_shapes

MeshAxes = str | tuple[str, ...] | None


def make_mesh(data: int = -1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 2-D ("data", "model") mesh over `devices` (default: all); -1 means all remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if data == -1 and model == -1:
    raise ValueError("at most one of data, model may be -1")
  if data == -1:
    if model < 1 or n % model:
      raise ValueError(f"model={model} does not divide the {n} devices")
    data = n // model
  elif model == -1:
    if data < 1 or n % data:
      raise ValueError(f"data={data} does not divide the {n} devices")
    model = n // data
  if data < 1 or model < 1 or data * model != n:
    raise ValueError(f"mesh data={data} x model={model} = {data * model} devices, but there are {n} "
                     f"({devices[0].platform}); choose data * model == {n}")
  # Auto axes: shardings are annotations XLA propagates, not part of array types (jax's Explicit mode).
  return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto),
                       devices=devices)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis -> mesh axis (a name, a tuple of names, or None for replicated)."""
  batch: MeshAxes = "data"
  cache_seq: MeshAxes = None
  vocab: MeshAxes = "model"
  embed: MeshAxes = None
  heads: MeshAxes = "model"
  kv_heads: MeshAxes = "model"
  head_dim: MeshAxes = None
  mlp: MeshAxes = "model"
  norm: MeshAxes = None
  stack: MeshAxes = None  # a leading axis stacking per-depth copies of a drafter's parameters
  block_slot: MeshAxes = None  # a block drafter's mask slots (one embedding each; not blocks to unstack)

  def mesh_axes(self, logical: str) -> tuple[str, ...]:
    axes = getattr(self, logical)
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


DEFAULT_RULES = ShardingRules()


@functools.lru_cache(maxsize=None)
def _warn_replicated(logical: str, size: int, mesh_axes: tuple[str, ...], mesh_size: int):
  # lru_cache: one warning per distinct case, not one per layer.
  logging.warning("sharding: logical axis %r of size %d is not divisible by mesh axes %s (size %d); "
                  "replicating that dimension instead", logical, size, mesh_axes, mesh_size)


def logical_to_spec(axes: Sequence[str], shape: Sequence[int], mesh: Mesh,
                    rules: ShardingRules = DEFAULT_RULES) -> PartitionSpec:
  """PartitionSpec for an array with these logical axes; non-divisible or repeated mesh axes replicate."""
  spec, used = [], set()
  for logical, size in zip(axes, shape):
    mesh_axes = tuple(a for a in rules.mesh_axes(logical) if mesh.shape.get(a, 1) > 1)
    mesh_size = math.prod(mesh.shape[a] for a in mesh_axes)
    if not mesh_axes or used & set(mesh_axes):  # a mesh axis may shard only one dimension
      spec.append(None)
    elif size % mesh_size:
      _warn_replicated(logical, size, mesh_axes, mesh_size)
      spec.append(None)
    else:
      used |= set(mesh_axes)
      spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return PartitionSpec(*spec)


def spec_shardings(specs: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
  """A pytree of NamedSharding for a pytree of `ParamSpec` (any parameter declaration: a model's, a drafter's)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_spec(s.axes, s.shape, mesh, rules)), specs,
                      is_leaf=is_spec)


def shard_tree(params: Any, specs: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
  """Places a parameter pytree on the mesh by its declaration `specs` (same structure, `ParamSpec` leaves)."""
  return jax.device_put(params, spec_shardings(specs, mesh, rules))


def abstract_tree(arrays: Any, specs: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
  """`jax.ShapeDtypeStruct`s of `arrays` (arrays or ShapeDtypeStructs) with the shardings `shard_tree` would give
  them: what `jax.jit(f).lower` needs to compile f for a mesh without the arrays, or for devices this host does
  not have (`jax.experimental.topologies`)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), arrays,
                      spec_shardings(specs, mesh, rules))


WEIGHTS = ("", "int8")  # how `abstract_params` holds the matrices: arrays of config.dtype, or int8 codes and scales


def abstract_params(config: ModelConfig, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES,
                    weights: str = "") -> Params:
  """The model's parameters as sharded `jax.ShapeDtypeStruct`s of `config.dtype` (no weights; see `abstract_tree`).
  `weights="int8"`: its matrices as `specjax.int8.Int8` (int8 codes split as the matrix, a `config.dtype` scale per
  output channel split as those channels; norms and biases of `config.dtype`)."""
  if weights not in WEIGHTS:
    raise ValueError(f"weights is one of {WEIGHTS} ('': arrays of config.dtype), got {weights!r}")
  specs = param_shapes(config)
  dtype = jax.numpy.dtype(config.dtype)
  arrays = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=is_spec)
  if weights == "int8":
    arrays, specs = jax.eval_shape(int8.quantize_params, arrays), int8.declare(specs)
  return abstract_tree(arrays, specs, mesh, rules)


def param_shardings(config: ModelConfig, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Params:
  """A pytree of NamedSharding with the structure of the model's parameters."""
  return spec_shardings(param_shapes(config), mesh, rules)


def shard_params(params: Params, config: ModelConfig, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Params:
  """Places parameters on the mesh (a no-op for arrays that already have their target sharding). Quantized weights
  (`specjax.load(..., quantized=True)`) are placed as their float32 values: their kernel runs on one device. int8
  weights (`specjax.int8`) are placed as their codes and scales (`int8.declare`)."""
  specs = param_shapes(config)
  if int8.holds_int8(params):
    specs = int8.declare(specs)
  return shard_tree(ops.dequantize(params, int8_weights=False), specs, mesh, rules)


def shard_model(model, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
  """The same `specjax.Model` with its parameters placed on the mesh; shard once, generate many times."""
  return dataclasses.replace(model, params=shard_params(model.params, model.config, mesh, rules))


def cache_sharding(config: ModelConfig, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES,
                   batch_size: int | None = None, max_len: int | None = None) -> NamedSharding:
  """Sharding of every KVCache array [batch, cache_seq, kv_heads, head_dim].

  Pass batch_size / max_len to apply the divisibility fallback to those dimensions too.
  """
  shape = (batch_size or 0, max_len or 0, config.num_kv_heads, config.head_dim)  # 0 divides everything
  return NamedSharding(mesh, logical_to_spec(("batch", "cache_seq", "kv_heads", "head_dim"), shape, mesh, rules))


def constrain_cache(cache: KVCache, sharding: NamedSharding | None) -> KVCache:
  """Inside jit: pins every cache array to `sharding` (None: leaves the cache to XLA)."""
  if sharding is None:
    return cache
  return jax.lax.with_sharding_constraint(cache, sharding)


def batch_sharding(mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> NamedSharding:
  """Leading (batch) dimension over the data axes, the rest replicated; a pytree prefix for any batch."""
  axes = tuple(a for a in rules.mesh_axes("batch") if a in mesh.shape)
  return NamedSharding(mesh, PartitionSpec(axes or None))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def check_batch(batch_size: int, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
  """Raises unless the batch divides the data-parallel mesh size (we do not pad; see module doc)."""
  data = math.prod(mesh.shape.get(a, 1) for a in rules.mesh_axes("batch"))
  if batch_size % data:
    raise ValueError(f"batch size {batch_size} is not divisible by the mesh's data-parallel size {data} "
                     f"(mesh {dict(mesh.shape)}): use a multiple of {data} rows, or a mesh with a smaller "
                     f"'data' axis, e.g. make_mesh(data=1, model={mesh.size})")


def shard_batch(batch: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
  """Places a pytree of [batch, ...] arrays with rows split over the data axis."""
  for leaf in jax.tree.leaves(batch):
    check_batch(np.shape(leaf)[0], mesh, rules)
  return jax.device_put(batch, batch_sharding(mesh, rules))


def sharding_of(tree: Any) -> Any:
  """The sharding of every array in a pytree (for jit in/out_shardings)."""
  return jax.tree.map(lambda x: x.sharding, tree)
