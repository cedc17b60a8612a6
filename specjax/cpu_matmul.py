"""Matrix products over a few rows on CPU, through a small C++ kernel (cpu_matmul.cc) that XLA calls.

A decode step multiplies batch x tokens rows by every weight matrix; while there are few rows the weights'
bytes are the cost, so verifying 5 tokens should cost about what decoding 1 does. XLA:CPU's general matrix
product packs the weight matrix into a scratch layout on every call: on SmolLM2's 30 MLPs, 5 rows took ~1.9x
one row with XLA's dot and ~1.2x with this kernel (benchmarks/bench_matmul.py measures it).

  dense(x, w)    x @ w    for w [K, N]  (every projection of the decoder)
  dense_t(x, w)  x @ w.T  for w [N, K]  (a tied LM head: the embedding table)

Both compute the plain dot unless all of these hold, in which case they call the kernel:
  * the default backend is CPU and the process has a single device (a mesh partitions plain dots; XLA would
    replicate the kernel's operands),
  * float32 operands, at most MAX_ROWS rows (x's leading dimensions multiplied), shapes the kernel supports,
  * the kernel is built: on first use, with the C++ compiler ($CXX, else c++), into $SPECJAX_CACHE (default
    ~/.cache/specjax), keyed by the source, jaxlib's version and the CPU; a failed build warns once with the
    compiler's message and the plain dot is used,
  * it is not turned off: SPECJAX_CPU_MATMUL=0 in the environment, or `set_enabled(False)` before tracing.
Results equal the plain dot's to float32 rounding (summation order differs). Gradients go through plain dots.
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

MAX_ROWS = 32  # beyond this XLA's dot is as fast (measured on 2 cores); prefill and training use XLA's
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_matmul.cc")
_TARGETS = {"kn": "specjax_small_matmul_kn", "nk": "specjax_small_matmul_nk"}
_lock = threading.Lock()
_state: dict = {"built": None, "error": None, "enabled": os.environ.get("SPECJAX_CPU_MATMUL", "1") != "0"}


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
  return os.path.join(cache, f"cpu_matmul-{digest}.so")


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
        jax.ffi.register_ffi_target(_TARGETS["kn"], jax.ffi.pycapsule(lib.SmallMatmulKN), platform="cpu")
        jax.ffi.register_ffi_target(_TARGETS["nk"], jax.ffi.pycapsule(lib.SmallMatmulNK), platform="cpu")
        _state["built"] = True
      except Exception as e:  # any failure means the plain dot, said once
        _state["built"], _state["error"] = False, f"{type(e).__name__}: {e}"
        warnings.warn(f"specjax.cpu_matmul: kernel unavailable, using XLA's dot ({_state['error']})")
    return _state["built"]


def status() -> str:
  """Why the kernel is or is not used in this process, in words."""
  if not _state["enabled"]:
    return "turned off (SPECJAX_CPU_MATMUL=0 or set_enabled(False))"
  if jax.default_backend() != "cpu":
    return f"not used: the default backend is {jax.default_backend()}"
  if jax.device_count() != 1:
    return f"not used: {jax.device_count()} devices (a mesh partitions XLA's dot)"
  if _state["built"] is False:
    return f"build failed: {_state['error']}"
  return "in use" if _state["built"] else "not built yet"


def available() -> bool:
  """True when dense/dense_t would use the kernel for a supported shape in this process."""
  if not _state["enabled"] or jax.default_backend() != "cpu" or jax.device_count() != 1:
    return False
  return build()


def _use_kernel(x: jax.Array, w: jax.Array, n: int, k: int, nk: bool) -> bool:
  rows = int(np.prod(x.shape[:-1], dtype=np.int64))
  if x.dtype != jnp.float32 or w.dtype != jnp.float32 or w.ndim != 2 or not 0 < rows <= MAX_ROWS:
    return False
  if n % 16 or (nk and (k % 16 or n % 4)):
    return False
  return available()


def _call(kind: str, x: jax.Array, w: jax.Array) -> jax.Array:
  n = w.shape[0] if kind == "nk" else w.shape[1]
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32)
  return jax.ffi.ffi_call(_TARGETS[kind], out, vmap_method="sequential")(x, w)


@jax.custom_jvp
def _kernel_kn(x, w):
  return _call("kn", x, w)


@_kernel_kn.defjvp
def _kernel_kn_jvp(primals, tangents):
  (x, w), (dx, dw) = primals, tangents
  return _kernel_kn(x, w), jnp.matmul(dx, w) + jnp.matmul(x, dw)


@jax.custom_jvp
def _kernel_nk(x, w):
  return _call("nk", x, w)


@_kernel_nk.defjvp
def _kernel_nk_jvp(primals, tangents):
  (x, w), (dx, dw) = primals, tangents
  return _kernel_nk(x, w), jnp.matmul(dx, w.T) + jnp.matmul(x, dw.T)


def dense(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w [K, N] -> [..., N] (`preferred_element_type` as in jnp.matmul; the kernel is float32)."""
  if _use_kernel(x, w, w.shape[-1], w.shape[0], nk=False):
    return _kernel_kn(x, w)
  return jnp.matmul(x, w, preferred_element_type=preferred_element_type)


def dense_t(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w [N, K].T -> [..., N]."""
  if _use_kernel(x, w, w.shape[0], w.shape[1], nk=True):
    return _kernel_nk(x, w)
  return jnp.einsum("...d,vd->...v", x, w, preferred_element_type=preferred_element_type)

