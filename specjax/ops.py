"""The operations whose implementation depends on the platform or on how a weight is stored: matrix products,
gathers from a weight, attention and cache writes.

Each is plain jnp, which is what runs on TPU and GPU and what a reader should read. Where a program is compiled for
a CPU, `specjax.backends.cpu`'s kernels serve the cases they take (products over weights packed as column panels,
causal attention of a few new tokens per row over a cache, writes into a cache in place). The choice follows the
platform a program is compiled for, not the process: `jax.lax.platform_dependent` traces both branches and lowers
only the branch of the platform a program is lowered for, so a program lowered for a TPU from a CPU host holds no CPU
custom call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import int8
from specjax.backends import cpu


def matmul(x: jax.Array, w, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ w [K, N] -> [..., N], as jnp.matmul(x, w, preferred_element_type=...).

  w is an array, or a weight packed as column panels (`backends.cpu.Packed`: how decoding on a CPU reads the
  weights), multiplied by the kernel where the program is compiled for a CPU and over its panels with jnp elsewhere,
  or a GGUF-quantized weight (`backends.cpu.Quantized`, `specjax.load(..., quantized=True)`), multiplied by its
  kernel (decoding its blocks as it reads them) where the program is compiled for a CPU and as its dequantized
  float32 matrix with jnp elsewhere; or an int8 weight (`specjax.int8.Int8`: codes and a scale per output channel,
  for accelerators), multiplied as (x @ codes) * scale with jnp on every platform.
  """
  if isinstance(w, int8.Int8):
    return int8.matmul(x, w, preferred_element_type=preferred_element_type)
  if isinstance(w, cpu.Quantized):
    reference = functools.partial(cpu.quantized.matmul_reference, preferred_element_type=preferred_element_type)
    if not cpu.quantized_matmul_applies(x, w):
      return reference(x, w)
    kernel = functools.partial(cpu.quantized.quantized_matmul, preferred_element_type=preferred_element_type)
    return jax.lax.platform_dependent(x, w, cpu=kernel, default=reference)
  if not isinstance(w, cpu.Packed):
    return jnp.matmul(x, w, preferred_element_type=preferred_element_type)
  panels = functools.partial(cpu.matmul_panels, preferred_element_type=preferred_element_type)
  if not cpu.matmul_applies(x, w):
    return panels(x, w)
  kernel = functools.partial(cpu.packed_matmul, preferred_element_type=preferred_element_type)
  return jax.lax.platform_dependent(x, w, cpu=kernel, default=panels)


def matmul_transposed(x: jax.Array, table, preferred_element_type=None) -> jax.Array:
  """x [..., K] @ table.T for a table [N, K] (a tied embedding table as the LM head), without a transposed copy of an
  array; a quantized table (`backends.cpu.Quantized`, `specjax.int8.Int8`) through `matmul`."""
  if isinstance(table, int8.Int8):
    return int8.matmul(x, table, preferred_element_type=preferred_element_type)
  if isinstance(table, cpu.Quantized):
    return matmul(x, table.T, preferred_element_type=preferred_element_type)
  return jnp.einsum("...k,nk->...n", x, table, preferred_element_type=preferred_element_type)


def dequantize(w, *, int8_weights: bool = True):
  """w as an array, or a tree of weights as arrays: a quantized weight's (`backends.cpu.Quantized`) float32 values,
  an int8 weight's (`specjax.int8.Int8`) codes times scales (unless `int8_weights` is False: they stay), any other as
  it is. For code that copies or reshapes a weight (a drafter initialised from a target layer, export, a mesh);
  products and gathers take the weight itself (`matmul`, `take`)."""
  types = (cpu.Quantized, int8.Int8) if int8_weights else (cpu.Quantized,)
  return jax.tree.map(lambda x: x.dequantize() if isinstance(x, types) else x, w,
                      is_leaf=lambda x: isinstance(x, types))


def take(table, ids: jax.Array, axis: int = 0) -> jax.Array:
  """jnp.take(table, ids, axis): an embedding lookup, a head's columns. A quantized table (`backends.cpu.Quantized`)
  decodes the entries it gathers only, to the float32 values its products multiply by; an int8 table
  (`specjax.int8.Int8`) converts those entries only."""
  if isinstance(table, (cpu.Quantized, int8.Int8)):
    return table.take(ids, axis)
  return jnp.take(table, ids, axis=axis)


def attention(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array, *, mask: jax.Array | None = None,
              extra_keys: jax.Array | None = None, extra_values: jax.Array | None = None,
              extra_mask: jax.Array | None = None, starts: jax.Array | None = None,
              softcap: float | None = None) -> jax.Array:
  """Causal grouped-query attention of queries at per-row positions over a cache; [B, T, H, hd].

  q [B, T, H, hd]; keys/values [B, S, KV, hd] (a KV cache, or a sequence's own), H a multiple of KV (grouped-query
  attention, Ainslie et al. 2023: each KV head serves H / KV query heads). The query at positions[b, t] sees slots
  starts[b, t]..positions[b, t] (starts [B, T] int32; None: 0, the whole prefix; a sliding window of W slots, as
  Gemma 2/3's and Mistral's local layers see, is starts = positions - W + 1; none when starts > positions); of
  those, only where mask [B, T, S] is True when one is given. extra_keys/values are E more keys and values beside
  the cache, [B, T, E, KV, hd] per query or [B, E, KV, hd] for every query, seen where extra_mask [B, T, E] is True
  (always when None): a draft's own keys beside a cache it reads but does not write, a draft tree's block (each
  node sees its ancestors) beside the committed cache. softmax(q k^T / sqrt(hd)) v (Vaswani et al. 2017), in
  float32; with `softcap` c, the scores are c * tanh(score / c) (Gemma 2), which only jnp computes.

  The cache and the extra keys are attended apart and merged by their softmax denominators (the online softmax,
  Milakov & Gimelshein 2018; FlashAttention's merge): o = (Z_c o_c + Z_e o_e) / (Z_c + Z_e), Z = sum exp(scores).
  So the CPU kernel serves the cache part whatever the extra keys, with no mask over the cache; it reads only the
  slots each query sees, so a windowed query costs its window whatever the cache's length. A query that sees no
  cache slot takes its result from its extra keys.
  """
  if (extra_keys is None) != (extra_values is None):
    raise ValueError("attention takes extra_keys and extra_values together")
  if extra_mask is not None and extra_keys is None:
    raise ValueError("attention takes extra_mask with extra_keys only")
  if q.shape[2] % keys.shape[2]:
    raise ValueError(f"{q.shape[2]} query heads do not share {keys.shape[2]} KV heads evenly")
  if starts is not None and starts.shape != positions.shape:
    raise ValueError(f"starts {starts.shape} must have the shape of positions {positions.shape}")
  if mask is None and softcap is None and cpu.attention_applies(q, keys, values):
    kernel = functools.partial(cpu.attention, reference=_cache_attention)  # starts None: zeros
    out, lse = jax.lax.platform_dependent(q, keys, values, positions, starts, cpu=kernel, default=_cache_attention)
  else:
    out, lse = _cache_attention(q, keys, values, positions, starts, mask, softcap)
  if extra_keys is None:
    return out
  extra_out, extra_lse = _extra_attention(q, extra_keys, extra_values, extra_mask, softcap)
  most = jnp.maximum(lse, extra_lse)[..., None]  # [B, T, H, 1]; finite: -1e30 stands for no key seen
  weight, extra_weight = jnp.exp(lse[..., None] - most), jnp.exp(extra_lse[..., None] - most)
  merged = (weight * out.astype(jnp.float32) + extra_weight * extra_out) / (weight + extra_weight)
  return merged.astype(out.dtype)


def cache_write(cache: jax.Array, update: jax.Array, positions: jax.Array, *, in_place: bool = True) -> jax.Array:
  """cache [B, S, ...] with slot positions[b, t] of row b set to update[b, t] [B, T, ...] (cast to the cache's
  dtype); a position outside the cache is dropped. On a CPU, in place by the kernel (XLA's scatter into a
  bfloat16 cache widens the whole cache to float32 and back, and copies it). in_place=False: XLA's scatter always,
  for a cache sliced out of a stacked array (XLA writes its slice of the stack in place; the kernel's operand would
  be copied out of the stack and back every write)."""
  if in_place and cpu.cache_write_applies(cache, update):
    kernel = functools.partial(cpu.cache_write, reference=_cache_write)
    return jax.lax.platform_dependent(cache, update, positions, cpu=kernel, default=_cache_write)
  return _cache_write(cache, update, positions)


def _cache_write(cache, update, positions):
  rows = jnp.arange(update.shape[0])[:, None]
  return cache.at[rows, positions].set(update.astype(cache.dtype), mode="drop")


def _scores(q, keys, softcap=None):
  """q [B, T, H, hd] against keys [B, (T,) S, KV, hd]: float32 scores [B, KV, H / KV, T, S] (soft-capped)."""
  b, t, h, hd = q.shape
  kv = keys.shape[-2]
  q = q.reshape(b, t, kv, h // kv, hd)
  spec = "btkgh,bskh->bkgts" if keys.ndim == 4 else "btkgh,btskh->bkgts"
  scores = jnp.einsum(spec, q, keys, preferred_element_type=jnp.float32) / np.sqrt(hd)
  return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _softmax_out(scores, values, q_shape):
  """softmax over the last axis of scores [B, KV, G, T, S] applied to values [B, (T,) S, KV, hd]: (out [B, T, H,
  hd] in values' dtype, lse [B, T, H] float32)."""
  b, t, h, hd = q_shape
  lse = jax.nn.logsumexp(scores, axis=-1)  # [B, KV, G, T]
  probs = jnp.exp(scores - lse[..., None]).astype(values.dtype)
  spec = "bkgts,bskh->btkgh" if values.ndim == 4 else "bkgts,btskh->btkgh"
  out = jnp.einsum(spec, probs, values).reshape(b, t, h, hd)
  return out, jnp.moveaxis(lse, 3, 1).reshape(b, t, h)


def _cache_attention(q, keys, values, positions, starts=None, mask=None, softcap=None):
  """The cache part (out, lse): the query at positions[b, t] over slots starts[b, t]..positions[b, t] (0.. when
  starts is None; and mask)."""
  slots = jnp.arange(keys.shape[1])[None, None, :]
  visible = slots <= positions[:, :, None]  # [B, T, S]
  if starts is not None:
    visible = visible & (slots >= starts[:, :, None])
  if mask is not None:
    visible = visible & mask
  scores = jnp.where(visible[:, None, None], _scores(q, keys, softcap), -1e30)
  return _softmax_out(scores, values, q.shape)


def _extra_attention(q, extra_keys, extra_values, extra_mask=None, softcap=None):
  """The extra part (out float32, lse): every query over its extra keys (where extra_mask)."""
  scores = _scores(q, extra_keys, softcap)
  if extra_mask is not None:
    scores = jnp.where(extra_mask[:, None, None], scores, -1e30)
  out, lse = _softmax_out(scores, extra_values.astype(jnp.float32), q.shape)
  return out, lse
