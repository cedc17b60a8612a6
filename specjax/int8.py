"""int8 weight-only quantization for accelerators: each matrix as int8 codes and a scale per output channel.

A matrix W [K, N] (its first `k_dims` axes contracted: wq [D, H, hd], K = D; wo [H, hd, D], K = H * hd) is stored as
codes c = round(W / s) in [-127, 127] (int8, W's shape) and, per output column n, s_n = max_k |W_kn| / 127 (in the
model's dtype: bf16 on a TPU); an embedding table [vocab, embed], whose rows are the tied LM head's columns, has a
scale per row (`transposed`). Half the bytes of bf16 weights, so a memory-bound decode step reads about half.

A product needs no dequantized copy of the weight: the scale of an output column multiplies that column of the
product, so

  x @ W = (x @ c) * s                                                       (`matmul`)

with c converted to x's dtype where the product reads it (exact: integers up to 256 are bf16's), which XLA fuses into
the product on an accelerator (the int8 codes are what it reads from HBM), and s applied to the small output. This is
the weight type `specjax.ops` multiplies (`ops.matmul`, `ops.take`), beside the GGUF blocks of
`specjax.backends.cpu.Quantized` (a CPU's kernels): model code is the same for both. `quantize_params` makes a model's
parameters int8 (with `jax.eval_shape`, their abstract shapes: `specjax.sharding.abstract_params(..., weights="int8")`
compiles programs for TPU topologies without weights, experiments/compile_for.py); `declare` gives their logical axes
(the codes split as the matrix, the scales as its output axes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.stored_matrix import StoredMatrix

# The matrices quantized, by parameter name, and the axes their products contract (`k_dims`); the embedding table
# [vocab, embed] is read as the tied head's transpose (a scale per vocabulary row). Norms and biases stay arrays.
MATRICES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1, "lm_head": 1, "embed": 1}
TABLES = ("embed",)
LEVELS = 127  # codes in [-127, 127]: symmetric, so that -W's codes are -c


@struct.dataclass
class Int8(StoredMatrix):
  """W ~ codes * scale (module docstring): logically the array of `shape` in `dtype` (the scale's), used as the matrix
  [K, N] of a product x @ W (its first `k_dims` axes K), or with `transposed` as that matrix's transpose [N, K] (an
  embedding table: scale [N], one per row)."""
  codes: jax.Array  # int8, the shape of W
  scale: jax.Array  # W's output axes: shape[k_dims:] ([N] for a table, `transposed`)
  k_dims: int = struct.field(pytree_node=False, default=1)
  transposed: bool = struct.field(pytree_node=False, default=False)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.codes.shape)

  @property
  def dtype(self):
    return jnp.dtype(self.scale.dtype)

  @property
  def nbytes(self) -> int:
    return int(self.codes.nbytes + self.scale.nbytes)

  @property
  def T(self) -> "Int8":
    """The transpose of a 2-D array (an embedding table read as its LM head, and back)."""
    self._check_transpose("int8")
    return self.replace(codes=self.codes.T, k_dims=1, transposed=not self.transposed)

  def reshape(self, *shape) -> "Int8":
    """The same codes as the matrix [K, N] (-1 for one size), as model code reshapes a weight before a product."""
    k, n = self._matrix_for(shape, "an int8 weight")
    return self.replace(codes=self.codes.reshape(k, n), scale=self.scale.reshape(n), k_dims=1)

  def dequantize(self) -> jax.Array:
    """The array of `shape` in `dtype`: codes * scale."""
    scale = self.scale[:, None] if self.transposed else self.scale
    return self.codes.astype(self.dtype) * scale

  def take(self, ids: jax.Array, axis: int = 0) -> jax.Array:
    """jnp.take(self.dequantize(), ids, axis) along the axis of W's columns (a table's rows, axis 0; a 2-D head's
    columns, axis 1), converting the gathered entries only."""
    if self.ndim != 2 or axis % 2 != (0 if self.transposed else 1):
      raise ValueError(f"an int8 array of shape {self.shape} gathers along the axis of its matrix's columns "
                       f"({0 if self.transposed else 1}), not {axis}")
    ids = jnp.asarray(ids, jnp.int32)
    codes = jnp.take(self.codes, ids, axis=axis).astype(self.dtype)
    scale = jnp.take(self.scale, ids, axis=0)
    return codes * (scale[..., None] if self.transposed else scale)


def quantize(w: jax.Array, k_dims: int = 1, transposed: bool = False) -> Int8:
  """W as `Int8`: a scale per output channel (max |W| over the inputs / 127; 1 where a channel is zero), the codes
  rounded to nearest. The scale keeps W's dtype."""
  w = jnp.asarray(w)
  inputs = (w.ndim - 1,) if transposed else tuple(range(k_dims))
  most = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=inputs)
  scale = jnp.where(most > 0, most / LEVELS, 1.0)
  expanded = scale[:, None] if transposed else scale
  codes = jnp.clip(jnp.round(w.astype(jnp.float32) / expanded), -LEVELS, LEVELS).astype(jnp.int8)
  return Int8(codes=codes, scale=scale.astype(w.dtype), k_dims=1 if transposed else k_dims, transposed=transposed)


def _name(path) -> str | None:
  last = path[-1] if path else None
  return getattr(last, "key", None)


def quantize_params(params):
  """A model's parameters (`specjax.model.param_shapes`) with every matrix of `MATRICES` as `Int8`; norms and biases
  as they are. Under `jax.eval_shape`, the abstract int8 parameters of abstract ones."""
  def convert(path, w):
    name = _name(path)
    if name not in MATRICES:
      return w
    return quantize(w, MATRICES[name], transposed=name in TABLES)
  return jax.tree_util.tree_map_with_path(convert, params)


def declare(specs):
  """The logical axes of `quantize_params`'s tree, from the model's (`specjax.model.param_shapes`, `ParamSpec`
  leaves): each matrix an `Int8` of its own spec (the codes) and of its output axes' (the scale), so that a mesh splits
  the codes as the matrix and each scale as its channels."""
  def convert(path, spec):
    name = _name(path)
    if name not in MATRICES:
      return spec
    k_dims = MATRICES[name]
    if name in TABLES:
      return Int8(codes=spec, scale=spec._replace(shape=spec.shape[:1], axes=spec.axes[:1]), transposed=True)
    return Int8(codes=spec, scale=spec._replace(shape=spec.shape[k_dims:], axes=spec.axes[k_dims:]), k_dims=k_dims)
  return jax.tree_util.tree_map_with_path(convert, specs, is_leaf=lambda x: hasattr(x, "axes"))


def holds_int8(tree) -> bool:
  """Whether a parameter tree has an `Int8` weight."""
  return any(isinstance(x, Int8) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Int8)))


def matmul(x: jax.Array, w: Int8, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ W -> [..., N] as (x @ codes) * scale (module docstring): the codes converted to x's dtype inside the
  product, the scale on its output."""
  k, n = w.matrix_shape
  if w.transposed:  # a table [N, K]
    out = jnp.einsum("...k,nk->...n", x, w.codes.astype(x.dtype), preferred_element_type=preferred_element_type)
  else:
    out = jnp.matmul(x, w.codes.reshape(k, n).astype(x.dtype), preferred_element_type=preferred_element_type)
  return out * w.scale.reshape(n).astype(out.dtype)
