"""Decoding kernels for XLA:CPU: a small C++ library (cpu_kernels.cc) that XLA calls through its FFI.

A decode step multiplies batch x tokens rows by every weight matrix; while there are few rows the weights'
bytes are the cost, so verifying 5 tokens should cost about what decoding 1 does. XLA:CPU falls short three times:
its general matrix product packs the weight matrix into a scratch layout on every call (5 rows cost ~1.9x one
row over SmolLM2's MLP weights), and it runs decode attention as many tiny batched products whose overhead
dominates (at batch 8, half of a step), and its bfloat16 matrix-vector products run ~10x slower than float32
ones, so halving the bytes did not pay. benchmarks/bench_verify.py and bench_autoregressive.py measure them.

  pack(w, k_dims)  a weight as column panels (`Packed`), once, when a model is loaded for decoding
                   (`specjax.model.pack_params`, which `generate` calls through `specjax.decoding.decode_params`)
  dense(x, w)      x @ w for w [K, N] or a `Packed` weight (every projection of the decoder, the LM head)
  attention(q, k_cache, v_cache, positions, reference)   causal grouped-query attention over the cache

The product kernel reads packed weights: each panel of PANEL output columns is one contiguous run of K x PANEL
values, so a call streams the matrix once, in order, whatever the number of rows. `dense` computes with XLA
(the plain dot; for a `Packed` weight, the same product over the panels) unless all of these hold, in which case
it calls the kernel (attention likewise, with `reference`):
  * the weight is `Packed` (attention: always),
  * the default backend is CPU and the process has a single device (a mesh partitions XLA's ops; XLA would
    replicate a kernel's operands),
  * float32 or bfloat16 operands (float32 arithmetic either way); for attention, at most MAX_QUERY_TOKENS new
    tokens per row and shapes the kernel supports (products take any number of rows: a prefill's too, where
    the kernel was as fast as XLA's product over the unpacked weights at 32 to 1024 rows),
  * the library is built: on first use, with the C++ compiler ($CXX, else c++), into $SPECJAX_CACHE (default
    ~/.cache/specjax), keyed by the source, jaxlib's version and the CPU; a failed build warns once with the
    compiler's message and XLA is used,
  * it is not turned off: SPECJAX_CPU_KERNELS=0 in the environment, or `set_enabled(False)` before tracing.
Results equal XLA's to float32 rounding (summation order differs); a row's result never depends on the other
rows or tokens of the call. Gradients are XLA's (custom_jvp), so training is unaffected.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PANEL = 32  # output columns per packed panel (cpu_kernels.cc: kPanel)
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cc")
# (kernel, weight or cache dtype) -> (XLA custom-call target, the handler's symbol in cpu_kernels.cc)
_KERNELS = {
    ("packed", "float32"): ("specjax_packed_matmul", "PackedMatmulF32"),
    ("attention", "float32"): ("specjax_decode_attention", "DecodeAttention"),
    ("packed", "bfloat16"): ("specjax_packed_matmul_bf16", "PackedMatmulBF16"),
    ("attention", "bfloat16"): ("specjax_decode_attention_bf16", "DecodeAttentionBF16"),
}
_WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16)  # weights and caches either; activations widened to float32
MAX_QUERY_TOKENS = 16  # attention: new tokens per row (decode and verification); prefill uses XLA's
_lock = threading.Lock()
_state: dict = {"built": None, "error": None, "enabled": os.environ.get("SPECJAX_CPU_KERNELS", "1") != "0"}


def set_enabled(enabled: bool) -> None:
  """Turns the kernel on or off for computations traced from now on. jax reuses a function's trace for the same
  argument shapes, so a function already traced keeps its choice: pass the choice as a static argument (as
  benchmarks/bench_verify.py does) or call jax.clear_caches()."""
  _state["enabled"] = bool(enabled)


@contextlib.contextmanager
def enabled(flag: bool):
  """Within the block (when tracing), the kernel is on or off; the previous setting comes back after."""
  previous = _state["enabled"]
  _state["enabled"] = bool(flag)
  try:
    yield
  finally:
    _state["enabled"] = previous


def _cpu_key() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
  except OSError:
    flags = ""
  return flags + platform.machine() + platform.processor()


def library_path() -> str:
  """Where the compiled kernel lives for this source, jaxlib and CPU."""
  import jaxlib
  with open(_SOURCE, "rb") as f:
    digest = hashlib.sha256(f.read() + jaxlib.__version__.encode() + _cpu_key().encode()).hexdigest()[:16]
  cache = os.environ.get("SPECJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specjax")
  return os.path.join(cache, f"cpu_kernels-{digest}.so")


def _compile(path: str) -> None:
  compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if not compiler:
    raise RuntimeError("no C++ compiler found (set CXX)")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  base = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-I", jax.ffi.include_dir(),
          _SOURCE]
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
  os.close(fd)
  try:
    errors = []
    for arch in (["-march=native"], []):  # -march=native is not known to every compiler
      result = subprocess.run(base[:2] + arch + base[2:] + ["-o", tmp], capture_output=True, text=True)
      if result.returncode == 0:
        os.replace(tmp, path)  # atomic: a concurrent build or a killed one never leaves a partial library
        return
      errors.append(result.stderr.strip()[-2000:])
    raise RuntimeError(f"{compiler} failed:\n" + "\n".join(errors))
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def build() -> bool:
  """Compiles (once per source/jaxlib/CPU) and registers the kernel; False, with a warning, if that fails."""
  with _lock:
    if _state["built"] is None:
      try:
        path = library_path()
        if not os.path.exists(path):
          _compile(path)
        lib = ctypes.cdll.LoadLibrary(path)
        for target, symbol in _KERNELS.values():
          jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        _state["built"] = True
      except Exception as e:  # any failure means the plain dot, said once
        _state["built"], _state["error"] = False, f"{type(e).__name__}: {e}"
        warnings.warn(f"specjax.cpu_kernels: kernel unavailable, using XLA's dot ({_state['error']})")
    return _state["built"]


def status() -> str:
  """Why the kernel is or is not used in this process, in words."""
  if not _state["enabled"]:
    return "turned off (SPECJAX_CPU_KERNELS=0 or set_enabled(False))"
  if jax.default_backend() != "cpu":
    return f"not used: the default backend is {jax.default_backend()}"
  if jax.device_count() != 1:
    return f"not used: {jax.device_count()} devices (a mesh partitions XLA's dot)"
  if _state["built"] is False:
    return f"build failed: {_state['error']}"
  return "in use" if _state["built"] else "not built yet"


def available() -> bool:
  """True when the functions here would use the kernels for supported shapes in this process."""
  if not _state["enabled"] or jax.default_backend() != "cpu" or jax.device_count() != 1:
    return False
  return build()


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
  def matrix_shape(self) -> tuple[int, int]:
    return _matrix_shape(self.shape, self.k_dims)

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


def as_matrix(w, k_dims: int):
  """w as the [K, N] matrix `dense` takes: an array reshaped, a `Packed` weight as it is."""
  if isinstance(w, Packed):
    if w.k_dims != k_dims:
      raise ValueError(f"a weight packed with k_dims={w.k_dims} is used with k_dims={k_dims}")
    return w
  return w.reshape(_matrix_shape(w.shape, k_dims))


def _use_kernel(x: jax.Array, w: Packed) -> bool:
  rows = int(np.prod(x.shape[:-1], dtype=np.int64))
  if x.dtype not in _WEIGHT_DTYPES or w.dtype not in _WEIGHT_DTYPES or rows == 0:
    return False
  return available()


def _target(kind: str, dtype) -> str:
  return _KERNELS[(kind, jnp.dtype(dtype).name)][0]


def _panels_xla(x: jax.Array, data: jax.Array, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ the packed panels [NB, K, P] -> [..., NB * P], with XLA."""
  out = jnp.einsum("...k,bkp->...bp", x, data, preferred_element_type=preferred_element_type)
  return out.reshape(*x.shape[:-1], -1)


def _packed_product(x: jax.Array, data: jax.Array, out_dtype) -> jax.Array:
  """The kernel's x @ panels, float32 accumulation, as out_dtype; XLA's products for gradients."""
  target = _target("packed", data.dtype)

  @jax.custom_jvp
  def kernel(x, data):
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (data.shape[0] * data.shape[2],), jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x.astype(jnp.float32), data).astype(out_dtype)

  @kernel.defjvp
  def kernel_jvp(primals, tangents):
    (x, data), (dx, ddata) = primals, tangents
    tangent = (_panels_xla(dx, data, preferred_element_type=jnp.float32)
               + _panels_xla(x, ddata, preferred_element_type=jnp.float32))
    return kernel(x, data), tangent.astype(out_dtype)

  return kernel(x, data)


def dense(x: jax.Array, w, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w -> [..., N], as jnp.matmul(x, w, preferred_element_type=...); w [K, N] or `Packed`."""
  if not isinstance(w, Packed):
    return jnp.matmul(x, w, preferred_element_type=preferred_element_type)
  n = w.matrix_shape[1]
  if _use_kernel(x, w):
    out = _packed_product(x, w.data, preferred_element_type or jnp.result_type(x.dtype, w.dtype))
  else:
    out = _panels_xla(x, w.data, preferred_element_type=preferred_element_type)
  return out if out.shape[-1] == n else out[..., :n]


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, reference) -> jax.Array:
  """Causal grouped-query attention of q [B, T, H, D] over caches [B, S, KV, D]: the query at positions[b, t]
  sees cache slots 0..positions[b, t]. `reference(q, k_cache, v_cache, positions)` computes the same with XLA;
  it is used where the kernel does not apply (T > MAX_QUERY_TOKENS, not float32, ...) and for gradients."""
  b, t, h, d = q.shape
  kv = k_cache.shape[2]
  usable = (t <= MAX_QUERY_TOKENS and d % 16 == 0 and d <= 256 and h % kv == 0 and q.dtype in _WEIGHT_DTYPES
            and k_cache.dtype in _WEIGHT_DTYPES and v_cache.dtype == k_cache.dtype and available())
  if not usable:
    return reference(q, k_cache, v_cache, positions)
  target = _target("attention", k_cache.dtype)

  @jax.custom_jvp
  def kernel(q, k_cache, v_cache):
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(
        q.astype(jnp.float32), k_cache, v_cache, positions.astype(jnp.int32)).astype(q.dtype)

  @kernel.defjvp
  def kernel_jvp(primals, tangents):
    _, tangent_out = jax.jvp(lambda *a: reference(*a, positions), primals, tangents)
    return kernel(*primals), tangent_out

  return kernel(q, k_cache, v_cache)
