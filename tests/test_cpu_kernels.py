"""The CPU kernels (specjax.backends.cpu), as specjax.ops calls them: build here, equal XLA, are used only where
they should be."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import ops
from specjax.backends import cpu


def _has_kernel(fn, *args) -> bool:
  # A fresh function each time: jax reuses a function's trace for the same shapes, whatever was enabled then.
  return "specjax_packed_matmul" in jax.jit(lambda *a: fn(*a)).lower(*args).as_text()


def _xla_attention(*args):
  """`ops.attention` with the kernels off: XLA's computation, which the kernel must equal."""
  with cpu.enabled(False):
    return jax.jit(lambda *a: ops.attention(*a))(*args)


def test_kernel_builds_on_this_machine():
  assert cpu.available(), cpu.status()
  assert os.path.exists(cpu.library_path())
  assert cpu.status() == "in use"


@pytest.mark.parametrize("shape,k_dims", [((576, 1536), 1), ((64, 48), 1), ((64, 3, 16), 1), ((3, 16, 64), 2),
                                          ((8, 100), 1)])
def test_pack_unpack_round_trip(shape, k_dims):
  """Any column count: a last panel that is not full is padded with zeros and cut off again."""
  w = jnp.asarray(np.random.default_rng(0).standard_normal(shape, np.float32))
  packed = cpu.pack(w, k_dims)
  k, n = packed.matrix_shape
  assert (k, n) == (int(np.prod(shape[:k_dims])), int(np.prod(shape[k_dims:])))
  assert packed.data.shape == (-(-n // cpu.PANEL), k, cpu.PANEL)
  np.testing.assert_array_equal(np.asarray(packed.unpack()), np.asarray(w))
  np.testing.assert_array_equal(np.asarray(packed.data[0, :, :min(n, cpu.PANEL)]),
                                np.asarray(w.reshape(k, n)[:, :cpu.PANEL]))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 24, 67])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (64, 48), (32, 16), (576, 192), (48, 100)])
def test_dense_equals_xla(rows, k, n):
  rng = np.random.default_rng(rows * 7 + n)
  x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
  w = jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k))
  packed = cpu.pack(w)
  assert _has_kernel(ops.matmul, x, packed)
  assert not _has_kernel(ops.matmul, x, w)  # arrays as loaded: XLA's dot
  got = jax.jit(ops.matmul)(x, packed)
  assert got.shape == (rows, n)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 8])
def test_bfloat16_weights_accumulate_in_float32(rows):
  """bfloat16 weights (and activations) are widened in the kernel; the result is what XLA's bfloat16 product
  gives, up to its own bfloat16 rounding of the output."""
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, 576), np.float32)).astype(jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((576, 192), np.float32) / 24).astype(jnp.bfloat16)
  packed = cpu.pack(w)
  assert packed.dtype == jnp.bfloat16
  assert "specjax_packed_matmul_bf16" in jax.jit(lambda x, w: ops.matmul(x, w)).lower(x, packed).as_text()
  got = jax.jit(lambda x, w: ops.matmul(x, w))(x, packed)
  assert got.dtype == jnp.bfloat16
  want = jnp.matmul(x, w, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)
  wide = jax.jit(lambda x, w: ops.matmul(x, w, preferred_element_type=jnp.float32))(x, packed)
  assert wide.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(wide), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows_per_call", [3, 12], ids=["one_group", "two_groups"])
def test_leading_dimensions_and_rows_are_independent(rows_per_call):
  """A row's result is the same bits whichever rows share the call: verifying T tokens multiplies each token
  exactly as decoding it alone does (more than 8 rows take two passes over each panel)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, rows_per_call, 576), np.float32))
  w = cpu.pack(jnp.asarray(rng.standard_normal((576, 1536), np.float32)))
  full = np.asarray(jax.jit(ops.matmul)(x, w))
  assert full.shape == (2, rows_per_call, 1536)
  for b in range(2):
    for t in range(rows_per_call):
      alone = np.asarray(jax.jit(ops.matmul)(x[b, t][None], w))[0]
      np.testing.assert_array_equal(full[b, t], alone)


def test_xla_where_the_kernel_does_not_apply():
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((64, 40), np.float32))
  packed = cpu.pack(w)
  few = jnp.asarray(rng.standard_normal((4, 64), np.float32))
  half = cpu.pack(w.astype(jnp.float16))
  assert not _has_kernel(ops.matmul, few.astype(jnp.float16), half)
  with cpu.enabled(False):
    assert not _has_kernel(ops.matmul, few, packed)
    got = jax.jit(lambda x, w: ops.matmul(x, w))(few, packed)  # XLA's product over the panels
  np.testing.assert_allclose(np.asarray(got), np.asarray(few @ w), rtol=1e-5, atol=1e-5)
  assert _has_kernel(ops.matmul, few, packed)  # the previous setting is back


def test_gradients_go_through_plain_dots():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((3, 64), np.float32))
  w = jnp.asarray(rng.standard_normal((64, 40), np.float32))
  loss = lambda x, w: jnp.sum(jnp.tanh(ops.matmul(x, w)) ** 2)
  reference = lambda x, w: jnp.sum(jnp.tanh(x @ w) ** 2)
  got = jax.grad(loss, argnums=(0, 1))(x, cpu.pack(w))
  want = jax.grad(reference, argnums=(0, 1))(x, w)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got[1].unpack()), np.asarray(want[1]), rtol=1e-4, atol=1e-5)


def test_packed_parameters_give_the_same_logits():
  """`pack_params`, as generate reads the weights: the forward's logits equal those of the weights as loaded,
  for a decode step, a verification and a prefill (XLA over the panels), tied and untied output heads."""
  from specjax.backends.cpu import pack_params
  from specjax.config import ModelConfig
  from specjax.model import forward, init_cache, init_params
  for tie in (True, False):
    config = ModelConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, tie_embeddings=tie)
    params = init_params(config, jax.random.PRNGKey(0), std=0.1)
    packed = pack_params(params, config)
    assert isinstance(packed["layers"][0]["wo"], cpu.Packed) and "lm_head_packed" in packed
    assert pack_params(packed, config) is packed
    step = jax.jit(lambda p, t: forward(p, t, init_cache(config, 2, 64), jnp.zeros(2, jnp.int32), config).logits)
    for width in (1, 5, 30):
      tokens = jnp.asarray(np.random.default_rng(width).integers(0, 250, (2, width)), jnp.int32)
      np.testing.assert_allclose(np.asarray(step(packed, tokens)), np.asarray(step(params, tokens)), rtol=1e-4,
                                 atol=1e-5)


def test_a_verification_gives_each_token_the_logits_a_decode_step_gives_it():
  """On the packed weights, the logits of T tokens verified in one forward equal, bit for bit, those of T decode
  steps, and a row's equal its logits alone whatever rows share the call: no summation order depends on the
  call's other tokens or rows. Greedy speculative decoding then picks autoregressive decoding's tokens even
  where two logits nearly tie."""
  from specjax.backends.cpu import pack_params
  from specjax.config import ModelConfig
  from specjax.model import forward, init_cache, init_params
  config = ModelConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=6,
                       num_kv_heads=2, head_dim=16)
  params = pack_params(init_params(config, jax.random.PRNGKey(1), std=0.1), config)
  step = jax.jit(lambda t, c, p: forward(params, t, c, p, config))
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(0, 250, (3, 20)), jnp.int32)
  draft = jnp.asarray(rng.integers(0, 250, (3, 9)), jnp.int32)
  filled = step(prompts, init_cache(config, 3, 64), jnp.zeros(3, jnp.int32)).cache
  starts = jnp.asarray([20, 13, 17], jnp.int32)  # rows at different offsets
  verified = np.asarray(step(draft, filled, starts).logits)
  cache, one_by_one = filled, []
  for t in range(9):
    out = step(draft[:, t:t + 1], cache, starts + t)
    cache = out.cache
    one_by_one.append(np.asarray(out.logits[:, 0]))
  np.testing.assert_array_equal(verified, np.stack(one_by_one, 1))
  alone = step(draft[1:2], jax.tree.map(lambda x: x[1:2], filled), starts[1:2]).logits
  np.testing.assert_array_equal(verified[1:2], np.asarray(alone))


@pytest.mark.slow
def test_a_fresh_build_compiles_into_the_cache(tmp_path):
  """What a new machine does on first use: compile the library into an empty cache and use it."""
  code = """
import jax.numpy as jnp, numpy as np
from specjax import ops
from specjax.backends import cpu
x, w = jnp.ones((2, 64)), cpu.pack(jnp.ones((64, 32)))
assert np.allclose(np.asarray(ops.matmul(x, w)), 64.0)
print(cpu.status(), cpu.library_path())
"""
  env = dict(os.environ, SPECJAX_CACHE=str(tmp_path / "cache"))
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("in use " + str(tmp_path / "cache"))
  assert [p.name for p in (tmp_path / "cache").iterdir()] == [os.path.basename(result.stdout.split()[-1])]


@pytest.mark.slow
def test_a_failed_build_warns_and_falls_back(tmp_path):
  code = """
import warnings
import jax.numpy as jnp, numpy as np
from specjax import ops
from specjax.backends import cpu
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  x, w = jnp.ones((2, 64)), cpu.pack(jnp.ones((64, 32)))
  out = ops.matmul(x, w)
assert np.allclose(np.asarray(out), 64.0)
assert not cpu.available()
print(cpu.status())
print([str(w.message) for w in caught])
"""
  env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), SPECJAX_CACHE=str(tmp_path / "cache"))
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert "build failed" in result.stdout and "kernel unavailable, using XLA's dot" in result.stdout
  assert not any((tmp_path / "cache").glob("*.so"))  # nothing half-written left behind


@pytest.mark.slow
def test_turned_off_by_environment(tmp_path):
  code = "from specjax.backends import cpu; print(cpu.available(), cpu.status())"
  env = dict(os.environ, SPECJAX_CPU_KERNELS="0")
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("False turned off")


@pytest.mark.parametrize("b,t,h,kv,s,d", [(1, 1, 9, 3, 64, 64), (2, 5, 9, 3, 128, 64), (3, 16, 4, 2, 40, 32),
                                          (2, 3, 4, 4, 20, 16), (1, 16, 9, 3, 200, 64), (8, 5, 9, 3, 160, 64),
                                          (1, 16, 32, 2, 50, 96), (2, 33, 9, 3, 128, 64), (2, 4, 9, 3, 700, 64)])
def test_attention_equals_xla(b, t, h, kv, s, d):
  """Positions anywhere in the cache, past its end too (such a query sees every slot), and rows of one call
  at different positions; with few (row, KV head) pairs a call's tokens are split over the threads; a task's
  queries fill one, several or part of a pass of 16; head_dim not a multiple of 64; a 32-node tree's block."""
  rng = np.random.default_rng(b * 100 + t)
  q = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
  k = jnp.asarray(rng.standard_normal((b, s, kv, d), np.float32))
  v = jnp.asarray(rng.standard_normal((b, s, kv, d), np.float32))
  positions = jnp.asarray(rng.integers(0, s + 3, (b, t)), jnp.int32)
  fn = lambda q, k, v, p: ops.attention(q, k, v, p)
  assert "specjax_decode_attention" in jax.jit(fn).lower(q, k, v, positions).as_text()
  got = np.asarray(jax.jit(fn)(q, k, v, positions))
  np.testing.assert_allclose(got, np.asarray(_xla_attention(q, k, v, positions)), rtol=1e-5, atol=1e-5)
  # A query's output does not depend on the other queries of the call.
  alone = np.asarray(jax.jit(fn)(q[:1, :1], k[:1], v[:1], positions[:1, :1]))
  np.testing.assert_array_equal(got[:1, :1], alone)


def test_attention_gives_each_querys_log_softmax_denominator():
  """lse = log sum over the slots a query sees of exp(q.k / sqrt(hd)) (what merges attention over more keys), -inf
  for a query that sees no slot (its output zeros)."""
  assert cpu.build()
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.standard_normal((2, 4, 9, 64), np.float32))
  k = jnp.asarray(rng.standard_normal((2, 40, 3, 64), np.float32))
  v = jnp.asarray(rng.standard_normal((2, 40, 3, 64), np.float32))
  positions = jnp.asarray([[0, 7, 39, 50], [-1, 3, 3, 20]], jnp.int32)
  out, lse = jax.jit(lambda *a: cpu.attention(*a, reference=None))(q, k, v, positions)
  scores = np.einsum("btkgd,bskd->btkgs", np.asarray(q, np.float64).reshape(2, 4, 3, 3, 64),
                     np.asarray(k, np.float64)) / 8.0
  seen = np.arange(40)[None, None, None, None, :] <= np.asarray(positions)[:, :, None, None, None]
  with np.errstate(divide="ignore"):
    want = np.log(np.sum(np.where(seen, np.exp(scores), 0.0), axis=-1)).reshape(2, 4, 9)
  np.testing.assert_allclose(np.asarray(lse), want, rtol=1e-5, atol=1e-5)
  assert np.all(np.isneginf(np.asarray(lse)[1, 0])) and not np.any(np.asarray(out)[1, 0])
  np.testing.assert_allclose(np.asarray(out)[:, 1:], np.asarray(_xla_attention(q, k, v, positions))[:, 1:],
                             rtol=1e-5, atol=1e-5)


def test_attention_over_a_bfloat16_cache():
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((2, 5, 9, 64), np.float32)).astype(jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((2, 48, 3, 64), np.float32)).astype(jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((2, 48, 3, 64), np.float32)).astype(jnp.bfloat16)
  positions = jnp.asarray(rng.integers(0, 48, (2, 5)), jnp.int32)
  fn = jax.jit(lambda q, k, v, p: ops.attention(q, k, v, p))
  assert "specjax_decode_attention_bf16" in fn.lower(q, k, v, positions).as_text()
  got = fn(q, k, v, positions)
  assert got.dtype == jnp.bfloat16
  want = _xla_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), positions)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_attention_falls_back_and_differentiates():
  rng = np.random.default_rng(3)
  t = cpu.MAX_QUERY_TOKENS + 1
  q = jnp.asarray(rng.standard_normal((1, t, 4, 16), np.float32))
  k = jnp.asarray(rng.standard_normal((1, 32, 2, 16), np.float32))
  positions = jnp.arange(t, dtype=jnp.int32)[None]
  fn = lambda q, k, v, p: ops.attention(q, k, v, p)
  assert "specjax_decode_attention" not in jax.jit(fn).lower(q, k, k, positions).as_text()  # a prefill
  small = q[:, :4]
  loss = lambda q: jnp.sum(fn(q, k, k, positions[:, :4]) ** 2)
  assert "specjax_decode_attention" in jax.jit(jax.grad(loss)).lower(small).as_text()
  grad = jax.grad(loss)(small)
  with cpu.enabled(False):
    want = jax.grad(lambda q: jnp.sum(fn(q, k, k, positions[:, :4]) ** 2))(small)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_decode_params_are_packed_once_per_parameter_tree():
  """generate reads the packed copy kept on the model; new params assigned to the model are packed anew."""
  import specjax
  from specjax.config import ModelConfig
  from specjax.decoding import decode_draft_params, decode_params
  from specjax.loading import Model
  from specjax.model import init_params
  config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=16)
  model = Model(config, init_params(config, jax.random.PRNGKey(0)), None, "tiny")
  first = decode_params(model)
  assert decode_params(model) is first and isinstance(first["layers"][1]["w_gate_up"], cpu.Packed)
  model.params = init_params(config, jax.random.PRNGKey(1))
  second = decode_params(model)
  assert second is not first
  np.testing.assert_array_equal(np.asarray(second["layers"][0]["wo"].unpack()),
                                np.asarray(model.params["layers"][0]["wo"]))
  drafter = specjax.make_drafter("layer_skip", model, exit_layer=1)
  assert decode_draft_params(drafter) is decode_draft_params(drafter)


# Sliding-window attention: a query sees cache slots starts..positions (Gemma 2/3's and Mistral's local layers see
# the last W, starts = positions - W + 1), and the kernel reads no other slot for it.


def _windowed_attention(q, k, v, positions, starts, mask=None, extra_keys=None, extra_values=None, extra_mask=None):
  """Brute force, float64: each query's softmax over the cache slots starts..positions (where mask allows) and its
  extra keys (where extra_mask allows); query head i reads KV head i // (H / KV). (out [B, T, H, D], NaN for a query
  that sees no key; lse [B, T, H] of the cache part, -inf for a query that sees no slot.)"""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  positions, starts = np.asarray(positions), np.asarray(starts)
  b, t, h, d = q.shape
  s, kv = k.shape[1], k.shape[2]
  qh = q.reshape(b, t, kv, h // kv, d)
  scores = np.einsum("btkgd,bskd->btkgs", qh, k) / np.sqrt(d)
  seen = (np.arange(s) >= starts[..., None]) & (np.arange(s) <= positions[..., None])  # [B, T, S]
  if mask is not None:
    seen &= np.asarray(mask)
  seen = np.broadcast_to(seen[:, :, None, None], scores.shape)
  values = np.broadcast_to(v[:, None, :, :, None], (b, t, s, kv, h // kv, d))  # [B, T, S, KV, G, D]
  if extra_keys is not None:
    ek, ev = np.asarray(extra_keys, np.float64), np.asarray(extra_values, np.float64)
    if ek.ndim == 4:  # every query's
      ek, ev = np.broadcast_to(ek[:, None], (b, t) + ek.shape[1:]), np.broadcast_to(ev[:, None], (b, t) + ev.shape[1:])
    extra_scores = np.einsum("btkgd,btekd->btkge", qh, ek) / np.sqrt(d)
    extra_seen = np.ones(extra_scores.shape, bool) if extra_mask is None else np.broadcast_to(
        np.asarray(extra_mask)[:, :, None, None], extra_scores.shape)
    scores, seen = np.concatenate([scores, extra_scores], -1), np.concatenate([seen, extra_seen], -1)
    values = np.concatenate([values, np.broadcast_to(ev[:, :, :, :, None], ev.shape[:4] + (h // kv, d))], 2)
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    most = np.max(np.where(seen, scores, -np.inf), -1, keepdims=True)
    weights = np.where(seen, np.exp(scores - most), 0.0)
    out = np.einsum("btkgs,btskgd->btkgd", weights, values) / weights.sum(-1)[..., None]
    lse = np.log(np.sum(np.where(seen[..., :s], np.exp(scores[..., :s]), 0.0), -1))
  return out.reshape(b, t, h, d), lse.reshape(b, t, h)


def _ranges(rng, b, t, s):
  """positions [B, T] anywhere in the cache (past either end too) and starts of every kind, in random order: 0, =
  positions (one slot), > positions (none), a window's positions - W + 1, < 0, anywhere."""
  positions = rng.integers(-1, s + 3, (b, t))
  kind = rng.permutation(np.arange(b * t) % 6).reshape(b, t)
  choices = [np.zeros((b, t), np.int64), positions, positions + rng.integers(1, 4, (b, t)),
             positions - rng.integers(1, s // 2 + 2, (b, t)) + 1, rng.integers(-3, 0, (b, t)),
             rng.integers(0, s + 3, (b, t))]
  starts = np.choose(kind, choices)
  return jnp.asarray(positions, jnp.int32), jnp.asarray(starts, jnp.int32)


def _kernel_attention(q, k, v, positions, starts):
  """The kernel alone: (out, lse), as `cpu.attention` returns them."""
  return jax.jit(lambda *a: cpu.attention(*a, reference=None))(q, k, v, positions, starts)


@pytest.mark.parametrize("b,t,h,kv,s,d,dtype", [
    (4, 1, 4, 1, 300, 256, "float32"), (3, 1, 4, 1, 300, 256, "bfloat16"),  # Gemma-3-270M's heads, decode
    (2, 5, 9, 3, 128, 64, "float32"), (2, 17, 4, 1, 96, 256, "bfloat16"), (1, 16, 32, 2, 50, 96, "float32"),
    (2, cpu.MAX_QUERY_TOKENS, 4, 1, 140, 256, "float32"), (1, cpu.MAX_QUERY_TOKENS, 8, 2, 80, 32, "bfloat16"),
    (1, 5, 4, 1, 900, 256, "bfloat16"), (2, 3, 9, 3, 600, 64, "float32")])  # cut into parts of the cache
def test_windowed_attention_equals_the_reference(b, t, h, kv, s, d, dtype):
  """The kernel's (out, lse) equal `ops._cache_attention`'s with starts for every query that sees a slot; one that
  sees none (starts > positions, or a range past the cache's ends) gets zeros and -inf, where the reference's lse
  is -1e30-like, so that merged with extra keys either weighs 0. A bfloat16 cache is widened exactly: its result is
  the reference's over the widened cache. A query's result is the same bits alone as in the call."""
  assert cpu.build()
  rng = np.random.default_rng(b * 1000 + t * 10 + d)
  q = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32)).astype(dtype).astype(jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, s, kv, d), np.float32)).astype(dtype)
  v = jnp.asarray(rng.standard_normal((b, s, kv, d), np.float32)).astype(dtype)
  positions, starts = _ranges(rng, b, t, s)
  out, lse = map(np.asarray, _kernel_attention(q, k, v, positions, starts))
  want, want_lse = map(np.asarray, jax.jit(ops._cache_attention)(
      q, k.astype(jnp.float32), v.astype(jnp.float32), positions, starts))
  clipped = np.clip(np.asarray(positions), -1, s - 1)
  sees = np.maximum(np.asarray(starts), 0) <= clipped  # [B, T]
  assert sees.any() and not sees.all()
  np.testing.assert_allclose(out[sees], want[sees], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse[sees], want_lse[sees], rtol=1e-5, atol=1e-5)
  assert not np.any(out[~sees]) and np.all(np.isneginf(lse[~sees])) and np.all(want_lse[~sees] < -1e29)
  # Through ops.attention (q in the cache's dtype, as a model passes it): the kernel's result in q's dtype, and
  # XLA's reference where the kernels are off.
  fn = lambda q, k, v, p, s: ops.attention(q, k, v, p, starts=s)
  assert "specjax_decode_attention" in jax.jit(fn).lower(q.astype(dtype), k, v, positions, starts).as_text()
  got = jax.jit(fn)(q.astype(dtype), k, v, positions, starts)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(out).astype(dtype)))
  xla = np.asarray(_xla_attention_with(fn, q, k.astype(jnp.float32), v.astype(jnp.float32), positions, starts))
  np.testing.assert_allclose(out[sees], xla[sees], rtol=1e-5, atol=1e-5)
  row, token = b - 1, t // 2
  alone = _kernel_attention(q[row:row + 1, token:token + 1], k[row:row + 1], v[row:row + 1],
                            positions[row:row + 1, token:token + 1], starts[row:row + 1, token:token + 1])
  np.testing.assert_array_equal(np.asarray(alone[0])[0, 0], out[row, token])
  np.testing.assert_array_equal(np.asarray(alone[1])[0, 0], lse[row, token])


def test_starts_none_is_zeros_and_a_full_range():
  """starts=None, zeros and anything below 0 give the kernel the whole prefix: the same bits."""
  rng = np.random.default_rng(11)
  q = jnp.asarray(rng.standard_normal((2, 5, 9, 64), np.float32))
  k = jnp.asarray(rng.standard_normal((2, 80, 3, 64), np.float32))
  positions = jnp.asarray(rng.integers(0, 80, (2, 5)), jnp.int32)
  none = np.asarray(jax.jit(lambda *a: ops.attention(*a))(q, k, k, positions))
  for starts in (jnp.zeros_like(positions), jnp.full_like(positions, -7)):
    got = jax.jit(lambda q, k, v, p, s: ops.attention(q, k, v, p, starts=s))(q, k, k, positions, starts)
    np.testing.assert_array_equal(np.asarray(got), none)
  with pytest.raises(ValueError, match="shape of positions"):
    ops.attention(q, k, k, positions, starts=positions[:, :1])


@pytest.mark.parametrize("extra", ["per_query", "block"])
def test_windowed_attention_merges_with_extra_keys(extra):
  """With extra keys beside the cache (a draft's own, a tree's block under its mask), every query's result is the
  brute-force softmax over its window and its extra keys, with the kernel and without: a query whose window holds
  no slot takes its extra keys' result. And the jnp reference with starts (and a mask over the cache, which XLA
  serves) equals the brute force."""
  rng = np.random.default_rng(12)
  b, t, h, kv, s, d, e = 3, 6, 4, 1, 64, 256, 3
  q = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
  k = jnp.asarray(rng.standard_normal((b, s, kv, d), np.float32))
  v = jnp.asarray(rng.standard_normal((b, s, kv, d), np.float32))
  positions, starts = _ranges(rng, b, t, s)
  if extra == "block":
    extras = {"extra_keys": jnp.asarray(rng.standard_normal((b, t, kv, d), np.float32)),
              "extra_values": jnp.asarray(rng.standard_normal((b, t, kv, d), np.float32)),
              "extra_mask": jnp.asarray(np.tril(rng.random((b, t, t)) < 0.5) | np.eye(t, dtype=bool))}
  else:
    extras = {"extra_keys": jnp.asarray(rng.standard_normal((b, t, e, kv, d), np.float32)),
              "extra_values": jnp.asarray(rng.standard_normal((b, t, e, kv, d), np.float32))}
  fn = lambda q, k, v, p, s: ops.attention(q, k, v, p, starts=s, **extras)
  assert "specjax_decode_attention" in jax.jit(fn).lower(q, k, v, positions, starts).as_text()
  want, _ = _windowed_attention(q, k, v, positions, starts, **extras)
  np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v, positions, starts)), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(_xla_attention_with(fn, q, k, v, positions, starts)), want, rtol=1e-5,
                             atol=1e-5)
  mask = jnp.asarray(rng.random((b, t, s)) < 0.7)
  masked = jax.jit(lambda q, k, v, p, s, m: ops.attention(q, k, v, p, starts=s, mask=m, **extras))
  assert "specjax_decode_attention" not in masked.lower(q, k, v, positions, starts, mask).as_text()
  want, _ = _windowed_attention(q, k, v, positions, starts, mask, **extras)
  np.testing.assert_allclose(np.asarray(masked(q, k, v, positions, starts, mask)), want, rtol=1e-5, atol=1e-5)


def test_the_reference_with_starts_is_a_masked_softmax():
  """`ops._cache_attention` with starts: (out, lse) of the brute-force softmax over starts..positions, for every
  query that sees a slot."""
  rng = np.random.default_rng(13)
  q = jnp.asarray(rng.standard_normal((3, 7, 6, 32), np.float32))
  k = jnp.asarray(rng.standard_normal((3, 40, 2, 32), np.float32))
  v = jnp.asarray(rng.standard_normal((3, 40, 2, 32), np.float32))
  positions, starts = _ranges(rng, 3, 7, 40)
  out, lse = jax.jit(ops._cache_attention)(q, k, v, positions, starts)
  want, want_lse = _windowed_attention(q, k, v, positions, starts)
  sees = np.isfinite(want_lse[..., 0])
  assert sees.any() and not sees.all()
  np.testing.assert_allclose(np.asarray(out)[sees], want[sees], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse)[sees], want_lse[sees], rtol=1e-5, atol=1e-5)


def _xla_attention_with(fn, *args):
  """fn with the kernels off: XLA's computation."""
  with cpu.enabled(False):
    return jax.jit(lambda *a: fn(*a))(*args)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_windowed_attention_never_reads_outside_the_range(dtype):
  """A query's (out, lse) are the same bits when every cache slot outside its range, and every slot of the other
  rows, holds NaN or huge keys and values: the kernel reads none of them for it (the other queries of its pass
  see some of them, so their scores share its vectors: they are masked, never summed)."""
  assert cpu.build()
  rng = np.random.default_rng(14)
  b, t, h, kv, s, d = 2, 5, 4, 1, 64, 256
  q = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
  k = np.asarray(jnp.asarray(rng.standard_normal((b, s, kv, d), np.float32)).astype(dtype)).astype(np.float32)
  v = np.asarray(jnp.asarray(rng.standard_normal((b, s, kv, d), np.float32)).astype(dtype)).astype(np.float32)
  positions = jnp.asarray([[40, 41, 42, 43, 44], [9, 63, 63, 20, 3]], jnp.int32)
  starts = jnp.asarray([[33, 34, 35, 36, 37], [0, 48, 60, 21, 3]], jnp.int32)  # windows of 8, 16, 4, none, 1
  cast = lambda a: jnp.asarray(a).astype(dtype)
  out, lse = map(np.asarray, _kernel_attention(q, cast(k), cast(v), positions, starts))
  garbage = np.where(np.arange(s)[None, :, None, None] % 2, np.nan, 1e30).astype(np.float32)
  for row in range(b):
    for token in range(t):
      outside = np.ones((b, s), bool)
      outside[row, max(int(starts[row, token]), 0):int(positions[row, token]) + 1] = False
      dirty = [cast(np.where(outside[:, :, None, None], garbage, a)) for a in (k, v)]
      got, got_lse = map(np.asarray, _kernel_attention(q, *dirty, positions, starts))
      np.testing.assert_array_equal(got[row, token], out[row, token])
      np.testing.assert_array_equal(got_lse[row, token], lse[row, token])
  assert not np.any(out[1, 3]) and np.all(np.isneginf(lse[1, 3]))


def test_windowed_attention_differentiates():
  """Gradients through ops.attention with starts (the kernel's forward, the reference's derivatives) equal XLA's,
  for queries whose windows hold slots and, with extra keys, for one whose window holds none."""
  rng = np.random.default_rng(15)
  q = jnp.asarray(rng.standard_normal((2, 4, 4, 32), np.float32))
  k = jnp.asarray(rng.standard_normal((2, 24, 1, 32), np.float32))
  v = jnp.asarray(rng.standard_normal((2, 24, 1, 32), np.float32))
  positions = jnp.asarray([[10, 11, 12, 13], [23, 5, 0, 17]], jnp.int32)
  starts = jnp.asarray([[4, 5, 6, 7], [20, 0, 0, 12]], jnp.int32)
  extra_k = jnp.asarray(rng.standard_normal((2, 4, 2, 1, 32), np.float32))
  for extras, s in (({}, starts), ({"extra_keys": extra_k, "extra_values": extra_k}, starts.at[1, 3].set(19))):
    loss = lambda q, k, v: jnp.sum(jnp.tanh(ops.attention(q, k, v, positions, starts=s, **extras)) ** 2)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert "specjax_decode_attention" in grad.lower(q, k, v).as_text()
    got = grad(q, k, v)
    with cpu.enabled(False):
      want = jax.jit(jax.grad(lambda *a: loss(*a), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cache_write_equals_the_scatter(dtype):
  """Slots in range written, one past the end dropped, a negative one counted from the end, of two writes to one
  slot the later kept: as jnp's scatter with mode="drop" does."""
  rng = np.random.default_rng(7)
  cache = jnp.asarray(rng.standard_normal((3, 20, 2, 16), np.float32)).astype(dtype)
  update = jnp.asarray(rng.standard_normal((3, 4, 2, 16), np.float32))  # float32: cast to the cache's dtype
  positions = jnp.asarray([[0, 1, 2, 3], [19, 20, 25, 5], [-1, 7, 7, 8]], jnp.int32)
  fn = jax.jit(lambda c, u, p: ops.cache_write(c, u, p))
  assert "specjax_cache_write" in fn.lower(cache, update, positions).as_text()
  got = fn(cache, update, positions)
  with cpu.enabled(False):
    want = jax.jit(lambda c, u, p: ops.cache_write(c, u, p))(cache, update, positions)
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert not np.array_equal(np.asarray(got, np.float32), np.asarray(cache, np.float32))


def test_cache_write_in_a_loop_copies_no_cache():
  """A decode loop's carried bfloat16 cache is written in place: no copy of the cache in the compiled program
  (XLA's scatter widened it to float32 and back and copied it every step)."""
  cache = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)

  def body(i, c):
    return ops.cache_write(c, jnp.full((1, 1, 1, 64), i, jnp.float32), jnp.full((1, 1), i, jnp.int32))

  fn = jax.jit(lambda c: jax.lax.fori_loop(0, 8, body, c))
  hlo = fn.lower(cache).compile().as_text()
  assert "f32[1,256,1,64]" not in hlo and " copy(" not in hlo.split("body")[-1]
  np.testing.assert_array_equal(np.asarray(fn(cache)[0, :9, 0, 0], np.float32), [0, 1, 2, 3, 4, 5, 6, 7, 0])


def test_cache_write_differentiates():
  rng = np.random.default_rng(8)
  cache = jnp.asarray(rng.standard_normal((2, 10, 8), np.float32))
  update = jnp.asarray(rng.standard_normal((2, 3, 8), np.float32))
  positions = jnp.asarray([[1, 2, 3], [4, 11, 4]], jnp.int32)
  loss = lambda c, u: jnp.sum(jnp.sin(ops.cache_write(c, u, positions)))
  got = jax.grad(loss, argnums=(0, 1))(cache, update)
  with cpu.enabled(False):
    want = jax.grad(loss, argnums=(0, 1))(cache, update)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
