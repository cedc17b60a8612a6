"""specjax.ops: one attention for the target, the MTP modules and the layer-skip search; the CPU kernels chosen by
the platform a program is lowered for, so a program lowered for a TPU from this CPU host holds no CPU custom call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import compilation, ops
from specjax.backends import cpu


def _direct_attention(q, keys, values, positions, mask=None, extra_keys=None, extra_values=None,
                      extra_mask=None) -> np.ndarray:
  """Query by query: softmax over the keys it sees (slots <= its position where the mask allows, then its extra
  keys where the extra mask allows) of q.k / sqrt(hd), times their values; query head i reads KV head i // (H / KV).
  Extra keys [B, E, KV, hd] are every query's."""
  q, keys, values, positions = map(np.asarray, (q, keys, values, positions))
  b, t, h, hd = q.shape
  group = h // keys.shape[2]
  out = np.zeros(q.shape, np.float64)
  for row in range(b):
    for i in range(t):
      slots = [s for s in range(keys.shape[1]) if s <= positions[row, i] and (mask is None or mask[row, i, s])]
      for head in range(h):
        kv_head = head // group
        seen_keys = [keys[row, s, kv_head] for s in slots]
        seen_values = [values[row, s, kv_head] for s in slots]
        if extra_keys is not None:
          own_keys, own_values = np.asarray(extra_keys)[row], np.asarray(extra_values)[row]
          if own_keys.ndim == 4:  # per query
            own_keys, own_values = own_keys[i], own_values[i]
          seen = [e for e in range(own_keys.shape[0]) if extra_mask is None or extra_mask[row, i, e]]
          seen_keys += [own_keys[e, kv_head] for e in seen]
          seen_values += [own_values[e, kv_head] for e in seen]
        scores = np.array([q[row, i, head] @ k for k in seen_keys], np.float64) / np.sqrt(hd)
        weights = np.exp(scores - scores.max())
        out[row, i, head] = (weights / weights.sum()) @ np.array(seen_values, np.float64)
  return out


@pytest.mark.parametrize("with_mask", [False, True], ids=["causal", "masked"])
@pytest.mark.parametrize("extra", [0, 2, "block"], ids=["no_extra", "two_extra", "block"])
def test_attention_sees_its_slots_its_mask_and_its_extra_keys(with_mask, extra):
  """The target's causal attention over its cache (the CPU kernel runs it here), an MTP module's over the
  committed slots and its own (a mask), its training's and the layer-skip search's with extra keys, a draft tree's
  block (keys every query shares, under a tree mask; a row whose queries see no cache slot) beside the cache."""
  rng = np.random.default_rng(7)
  b, t, h, kv, s, hd = 2, 3, 4, 2, 12, 16
  q = jnp.asarray(rng.standard_normal((b, t, h, hd), np.float32))
  keys = jnp.asarray(rng.standard_normal((b, s, kv, hd), np.float32))
  values = jnp.asarray(rng.standard_normal((b, s, kv, hd), np.float32))
  positions = jnp.asarray([[3, 4, 9], [0, 7, 11]], jnp.int32)
  mask = jnp.asarray(rng.random((b, t, s)) < 0.6).at[:, :, 0].set(True) if with_mask else None
  extras = {}
  if extra == "block":
    positions = jnp.asarray([[5, 5, 5], [-1, -1, -1]], jnp.int32)
    extras = {"extra_keys": jnp.asarray(rng.standard_normal((b, t, kv, hd), np.float32)),
              "extra_values": jnp.asarray(rng.standard_normal((b, t, kv, hd), np.float32)),
              "extra_mask": jnp.asarray([[[1, 0, 0], [1, 1, 0], [1, 0, 1]], [[1, 0, 0], [0, 1, 0], [1, 1, 1]]], bool)}
  elif extra:
    extras = {"extra_keys": jnp.asarray(rng.standard_normal((b, t, extra, kv, hd), np.float32)),
              "extra_values": jnp.asarray(rng.standard_normal((b, t, extra, kv, hd), np.float32))}
  fn = jax.jit(lambda *a: ops.attention(*a, mask=mask, **extras))
  got = np.asarray(fn(q, keys, values, positions))
  uses_kernel = "specjax_decode_attention" in fn.lower(q, keys, values, positions).as_text()
  assert uses_kernel == (not with_mask)  # the kernel serves the cache part, extra keys or not
  want = _direct_attention(q, keys, values, positions, None if mask is None else np.asarray(mask),
                           extras.get("extra_keys"), extras.get("extra_values"),
                           None if "extra_mask" not in extras else np.asarray(extras["extra_mask"]))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_takes_extra_keys_and_values_together():
  q = jnp.zeros((1, 1, 2, 16))
  cache = jnp.zeros((1, 4, 1, 16))
  with pytest.raises(ValueError, match="together"):
    ops.attention(q, cache, cache, jnp.zeros((1, 1), jnp.int32), extra_keys=jnp.zeros((1, 1, 1, 1, 16)))
  with pytest.raises(ValueError, match="query heads"):
    ops.attention(jnp.zeros((1, 1, 3, 16)), jnp.zeros((1, 4, 2, 16)), jnp.zeros((1, 4, 2, 16)),
                  jnp.zeros((1, 1), jnp.int32))


def test_a_packed_weight_reshapes_only_to_its_matrix():
  w = cpu.pack(jnp.ones((4, 2, 8)), k_dims=2)
  assert w.reshape(-1, 8).shape == (8, 8) and w.reshape(8, 8).unpack().shape == (8, 8)
  with pytest.raises(ValueError, match="cannot be read as"):
    w.reshape(4, 16)


def _lowered(fn, args, platform: str) -> str:
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_the_ops_lowered_for_a_tpu_are_jnp_and_for_a_cpu_the_kernels():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 64), np.float32))
  w = cpu.pack(jnp.asarray(rng.standard_normal((64, 40), np.float32)))
  q, cache = jnp.zeros((1, 2, 4, 16)), jnp.zeros((1, 8, 2, 16))
  positions = jnp.asarray([[3, 4]], jnp.int32)
  product = lambda x, w: ops.matmul(x, w)
  attention = lambda q, k, v, p: ops.attention(q, k, v, p)
  assert "specjax_packed_matmul" in _lowered(product, (x, w), "cpu")
  assert "specjax_decode_attention" in _lowered(attention, (q, cache, cache, positions), "cpu")
  for platform in ("tpu", "cuda"):
    assert "specjax_" not in _lowered(product, (x, w), platform)
    assert "dot_general" in _lowered(product, (x, w), platform)  # the product over the panels
    assert "specjax_" not in _lowered(attention, (q, cache, cache, positions), platform)


class _Captured(Exception):
  pass


def _generate_program(monkeypatch, model, **options):
  """The jitted program `specjax.generate` would compile for these options, and its arguments."""
  captured = {}

  def capture(program, *args, describe="", **static):
    captured.update(program=program, args=args, static=static)
    raise _Captured

  monkeypatch.setattr(compilation.Program, "__call__", capture)
  with pytest.raises(_Captured):
    specjax.generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=8, **options)
  monkeypatch.undo()
  return captured["program"].jitted, captured["args"], captured["static"]


@pytest.mark.parametrize("drafter", [None, "mtp_sequential"], ids=["autoregressive", "mtp_sequential"])
def test_generate_lowered_for_a_tpu_holds_no_cpu_custom_call(monkeypatch, random_target, drafter):
  """The decode programs `generate` compiles, on the weights packed for the CPU kernels as it reads them here:
  lowered for this CPU they call the kernels (products and decode attention, the speed of decoding on a CPU);
  lowered for a TPU (no TPU or libtpu needed) they hold no CPU custom call."""
  options = {} if drafter is None else {"drafter": specjax.make_drafter(drafter, random_target, path=None, depth=2),
                                        "gamma": 2}
  jitted, args, static = _generate_program(monkeypatch, random_target, **options)
  on_cpu = jitted.trace(*args, **static).lower(lowering_platforms=("cpu",)).as_text()
  assert "specjax_packed_matmul" in on_cpu and "specjax_decode_attention" in on_cpu
  on_tpu = jitted.trace(*args, **static).lower(lowering_platforms=("tpu",)).as_text()
  assert "specjax_" not in on_tpu
