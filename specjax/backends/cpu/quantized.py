"""GGUF-quantized weights kept as their blocks, laid out for the product kernel (kernels.cc: QuantizedMatmul).

A GGUF file stores a matrix as N rows (one per output column) of K inputs, quantized in blocks along K: 32 inputs
with a half-precision scale (Q8_0, Q4_0, Q5_0; and a min, Q4_1), or 256 with 6- or 8-bit scales per 32 or 16 and a
half-precision scale for them (K-quants: Q4_K, Q6_K). `specjax.load(..., quantized=True)` keeps those blocks and
repacks them once, at load, as column panels, the way `packing.Packed` holds float32 weights, so that a product
streams each weight's bits once, in order:

  data [NB, K / block_k, block_bytes] uint8: panel b holds output columns 32b .. 32b + 31 (zeros past N); each of
  its blocks is a header of the 32 columns' scales, then block_k rows of `row` bytes, row k holding the 32 columns'
  codes at input k (`kind` names the layout; bits a weight, as read per product, against GGUF's):
    Q8_0  header d [32] halves;                         row: 32 int8 codes       1088 B / 1024 weights: 8.5 (8.5)
    Q4_0  header d [32];                                row: 16 bytes, 4-bit     576 B / 1024: 4.5 (4.5)
    Q4_1  header d [32], m [32];                        row: 16 bytes, 4-bit     640 B / 1024: 5.0 (5.0)
    Q4_K  header d, dmin [32] halves, sc [8][32], m [8][32] 6-bit bytes;  row: 16 bytes, 4-bit
                                                                                 4736 B / 8192: 4.625 (4.5)
    Q6_K  header d [32], sc [16][32] int8;              row: 32 int8 codes q - 32   8768 B / 8192: 8.56 (6.56)
  A row's 4-bit codes: column c's is the low half of byte c for c < 16, the high half of byte c - 16 otherwise.
  GGUF's Q5_0 (d x (q - 16), q 5-bit) loads as Q8_0 blocks of codes q - 16: 8.5 bits a weight against its 5.5.
Q6_K's and Q5_0's fifth and sixth bits are widened because on an AVX2 host decoding them from bit planes took 2-3x
the time of int8 codes, and there the product is bound by decoding, not by memory (kernels.cc: the types).

A `Quantized` is what `Model.params` holds for each such matrix: logically the float32 array gguf's dequantization
gives (`dequantize()`), used as the matrix [K, N] of a product x @ W, like `Packed` (`shape`, `k_dims`), or, for an
embedding table [vocab, embed] whose rows are the tied LM head's columns, as that matrix's transpose (`transposed`).
Whatever reads it sees the same float32 values: the kernel decodes each weight to the float32 value gguf computes,
`dequantize()` and the jnp product (`matmul_reference`) compute the same, and `take` (an embedding lookup, a draft
head's columns) decodes the rows it gathers only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.backends.cpu import kernels
from specjax.stored_matrix import StoredMatrix

PANEL = kernels.PANEL


@dataclasses.dataclass(frozen=True)
class Layout:
  """One layout's block (kernels.cc: the struct of that name)."""
  block_k: int  # inputs per block: GGUF's block, or a K-quant's super-block
  sub_k: int  # inputs one scale serves
  header: int  # bytes of the 32 columns' scales at a block's start
  row: int  # bytes of one row of codes (the 32 columns at one input)

  @property
  def block_bytes(self) -> int:
    return self.header + self.block_k * self.row


LAYOUTS = {
    "Q8_0": Layout(block_k=32, sub_k=32, header=64, row=32),
    "Q4_0": Layout(block_k=32, sub_k=32, header=64, row=16),
    "Q4_1": Layout(block_k=32, sub_k=32, header=128, row=16),
    "Q4_K": Layout(block_k=256, sub_k=32, header=640, row=16),
    "Q6_K": Layout(block_k=256, sub_k=16, header=576, row=32),
}
KINDS = tuple(LAYOUTS)
# The GGUF types kept quantized: (inputs per GGUF block, bytes per GGUF block, the layout they load as).
GGUF_TYPES = {"Q8_0": (32, 34, "Q8_0"), "Q4_0": (32, 18, "Q4_0"), "Q4_1": (32, 20, "Q4_1"), "Q5_0": (32, 22, "Q8_0"),
              "Q4_K": (256, 144, "Q4_K"), "Q6_K": (256, 210, "Q6_K")}


@struct.dataclass
class Quantized(StoredMatrix):
  """A GGUF-quantized matrix W [K, N] as column panels of its blocks (module docstring). Logically the float32 array
  of `shape`: W with its first `k_dims` axes contracted (wq [D, H, hd]: K = D; wo [H, hd, D]: K = H * hd), or, with
  `transposed`, W.T [N, K] (an embedding table [vocab, embed])."""
  data: jax.Array  # uint8 [ceil(N / PANEL), K / block_k, block_bytes]
  kind: str = struct.field(pytree_node=False)
  shape: tuple[int, ...] = struct.field(pytree_node=False)
  k_dims: int = struct.field(pytree_node=False, default=1)
  transposed: bool = struct.field(pytree_node=False, default=False)

  @property
  def dtype(self):
    return jnp.dtype(jnp.float32)  # the values it stands for

  @property
  def layout(self) -> Layout:
    return LAYOUTS[self.kind]

  @property
  def nbytes(self) -> int:
    return int(self.data.size)

  @property
  def T(self) -> "Quantized":
    """The transpose of a 2-D array: the same blocks (an embedding table read as its LM head, and back)."""
    self._check_transpose("quantized")
    return self.replace(shape=self.shape[::-1], k_dims=1, transposed=not self.transposed)

  def reshape(self, *shape) -> "Quantized":
    """The same blocks as the matrix [K, N] (-1 for one size), as model code reshapes a weight before a product."""
    k, n = self._matrix_for(shape, "a weight quantized")
    return self.replace(shape=(k, n), k_dims=1)

  def padded_matrix(self) -> jax.Array:
    """W [K, NB * PANEL] in float32, the padding columns (zeros) included: what the kernel multiplies by."""
    layout = self.layout
    nb, kb, _ = self.data.shape
    k = np.arange(layout.block_k)[:, None]
    c = np.arange(PANEL)[None, :]
    w = _decode(self.kind, lambda offsets: self.data[:, :, offsets].astype(jnp.int32), k, c)  # [NB, KB, bk, P]
    return w.transpose(1, 2, 0, 3).reshape(kb * layout.block_k, nb * PANEL)

  def dequantize(self) -> jax.Array:
    """The float32 array of `shape`, the values gguf's dequantization gives."""
    k, n = self.matrix_shape
    matrix = self.padded_matrix()[:, :n]
    return matrix.T if self.transposed else matrix.reshape(self.shape)

  def take(self, ids: jax.Array, axis: int = 0) -> jax.Array:
    """jnp.take(self.dequantize(), ids, axis) along the axis of W's columns (an embedding table's rows, axis 0; a
    2-D head's columns, axis 1), decoding the gathered columns only."""
    if self.ndim != 2 or axis % 2 != (0 if self.transposed else 1):
      raise ValueError(f"a quantized array of shape {self.shape} gathers along the axis of its matrix's columns "
                       f"({0 if self.transposed else 1}), not {axis}")
    layout = self.layout
    ids = jnp.asarray(ids, jnp.int32)
    flat = ids.reshape(-1)
    kb = self.data.shape[1]
    panel = (flat // PANEL)[:, None, None]
    block = jnp.arange(kb)[None, :, None]
    c = (flat % PANEL)[:, None, None]
    k = np.arange(layout.block_k)[None, None, :]
    w = _decode(self.kind, lambda offsets: self.data[panel, block, offsets].astype(jnp.int32), k, c)  # [T, KB, bk]
    rows = w.reshape(flat.shape[0], kb * layout.block_k).reshape(*ids.shape, -1)
    return rows if self.transposed else jnp.moveaxis(rows, -1, 0)


def _decode(kind: str, read, k, c) -> jax.Array:
  """float32 weights of inputs k (within a block) and panel columns c (arrays that broadcast) of the blocks that
  `read(offsets)` reads the bytes of (as int32, one per offset within a block): kernels.cc's Scales and Codes."""
  layout = LAYOUTS[kind]

  def half(offset):  # column c's half at `offset` [32] within the header
    bits = read(offset + 2 * c) | (read(offset + 2 * c + 1) << 8)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)

  def signed(byte):
    return byte - ((byte >> 7) << 8)

  row = layout.header + k * layout.row
  nibble = lambda: (read(row + c % 16) >> (4 * (c // 16))) & 15
  sub = k // layout.sub_k
  if kind == "Q8_0":
    return half(0) * signed(read(row + c)).astype(jnp.float32)
  if kind == "Q4_0":
    return half(0) * (nibble() - 8).astype(jnp.float32)
  if kind == "Q4_1":
    return half(0) * nibble().astype(jnp.float32) + half(2 * PANEL)
  if kind == "Q4_K":
    scale = half(0) * read(4 * PANEL + sub * PANEL + c).astype(jnp.float32)
    least = half(2 * PANEL) * read(12 * PANEL + sub * PANEL + c).astype(jnp.float32)
    return scale * nibble().astype(jnp.float32) - least
  if kind == "Q6_K":
    scale = half(0) * signed(read(2 * PANEL + sub * PANEL + c)).astype(jnp.float32)
    return scale * signed(read(row + c)).astype(jnp.float32)
  raise ValueError(f"no quantized layout for {kind}; layouts: {', '.join(KINDS)}")


# ------------------------------------------------------------------------------------------ from GGUF's blocks

def _gguf_fields(kind: str, blocks: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
  """A GGUF tensor's blocks [N, KB, gguf_bytes] as (per-block halves {name: [N, KB, 2] bytes}, per-sub-block bytes
  {name: [N, KB, subs]}, codes [N, KB, block_k] uint8: 4-bit codes, or the bytes of int8 codes): gguf-py's
  dequantize_blocks, up to the arithmetic."""
  from gguf import quants

  def nibbles(qs):  # [..., 16] -> [..., 32]: the low halves, then the high halves
    return np.concatenate([qs & 15, qs >> 4], axis=-1)

  if kind == "Q8_0":
    return {"d": blocks[..., :2]}, {}, blocks[..., 2:]
  if kind == "Q4_0":
    return {"d": blocks[..., :2]}, {}, nibbles(blocks[..., 2:])
  if kind == "Q4_1":
    return {"d": blocks[..., :2], "m": blocks[..., 2:4]}, {}, nibbles(blocks[..., 4:])
  if kind == "Q5_0":  # as Q8_0: d and int8 codes q - 16
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # bit i of the little-endian word: input i
    return {"d": blocks[..., :2]}, {}, ((nibbles(blocks[..., 6:]) | (high << 4)) - np.uint8(16))
  if kind == "Q4_K":
    n, kb, _ = blocks.shape
    sc, m = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(n * kb, 12))
    qs = blocks[..., 16:].reshape(n, kb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    return ({"d": blocks[..., :2], "dmin": blocks[..., 2:4]},
            {"sc": sc.reshape(n, kb, 8), "m": m.reshape(n, kb, 8)}, (qs & 15).reshape(n, kb, 256))
  if kind == "Q6_K":
    n, kb, _ = blocks.shape
    ql = blocks[..., :128].reshape(n, kb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    qh = blocks[..., 128:192].reshape(n, kb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    codes = (ql & 15).reshape(n, kb, 256) | ((qh & 3).reshape(n, kb, 256) << 4)
    return {"d": blocks[..., 208:210]}, {"sc": blocks[..., 192:208]}, codes - np.uint8(32)  # int8 q - 32
  raise ValueError(f"no quantized layout for {kind}; layouts: {', '.join(KINDS)}")


def from_gguf(rows: np.ndarray, gguf_type: str, shape: tuple[int, ...], k_dims: int = 1,
              transposed: bool = False) -> Quantized:
  """A GGUF tensor's data of `gguf_type` (one of `GGUF_TYPES`), rows [N, K / block_k * block bytes] uint8 (one row
  per output column, as `gguf.GGUFReader` gives a quantized tensor), repacked as `Quantized` panels of logical
  `shape` (see `Quantized`). Rows may be reordered before (llama.cpp's Q/K head permutation): blocks never straddle
  rows."""
  if gguf_type not in GGUF_TYPES:
    raise ValueError(f"no quantized layout for {gguf_type}; GGUF types kept quantized: {', '.join(GGUF_TYPES)}")
  block_k, gguf_bytes, kind = GGUF_TYPES[gguf_type]
  layout = LAYOUTS[kind]
  rows = np.asarray(rows, np.uint8)
  n, width = rows.shape
  if width % gguf_bytes:
    raise ValueError(f"{gguf_type} rows of {width} bytes are not whole blocks of {gguf_bytes}")
  kb = width // gguf_bytes
  quantized = Quantized(data=None, kind=kind, shape=tuple(int(d) for d in shape), k_dims=k_dims,
                        transposed=transposed)
  if quantized.matrix_shape != (kb * block_k, n):
    raise ValueError(f"{n} rows of {kb * block_k} {gguf_type} inputs are not the matrix of shape {shape} "
                     f"({quantized.matrix_shape})")
  nb = -(-n // PANEL)
  padded = np.zeros((nb * PANEL, kb, gguf_bytes), np.uint8)  # zero scales: zero weights
  padded[:n] = rows.reshape(n, kb, gguf_bytes)
  halves, subs, codes = _gguf_fields(gguf_type, padded)

  def columns_last(a):  # [NB * P, KB, ...] -> [NB, KB, ..., P]
    a = a.reshape(nb, PANEL, kb, *a.shape[2:])
    return np.moveaxis(a, 1, -1)

  header = [np.swapaxes(columns_last(h), -1, -2).reshape(nb, kb, 2 * PANEL) for h in halves.values()]
  header += [columns_last(s).reshape(nb, kb, -1) for s in subs.values()]
  codes = columns_last(codes)  # [NB, KB, block_k, P]
  if layout.row == PANEL:  # int8 codes
    row = codes
  else:  # 4-bit codes: column c in the low half of byte c % 16 (c < 16), the high half otherwise
    row = (codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)
  row = row.reshape(nb, kb, layout.block_k * layout.row)
  data = np.concatenate(header + [row], axis=-1)
  assert data.shape == (nb, kb, layout.block_bytes), (kind, data.shape)
  return quantized.replace(data=jnp.asarray(data))


def concatenate(parts: list[Quantized]) -> Quantized | None:
  """Matrices of one type and K side by side ([K, N1 + N2 + ...], one product for all), or None where their panels
  cannot simply follow each other (types differ, a matrix's N is not whole panels, an embedding table)."""
  first = parts[0]
  if any(not isinstance(p, Quantized) or p.kind != first.kind or p.transposed or p.matrix_shape[0] !=
         first.matrix_shape[0] or p.matrix_shape[1] % PANEL for p in parts):
    return None
  k = first.matrix_shape[0]
  return Quantized(data=jnp.concatenate([p.data for p in parts], axis=0), kind=first.kind,
                   shape=(k, sum(p.matrix_shape[1] for p in parts)), k_dims=1)


def matmul_reference(x: jax.Array, w: Quantized, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w -> [..., N] with jnp over the dequantized matrix: where the kernel does not run."""
  k, n = w.matrix_shape
  out = jnp.matmul(x, w.padded_matrix(), preferred_element_type=preferred_element_type)
  return out if out.shape[-1] == n else out[..., :n]


# Rows past which a product is XLA's over the matrix the kernel dequantizes (kernels.dequantize) rather than the
# product kernel's: a prefill's. Verification widths (up to kernels.MAX_QUERY_TOKENS) stay the kernel's, whose rows
# never depend on each other. On 2 busy AVX2 cores (AMD EPYC Zen 3), SmolLM2's w_gate_up (576 x 3072, Q4_1), medians
# of 7: at 256 rows the product kernel 35 ms, dequantized and XLA's product 24 ms (XLA's over float32 weights 31 ms);
# at 1,024 rows 111, 72 and 78 ms; at 64 to 128 rows all within noise of each other. jnp's dequantization
# (`Quantized.padded_matrix`) and XLA's product took 51 ms at 256 rows.
MAX_KERNEL_ROWS = kernels.MAX_QUERY_TOKENS


def quantized_matmul(x: jax.Array, w: Quantized, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w -> [..., N] on a CPU: the product kernel (kernels.quantized_matmul) for up to MAX_KERNEL_ROWS
  rows, XLA's product over the kernel's dequantized matrix (kernels.dequantize) for more."""
  if int(np.prod(x.shape[:-1], dtype=np.int64)) > MAX_KERNEL_ROWS:
    k, n = w.matrix_shape
    out = jnp.matmul(x, kernels.dequantize(w), preferred_element_type=preferred_element_type)
    return out if out.shape[-1] == n else out[..., :n]
  return kernels.quantized_matmul(x, w, lambda data: w.replace(data=data).padded_matrix(), preferred_element_type)


def dequantize_params(tree):
  """The tree with every `Quantized` replaced by its float32 array (for code that needs arrays: training, export,
  sharding over a mesh)."""
  return jax.tree.map(lambda x: x.dequantize() if isinstance(x, Quantized) else x, tree,
                      is_leaf=lambda x: isinstance(x, Quantized))
