"""What the weights stored in a compact form share (`specjax.backends.cpu.Quantized`, GGUF blocks for the CPU kernels;
`specjax.int8.Int8`, int8 codes for accelerators): each stands for an array of `shape` that a product reads as a
matrix W [K, N], its first `k_dims` axes contracted, or, `transposed`, as W.T [N, K] (an embedding table)."""

from __future__ import annotations

import numpy as np


class StoredMatrix:
  """The shape logic of a stored matrix; subclasses hold `shape`, `k_dims` and `transposed`."""

  shape: tuple[int, ...]
  k_dims: int
  transposed: bool

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def matrix_shape(self) -> tuple[int, int]:
    """(K, N) of W."""
    if self.transposed:
      return (self.shape[1], self.shape[0])
    return (int(np.prod(self.shape[:self.k_dims], dtype=np.int64)),
            int(np.prod(self.shape[self.k_dims:], dtype=np.int64)))

  def _check_transpose(self, what: str) -> None:
    if self.ndim != 2:
      raise ValueError(f"only a 2-D {what} array has a transpose (shape {self.shape})")

  def _matrix_for(self, shape, what: str) -> tuple[int, int]:
    """(K, N) when `shape` (a reshape's arguments) reads the array as its matrix [K, N] (-1 for one size)."""
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    k, n = self.matrix_shape
    if self.transposed or len(shape) != 2 or tuple(shape) not in ((k, n), (-1, n), (k, -1)):
      raise ValueError(f"{what} of the matrix {(k, n)} (shape {self.shape}"
                       f"{', transposed' if self.transposed else ''}) cannot be read as {tuple(shape)}")
    return k, n
