"""Weights packed as column panels, the layout the product kernel (kernels.cc: PackedMatmul) reads.

XLA:CPU's general matrix product packs the weight matrix into a scratch layout on every call; packing once, when a
model is loaded for decoding, lets the kernel stream each weight exactly once, in order, whatever the number of
rows. A `Packed` weight is logically the matrix [K, N]; it is stored as ceil(N / PANEL) panels, each one
contiguous run of K x PANEL values.

  pack(w, k_dims)                   a weight as column panels (`Packed`); `Packed.unpack` gives it back
  pack_params(params, cfg)          a decoder's parameters as the decode loop reads them
                                    (`specjax.decoding.decode_params`)
  pack_draft_params(params, specs)  a drafter's own parameters likewise (`specjax.decoding.decode_draft_params`)
  matmul_panels(x, w)               x @ a `Packed` weight with jnp: where the kernel does not run (other platforms,
                                    shapes it does not take, gradients)

The packed tree fuses the products that read the same input: a layer's "wqkv" (wq, wk and wv side by side) and
"w_gate_up" (w_gate and w_up), so one kernel call streams each group; `specjax.model` reads either layout. A
quantized weight (`quantized.Quantized`) is already laid out as panels: packing only puts such weights side by side.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.backends.cpu import kernels, quantized

PANEL = kernels.PANEL  # output columns per packed panel


@struct.dataclass
class Packed:
  """A weight stored for the product kernel. Logically an array of `shape` used as the matrix [K, N], K the
  product of its first `k_dims` sizes (wq [D, H, hd]: K = D; wo [H, hd, D]: K = H * hd); stored as `data`
  [ceil(N / PANEL), K, PANEL]: panel b holds columns b * PANEL ... (b + 1) * PANEL - 1, zeros past N."""
  data: jax.Array
  shape: tuple[int, ...] = struct.field(pytree_node=False)
  k_dims: int = struct.field(pytree_node=False, default=1)

  @property
  def dtype(self):
    return self.data.dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def matrix_shape(self) -> tuple[int, int]:
    return _matrix_shape(self.shape, self.k_dims)

  def reshape(self, *shape) -> "Packed":
    """The same panels as the matrix [K, N] (-1 for one size), as model code reshapes an array before a product:
    wo [H, hd, D] read as [H * hd, D]. Any other shape is an error: the panels fix which axes are contracted."""
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    k, n = self.matrix_shape
    if len(shape) != 2 or tuple(shape) not in ((k, n), (-1, n), (k, -1)):
      raise ValueError(f"a weight packed as the matrix {(k, n)} (shape {self.shape}) cannot be read as {shape}")
    return Packed(data=self.data, shape=(k, n), k_dims=1)

  def unpack(self) -> jax.Array:
    """The weight as the array it was packed from."""
    k, n = self.matrix_shape
    return self.data.transpose(1, 0, 2).reshape(k, -1)[:, :n].reshape(self.shape)


def _matrix_shape(shape, k_dims: int) -> tuple[int, int]:
  """(K, N) of an array of `shape` whose first `k_dims` axes are contracted."""
  return (int(np.prod(shape[:k_dims], dtype=np.int64)), int(np.prod(shape[k_dims:], dtype=np.int64)))


def pack(w: jax.Array, k_dims: int = 1) -> Packed:
  """w (the first `k_dims` axes contracted) as column panels; `unpack` returns it unchanged."""
  shape = tuple(int(d) for d in w.shape)
  k, n = _matrix_shape(shape, k_dims)
  m = jnp.asarray(w).reshape(k, n)
  pad = -n % PANEL
  if pad:
    m = jnp.pad(m, ((0, 0), (0, pad)))
  return Packed(data=m.reshape(k, -1, PANEL).transpose(1, 0, 2), shape=shape, k_dims=k_dims)


def matmul_panels(x: jax.Array, w: Packed, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w -> [..., N] with jnp: one product over the panels [NB, K, P], the padding columns cut off."""
  out = kernels.panels_product(x, w.data, preferred_element_type)
  n = w.matrix_shape[1]
  return out if out.shape[-1] == n else out[..., :n]


def _is_array(w) -> bool:
  return isinstance(w, (jax.Array, np.ndarray))


def _packed(w, k_dims: int = 1):
  """A weight as the kernels read it: an array packed as panels; a weight of its own type as it is (quantized
  blocks are panels already; int8 codes, `specjax.int8.Int8`, are multiplied with jnp)."""
  return pack(w, k_dims) if _is_array(w) else w


def _side_by_side(weights: list, d: int):
  """Weights that multiply one input [.., D] as one weight [D, N1 + N2 + ...] (one product for all), or None where
  they cannot be: quantized weights of different types, quantized beside float ones, weights of other types."""
  if all(isinstance(w, quantized.Quantized) for w in weights):
    return quantized.concatenate([w.reshape(d, -1) for w in weights])
  if not all(_is_array(w) for w in weights):
    return None
  return pack(jnp.concatenate([w.reshape(d, -1) for w in weights], axis=1))


# The products that read the same input, and the name of the one weight that does all of them.
_FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def pack_layer(layer: dict) -> dict:
  """A decoder layer's matrices as `Packed` panels, as decoding reads them: "wqkv" (wq, wk and wv side by side,
  one product for the three), "wo", "w_gate_up" (w_gate, w_up side by side) and "w_down"; norms and biases as they
  are. Quantized matrices (`quantized.Quantized`) are panels already: those of one type go side by side; where
  types differ (Gemma-3-270M's Q4_K_M file: Q5_0 queries beside Q8_0 values), they stay apart, each its own
  product."""
  d = layer["wq"].shape[0]
  packed = {name: w for name, w in layer.items()
            if name not in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}  # norms and biases
  for fused, names in _FUSED.items():
    together = _side_by_side([layer[n] for n in names], d)
    if together is None:
      packed.update({n: _packed(layer[n]) for n in names})
    else:
      packed[fused] = together
  packed["wo"] = _packed(layer["wo"], k_dims=2)
  packed["w_down"] = _packed(layer["w_down"])
  return packed


def pack_params(params: dict, config) -> dict:
  """The parameters as the decode loop reads them where the kernels run: every layer's matrices packed
  (`pack_layer`), and the output projection (the LM head, or the tied embedding table transposed) packed as
  "lm_head_packed" beside the arrays it comes from (the embedding lookup and drafters read those).
  `specjax.model.forward` gives the same results from either tree (to float32 rounding); the packed tree is a
  second copy of the weights. Returned unchanged where the kernels do not run (`kernels.available()`)."""
  if "lm_head_packed" in params or not kernels.available():
    return params
  packed = dict(params)
  packed["layers"] = [pack_layer(layer) for layer in params["layers"]]
  head = params["embed"].T if config.tie_embeddings else params["lm_head"]
  packed["lm_head_packed"] = _packed(head)  # a quantized table's transpose is its blocks again: no copy
  return packed


def pack_draft_params(params, specs: dict | None = None):
  """A drafter's own parameters as the decode loop reads them where the kernels run: a draft model's layers
  (`pack_layer`), a truncated draft vocabulary's output head ("head"), and blocks of the target's kind stacked along a
  leading "stack" axis of `specs` (the drafter's `param_specs`: sequential MTP modules, a block drafter's blocks) as a
  list "blocks" of one dict per block, its decoder arrays `pack_layer`'s and its other matrices packed (`unstack`);
  the rest as it is. Unstacked, a block is read where it lies: XLA:CPU copies a slice of a stacked array before a
  product reads it, which reads every block but the first twice and writes it once per use."""
  if not isinstance(params, dict) or not kernels.available():
    return params
  packed = dict(params)
  if isinstance(params.get("layers"), list):
    packed["layers"] = [pack_layer(layer) for layer in params["layers"]]
  if "head" in params:
    packed["head"] = pack(params["head"])
  stacked = {k: spec for k, spec in (specs or {}).items()  # a draft model's specs hold lists of layers' too
             if getattr(spec, "axes", ())[:1] == ("stack",) and k in params}
  if "wq" in stacked:  # blocks of a decoder layer's arrays (parallel heads' stacked matrices stay one product)
    packed["blocks"] = unstack({k: params[k] for k in stacked}, stacked)
    for k in stacked:
      del packed[k]
  return packed


def unstack(stacked: dict, specs: dict) -> list[dict]:
  """Blocks stacked along their first axis as a list of one dict per block: a decoder layer's matrices packed
  (`pack_layer`), any other matrix (an axis "embed" among two or more besides the stack: an MTP module's input
  projection) packed whole; norms and biases as they are."""
  layer_keys = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
  blocks = []
  for i in range(stacked["wq"].shape[0]):
    block = {k: v[i] for k, v in stacked.items()}
    others = {k: w for k, w in block.items() if k not in layer_keys}
    matrices = {k for k in others if len(specs[k].axes) >= 3 and "embed" in specs[k].axes}
    blocks.append({**pack_layer({k: block[k] for k in layer_keys} | {k: w for k, w in others.items()
                                                                      if k not in matrices}),
                   **{k: pack(others[k]) for k in matrices}})
  return blocks
