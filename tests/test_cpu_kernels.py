"""The CPU matrix kernel (specjax.cpu_kernels): builds here, equals XLA's dot, is used only where it should be."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu_kernels


def _has_kernel(fn, *args) -> bool:
  # A fresh function each time: jax reuses a function's trace for the same shapes, whatever was enabled then.
  return "specjax_small_matmul" in jax.jit(lambda *a: fn(*a)).lower(*args).as_text()


def test_kernel_builds_on_this_machine():
  assert cpu_kernels.available(), cpu_kernels.status()
  assert os.path.exists(cpu_kernels.library_path())
  assert cpu_kernels.status() == "in use"


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, cpu_kernels.MAX_ROWS])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (64, 48), (32, 16), (576, 192)])
def test_dense_equals_xla(rows, k, n):
  rng = np.random.default_rng(rows * 7 + n)
  x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
  w = jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k))
  assert _has_kernel(cpu_kernels.dense, x, w)
  got = jax.jit(cpu_kernels.dense)(x, w)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
  if n % 4 == 0 and k % 16 == 0:
    wt = jnp.asarray(np.asarray(w).T.copy())
    assert _has_kernel(cpu_kernels.dense_t, x, wt)
    got_t = jax.jit(cpu_kernels.dense_t)(x, wt)
    np.testing.assert_allclose(np.asarray(got_t), np.asarray(x @ w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 8])
def test_bfloat16_weights_accumulate_in_float32(rows):
  """bfloat16 weights (and activations) are widened in the kernel; the result is what XLA's bfloat16 product
  gives, up to its own bfloat16 rounding of the output."""
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, 576), np.float32)).astype(jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((576, 192), np.float32) / 24).astype(jnp.bfloat16)
  e = jnp.asarray(rng.standard_normal((256, 576), np.float32) / 24).astype(jnp.bfloat16)
  assert "specjax_small_matmul_kn_bf16" in jax.jit(lambda x, w: cpu_kernels.dense(x, w)).lower(x, w).as_text()
  got = jax.jit(lambda x, w: cpu_kernels.dense(x, w))(x, w)
  assert got.dtype == jnp.bfloat16
  want = jnp.matmul(x, w, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)
  head = jax.jit(lambda x, e: cpu_kernels.dense_t(x, e, preferred_element_type=jnp.float32))(x, e)
  assert head.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(head), np.asarray(jnp.einsum("md,vd->mv", x, e,
                             preferred_element_type=jnp.float32)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows_per_call", [3, 12], ids=["few_rows", "wide"])
def test_leading_dimensions_and_rows_are_independent(rows_per_call):
  """A row's result is the same bits whichever rows share the call: verifying T tokens multiplies each token
  exactly as decoding it alone does (more than 8 rows take the kernel's wide path)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, rows_per_call, 576), np.float32))
  w = jnp.asarray(rng.standard_normal((576, 1536), np.float32))
  e = jnp.asarray(rng.standard_normal((4096, 576), np.float32))
  for fn, weight in ((cpu_kernels.dense, w), (cpu_kernels.dense_t, e)):
    full = np.asarray(jax.jit(fn)(x, weight))
    assert full.shape == (2, rows_per_call, weight.shape[1] if fn is cpu_kernels.dense else weight.shape[0])
    for b in range(2):
      for t in range(rows_per_call):
        alone = np.asarray(jax.jit(fn)(x[b, t][None], weight))[0]
        np.testing.assert_array_equal(full[b, t], alone)


def test_xla_dot_where_the_kernel_does_not_apply():
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((64, 32), np.float32))
  many = jnp.asarray(rng.standard_normal((cpu_kernels.MAX_ROWS + 1, 64), np.float32))
  assert not _has_kernel(cpu_kernels.dense, many, w)
  np.testing.assert_allclose(np.asarray(cpu_kernels.dense(many, w)), np.asarray(many @ w), rtol=1e-6)
  few = jnp.asarray(rng.standard_normal((4, 64), np.float32))
  assert not _has_kernel(cpu_kernels.dense, few.astype(jnp.float16), w.astype(jnp.float16))
  assert not _has_kernel(cpu_kernels.dense, few, w[:, :24])  # N not a multiple of 16
  with cpu_kernels.enabled(False):
    assert not _has_kernel(cpu_kernels.dense, few, w)
  assert _has_kernel(cpu_kernels.dense, few, w)  # the previous setting is back


def test_gradients_go_through_plain_dots():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((3, 64), np.float32))
  w = jnp.asarray(rng.standard_normal((64, 32), np.float32))
  e = jnp.asarray(rng.standard_normal((32, 64), np.float32))
  loss = lambda x, w, e: jnp.sum(jnp.tanh(cpu_kernels.dense(x, w)) * cpu_kernels.dense_t(x, e))
  reference = lambda x, w, e: jnp.sum(jnp.tanh(x @ w) * (x @ e.T))
  got = jax.grad(loss, argnums=(0, 1, 2))(x, w, e)
  want = jax.grad(reference, argnums=(0, 1, 2))(x, w, e)
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_a_fresh_build_compiles_into_the_cache(tmp_path):
  """What a new machine does on first use: compile the library into an empty cache and use it."""
  code = """
import jax.numpy as jnp, numpy as np
from specjax import cpu_kernels
x, w = jnp.ones((2, 64)), jnp.ones((64, 32))
assert np.allclose(np.asarray(cpu_kernels.dense(x, w)), 64.0)
print(cpu_kernels.status(), cpu_kernels.library_path())
"""
  env = dict(os.environ, SPECJAX_CACHE=str(tmp_path / "cache"))
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("in use " + str(tmp_path / "cache"))
  assert [p.name for p in (tmp_path / "cache").iterdir()] == [os.path.basename(result.stdout.split()[-1])]


def test_a_failed_build_warns_and_falls_back(tmp_path):
  code = """
import warnings
import jax.numpy as jnp, numpy as np
from specjax import cpu_kernels
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  x, w = jnp.ones((2, 64)), jnp.ones((64, 32))
  out = cpu_kernels.dense(x, w)
assert np.allclose(np.asarray(out), 64.0)
assert not cpu_kernels.available()
print(cpu_kernels.status())
print([str(w.message) for w in caught])
"""
  env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), SPECJAX_CACHE=str(tmp_path / "cache"))
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert "build failed" in result.stdout and "kernel unavailable, using XLA's dot" in result.stdout
  assert not any((tmp_path / "cache").glob("*.so"))  # nothing half-written left behind


def test_turned_off_by_environment(tmp_path):
  code = "from specjax import cpu_kernels; print(cpu_kernels.available(), cpu_kernels.status())"
  env = dict(os.environ, SPECJAX_CPU_KERNELS="0")
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("False turned off")


@pytest.mark.parametrize("b,t,h,kv,s,d", [(1, 1, 9, 3, 64, 64), (2, 5, 9, 3, 128, 64), (3, 16, 4, 2, 40, 32),
                                          (2, 3, 4, 4, 20, 16)])
def test_attention_equals_xla(b, t, h, kv, s, d):
  """Positions anywhere in the cache, past its end too (such a query sees every slot), and rows of one call
  at different positions."""
  from specjax.model import attend
  rng = np.random.default_rng(b * 100 + t)
  q = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
  k = jnp.asarray(rng.standard_normal((b, s, kv, d), np.float32))
  v = jnp.asarray(rng.standard_normal((b, s, kv, d), np.float32))
  positions = jnp.asarray(rng.integers(0, s + 3, (b, t)), jnp.int32)
  fn = lambda q, k, v, p: cpu_kernels.attention(q, k, v, p, attend)
  assert "specjax_decode_attention" in jax.jit(fn).lower(q, k, v, positions).as_text()
  got = np.asarray(jax.jit(fn)(q, k, v, positions))
  np.testing.assert_allclose(got, np.asarray(attend(q, k, v, positions)), rtol=1e-5, atol=1e-5)
  # A query's output does not depend on the other queries of the call.
  alone = np.asarray(jax.jit(fn)(q[:1, :1], k[:1], v[:1], positions[:1, :1]))
  np.testing.assert_array_equal(got[:1, :1], alone)


def test_attention_over_a_bfloat16_cache():
  from specjax.model import attend
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((2, 5, 9, 64), np.float32)).astype(jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((2, 48, 3, 64), np.float32)).astype(jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((2, 48, 3, 64), np.float32)).astype(jnp.bfloat16)
  positions = jnp.asarray(rng.integers(0, 48, (2, 5)), jnp.int32)
  fn = jax.jit(lambda q, k, v, p: cpu_kernels.attention(q, k, v, p, attend))
  assert "specjax_decode_attention_bf16" in fn.lower(q, k, v, positions).as_text()
  got = fn(q, k, v, positions)
  assert got.dtype == jnp.bfloat16
  want = attend(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), positions)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_attention_falls_back_and_differentiates():
  from specjax.model import attend
  rng = np.random.default_rng(3)
  t = cpu_kernels.MAX_QUERY_TOKENS + 1
  q = jnp.asarray(rng.standard_normal((1, t, 4, 16), np.float32))
  k = jnp.asarray(rng.standard_normal((1, 32, 2, 16), np.float32))
  positions = jnp.arange(t, dtype=jnp.int32)[None]
  fn = lambda q, k, v, p: cpu_kernels.attention(q, k, v, p, attend)
  assert "specjax_decode_attention" not in jax.jit(fn).lower(q, k, k, positions).as_text()  # a prefill
  small = q[:, :4]
  grad = jax.grad(lambda q: jnp.sum(fn(q, k, k, positions[:, :4]) ** 2))(small)
  want = jax.grad(lambda q: jnp.sum(attend(q, k, k, positions[:, :4]) ** 2))(small)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-4, atol=1e-5)
