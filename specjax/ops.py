"""The two operations whose implementation depends on the platform: matrix products and attention.

Each is plain jnp, which is what runs on TPU and GPU and what a reader should read. Where a program is compiled for
a CPU, `specjax.backends.cpu`'s kernels serve the cases they take (products over weights packed as column panels,
causal attention of a few new tokens per row over a cache). The choice follows the platform a program is compiled
for, not the process: `jax.lax.platform_dependent` traces both branches and lowers only the branch of the platform
a program is lowered for, so a program lowered for a TPU from a CPU host holds no CPU custom call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.backends import cpu


def matmul(x: jax.Array, w, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w [K, N] -> [..., N], as jnp.matmul(x, w, preferred_element_type=...).

  w is an array, or a weight packed as column panels (`backends.cpu.Packed`: how decoding on a CPU reads the
  weights), multiplied by the kernel where the program is compiled for a CPU and over its panels with jnp elsewhere.
  """
  if not isinstance(w, cpu.Packed):
    return jnp.matmul(x, w, preferred_element_type=preferred_element_type)
  panels = functools.partial(cpu.matmul_panels, preferred_element_type=preferred_element_type)
  if not cpu.matmul_applies(x, w):
    return panels(x, w)
  kernel = functools.partial(cpu.packed_matmul, preferred_element_type=preferred_element_type)
  return jax.lax.platform_dependent(x, w, cpu=kernel, default=panels)


def attention(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array, *, mask: jax.Array | None = None,
              extra_keys: jax.Array | None = None, extra_values: jax.Array | None = None) -> jax.Array:
  """Causal grouped-query attention of queries at per-row positions over a cache; [B, T, H, hd].

  q [B, T, H, hd]; keys/values [B, S, KV, hd] (a KV cache, or a sequence's own), H a multiple of KV (grouped-query
  attention, Ainslie et al. 2023: each KV head serves H / KV query heads). The query at positions[b, t] sees slots
  0..positions[b, t]; of those, only where mask [B, T, S] is True when one is given. extra_keys/values
  [B, T, E, KV, hd] are E more keys and values per query, always seen: a draft's own keys beside a cache it reads
  but does not write. softmax(q k^T / sqrt(hd)) v (Vaswani et al. 2017), in float32.
  """
  if (extra_keys is None) != (extra_values is None):
    raise ValueError("attention takes extra_keys and extra_values together")
  if q.shape[2] % keys.shape[2]:
    raise ValueError(f"{q.shape[2]} query heads do not share {keys.shape[2]} KV heads evenly")
  if mask is None and extra_keys is None and cpu.attention_applies(q, keys, values):
    kernel = functools.partial(cpu.attention, reference=_attention)
    return jax.lax.platform_dependent(q, keys, values, positions, cpu=kernel, default=_attention)
  return _attention(q, keys, values, positions, mask, extra_keys, extra_values)


def _attention(q, keys, values, positions, mask=None, extra_keys=None, extra_values=None):
  b, t, h, hd = q.shape
  s, kv = keys.shape[1], keys.shape[2]
  q = q.reshape(b, t, kv, h // kv, hd)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, keys, preferred_element_type=jnp.float32) / np.sqrt(hd)
  visible = jnp.arange(s)[None, None, :] <= positions[:, :, None]  # [B, T, S]
  if mask is not None:
    visible = visible & mask
  scores = jnp.where(visible[:, None, None], scores, -1e30)
  if extra_keys is None:
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, values).reshape(b, t, h, hd)
  extra = jnp.einsum("btkgh,btekh->bkgte", q, extra_keys, preferred_element_type=jnp.float32) / np.sqrt(hd)
  probs = jax.nn.softmax(jnp.concatenate([scores, extra], axis=-1), axis=-1).astype(values.dtype)
  out = (jnp.einsum("bkgts,bskh->btkgh", probs[..., :s], values)
         + jnp.einsum("bkgte,btekh->btkgh", probs[..., s:], extra_values))
  return out.reshape(b, t, h, hd)
