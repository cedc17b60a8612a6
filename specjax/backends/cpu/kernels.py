"""Decoding kernels for XLA:CPU: a small C++ library (kernels.cc) that XLA calls through its FFI.

A decode step multiplies batch x tokens rows by every weight matrix; while there are few rows the weights'
bytes are the cost, so verifying 5 tokens should cost about what decoding 1 does. XLA:CPU falls short three times:
its general matrix product packs the weight matrix into a scratch layout on every call (5 rows cost ~1.9x one
row over SmolLM2's MLP weights), and it runs decode attention as many tiny batched products whose overhead
dominates (at batch 8, half of a step), and its bfloat16 matrix-vector products run ~10x slower than float32
ones, so halving the bytes did not pay. benchmarks/bench_verify.py and bench_autoregressive.py measure them.

  packed_matmul(x, w)   x @ w for a weight packed as column panels (`packing.Packed`, packed once when a model is
                        loaded for decoding: `specjax.decoding.decode_params`)
  quantized_matmul(x, w, matrix)   x @ w for a GGUF-quantized weight (`quantized.Quantized`, repacked as column panels
                        of its blocks when it is loaded), each weight decoded to its float32 value in the product;
                        dequantize(w) gives that float32 matrix (for products over many rows: a prefill)
  cache_write(cache, update, positions, reference)   update [B, T, ...] written into cache [B, S, ...] at
                        positions [B, T], in place (the result aliases the cache)
  attention(q, k_cache, v_cache, positions, starts, reference)   causal grouped-query attention over a range of
                        the cache per query (starts..positions: all of the prefix, or a sliding window, whose query
                        reads only its window), and the log of each query's softmax denominator (attention over more
                        keys merges with it)

`specjax.ops` calls them where a program is compiled for a CPU (`jax.lax.platform_dependent`) and all of these
hold (`matmul_applies`, `attention_applies`); elsewhere it computes the same with jnp:
  * float32 or bfloat16 operands (float32 arithmetic either way); for attention, at most MAX_QUERY_TOKENS new
    tokens per row and shapes the kernel supports (products take any number of rows: a prefill's too, where
    the kernel was as fast as XLA's product over the unpacked weights at 32 to 1024 rows),
  * the process has a single device (a mesh partitions XLA's ops; XLA would replicate a kernel's operands),
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

from specjax.config import cache_dir

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.cc")
# (kernel, weight or cache dtype) -> (XLA custom-call target, the handler's symbol in kernels.cc)
_KERNELS = {
    ("packed", "float32"): ("specjax_packed_matmul", "PackedMatmulF32"),
    ("attention", "float32"): ("specjax_decode_attention", "DecodeAttention"),
    ("packed", "bfloat16"): ("specjax_packed_matmul_bf16", "PackedMatmulBF16"),
    ("attention", "bfloat16"): ("specjax_decode_attention_bf16", "DecodeAttentionBF16"),
    ("cache_write", "float32"): ("specjax_cache_write", "CacheWriteF32"),
    ("cache_write", "bfloat16"): ("specjax_cache_write_bf16", "CacheWriteBF16"),
    **{("quantized", kind): (f"specjax_quantized_matmul_{kind.lower()}", f"QuantizedMatmul{kind}")
       for kind in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")},
    **{("dequantize", kind): (f"specjax_dequantize_{kind.lower()}", f"DequantizeMatrix{kind}")
       for kind in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")},
}
_WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16)  # weights and caches either; activations widened to float32
PANEL = 32  # output columns per panel of a packed or quantized weight (kernels.cc: kPanel)
MAX_QUERY_TOKENS = 65  # attention: new tokens per row (decode, a chain or a 64-node tree); prefill uses XLA's
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


# -ffp-contract=off: a multiply-add is fused into an FMA wherever the compiler chooses, which differs between the
# kernels' instantiations for different row and query counts on an AVX2 host (a query's attention output then moved
# by an ulp with the other queries of its call); unfused, an element's arithmetic is the same in every one. The
# product's block fuses its multiply-add explicitly (kernels.cc: Fma), the same in every instantiation.
_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]


def library_path() -> str:
  """Where the compiled kernel lives for this source, its flags, jaxlib and CPU."""
  import jaxlib
  with open(_SOURCE, "rb") as f:
    key = f.read() + " ".join(_FLAGS).encode() + jaxlib.__version__.encode() + _cpu_key().encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
  return cache_dir(f"cpu_kernels-{digest}.so")


def _compile(path: str) -> None:
  compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if not compiler:
    raise RuntimeError("no C++ compiler found (set CXX)")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  base = [compiler, *_FLAGS, "-I", jax.ffi.include_dir(), _SOURCE]
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
        warnings.warn(f"specjax.backends.cpu: kernel unavailable, using XLA's dot ({_state['error']})")
    return _state["built"]


def status() -> str:
  """Why the kernels are or are not used by the programs this process compiles for its devices, in words."""
  if not _state["enabled"]:
    return "turned off (SPECJAX_CPU_KERNELS=0 or set_enabled(False))"
  if jax.default_backend() != "cpu":
    return f"not used: the default backend is {jax.default_backend()}"
  if jax.device_count() != 1:
    return f"not used: {jax.device_count()} devices (a mesh partitions XLA's dot)"
  if _state["built"] is False:
    return f"build failed: {_state['error']}"
  return "in use" if _state["built"] else "not built yet"


def usable() -> bool:
  """True when a program compiled for a CPU calls the kernels for the shapes they take: not turned off, a single
  device in the process, the library built (here, on first use)."""
  if not _state["enabled"] or jax.device_count() != 1:
    return False
  return build()


def available() -> bool:
  """True when the programs this process compiles for its devices use the kernels: the default backend is the
  CPU and they are `usable`. Decoding packs the weights (`packing.pack_params`) only then."""
  return jax.default_backend() == "cpu" and usable()


def _target(kind: str, dtype) -> str:
  return _KERNELS[(kind, jnp.dtype(dtype).name)][0]


def panels_product(x: jax.Array, data: jax.Array, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ the packed panels [NB, K, P] -> [..., NB * P], with XLA."""
  out = jnp.einsum("...k,bkp->...bp", x, data, preferred_element_type=preferred_element_type)
  return out.reshape(*x.shape[:-1], -1)


def matmul_applies(x: jax.Array, w) -> bool:
  """Whether `packed_matmul` takes x and the packed weight w (dtypes, rows) and the kernels are `usable`."""
  rows = int(np.prod(x.shape[:-1], dtype=np.int64))
  if x.dtype not in _WEIGHT_DTYPES or w.dtype not in _WEIGHT_DTYPES or rows == 0:
    return False
  return usable()


def packed_matmul(x: jax.Array, w, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w -> [..., N] for a `packing.Packed` weight w, as jnp.matmul(x, w, preferred_element_type=...):
  the kernel, float32 accumulation; XLA's products over the panels for gradients."""
  target = _target("packed", w.dtype)
  out_dtype = preferred_element_type or jnp.result_type(x.dtype, w.dtype)

  @jax.custom_jvp
  def kernel(x, data):
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (data.shape[0] * data.shape[2],), jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x.astype(jnp.float32), data).astype(out_dtype)

  @kernel.defjvp
  def kernel_jvp(primals, tangents):
    (x, data), (dx, ddata) = primals, tangents
    tangent = (panels_product(dx, data, preferred_element_type=jnp.float32)
               + panels_product(x, ddata, preferred_element_type=jnp.float32))
    return kernel(x, data), tangent.astype(out_dtype)

  out = kernel(x, w.data)
  n = w.matrix_shape[1]
  return out if out.shape[-1] == n else out[..., :n]


def quantized_matmul_applies(x: jax.Array, w) -> bool:
  """Whether `quantized_matmul` takes x and the quantized weight w (`quantized.Quantized`) and the kernels are
  `usable`."""
  rows = int(np.prod(x.shape[:-1], dtype=np.int64))
  if x.dtype not in _WEIGHT_DTYPES or ("quantized", w.kind) not in _KERNELS or rows == 0:
    return False
  return usable()


def dequantize(w) -> jax.Array:
  """The float32 matrix [K, NB * PANEL] of a `quantized.Quantized` weight's panels (padding columns included), by
  the kernel: what `quantized_matmul` multiplies by."""
  out = jax.ShapeDtypeStruct((w.matrix_shape[0], w.data.shape[0] * PANEL), jnp.float32)
  return jax.ffi.ffi_call(_KERNELS[("dequantize", w.kind)][0], out, vmap_method="sequential")(w.data)


def quantized_matmul(x: jax.Array, w, matrix, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w -> [..., N] for a `quantized.Quantized` weight w, its blocks decoded in the product, float32
  accumulation. `matrix(data)` gives the float32 matrix [K, NB * PANEL] of w's blocks `data` (the kernel's padded
  output columns): derivatives are XLA's product with it (the codes have none)."""
  target = _KERNELS[("quantized", w.kind)][0]
  out_dtype = preferred_element_type or jnp.result_type(x.dtype, jnp.float32)

  @jax.custom_jvp
  def kernel(x, data):
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (data.shape[0] * PANEL,), jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x.astype(jnp.float32), data).astype(out_dtype)

  @kernel.defjvp
  def kernel_jvp(primals, tangents):
    (x, data), (dx, _) = primals, tangents
    tangent = jnp.matmul(dx, matrix(data), preferred_element_type=jnp.float32)
    return kernel(x, data), tangent.astype(out_dtype)

  out = kernel(x, w.data)
  n = w.matrix_shape[1]
  return out if out.shape[-1] == n else out[..., :n]


def attention_applies(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> bool:
  """Whether `attention` takes these shapes and dtypes and the kernels are `usable`."""
  _, t, h, d = q.shape
  kv = k_cache.shape[2]
  return (t <= MAX_QUERY_TOKENS and d % 16 == 0 and d <= 256 and h % kv == 0 and q.dtype in _WEIGHT_DTYPES
          and k_cache.dtype in _WEIGHT_DTYPES and v_cache.dtype == k_cache.dtype and usable())


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
              starts: jax.Array | None = None, reference=None) -> tuple[jax.Array, jax.Array]:
  """Causal grouped-query attention of q [B, T, H, D] over caches [B, S, KV, D]: the query at positions[b, t]
  sees cache slots starts[b, t]..positions[b, t] (starts [B, T]; None: 0), none when starts > positions, and the
  kernel reads no other slot for it. Returns (out [B, T, H, D], lse [B, T, H] float32: the log of the query's
  softmax denominator, -inf for a query that sees no slot, whose output is zeros).
  `reference(q, k_cache, v_cache, positions, starts)` computes the same with XLA; its derivatives are the
  kernel's."""
  target = _target("attention", k_cache.dtype)

  @jax.custom_jvp
  def kernel(q, k_cache, v_cache, positions, starts):
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    out, lse = jax.ffi.ffi_call(target, out, vmap_method="sequential")(
        q.astype(jnp.float32), k_cache, v_cache, positions, starts)
    return out.astype(q.dtype), lse

  @kernel.defjvp
  def kernel_jvp(primals, tangents):
    positions, starts = primals[3:]  # integers: no tangent
    _, tangent_out = jax.jvp(lambda *a: reference(*a, positions, starts), primals[:3], tangents[:3])
    return kernel(*primals), tangent_out

  positions = positions.astype(jnp.int32)
  starts = jnp.zeros_like(positions) if starts is None else jnp.broadcast_to(starts, positions.shape).astype(jnp.int32)
  return kernel(q, k_cache, v_cache, positions, starts)


def cache_write_applies(cache: jax.Array, update: jax.Array) -> bool:
  """Whether `cache_write` takes this cache and update (dtypes, ranks) and the kernels are `usable`."""
  return (cache.ndim >= 2 and update.ndim == cache.ndim and cache.dtype in _WEIGHT_DTYPES and usable())


def cache_write(cache: jax.Array, update: jax.Array, positions: jax.Array, reference=None) -> jax.Array:
  """cache [B, S, ...] with slot positions[b, t] of row b set to update[b, t] (cast to the cache's dtype), as
  `reference(cache, update, positions)` (jnp's scatter, mode="drop": a position outside the cache is dropped)
  computes it, in place: the result aliases the cache operand, so XLA copies nothing where the cache is not read
  again (a decode loop's carried cache). Derivatives are the reference's."""
  target = _target("cache_write", cache.dtype)

  @jax.custom_jvp
  def kernel(cache, update, positions):
    out = jax.ShapeDtypeStruct(cache.shape, cache.dtype)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential", input_output_aliases={0: 0})(
        cache, update, positions)

  @kernel.defjvp
  def kernel_jvp(primals, tangents):
    positions = primals[2]
    _, tangent_out = jax.jvp(lambda c, u: reference(c, u, positions), primals[:2], tangents[:2])
    return kernel(*primals), tangent_out

  return kernel(cache, update.astype(cache.dtype), positions.astype(jnp.int32))
