"""Token sampling: temperature, top-k and top-p (nucleus) applied to logits, with explicit PRNG keys.

`probabilities` is the one definition of the processed distribution; the autoregressive sampler and the
speculative verifier both use it, so speculative sampling reproduces exactly what plain sampling draws from.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 means greedy (argmax); top_k 0 and top_p 1 disable those filters."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0 or int(self.top_k) != self.top_k:
      raise ValueError(f"top_k must be a non-negative integer, got {self.top_k}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """float32 probabilities [..., V] after temperature, top-k and top-p. Not for greedy params."""
  logits = logits.astype(jnp.float32) / params.temperature
  if params.top_k:
    # top_k past the vocabulary keeps every token (as HF's TopKLogitsWarper does).
    kth = kth_largest(logits, min(params.top_k, logits.shape[-1]))
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if params.top_p < 1.0:
    # Keep the smallest set of most likely tokens whose mass reaches top_p (HF's TopPLogitsWarper rule).
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    cutoff_index = jnp.sum(mass_before < params.top_p, axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.nn.softmax(logits, axis=-1)


TOP_K_PASSES = 16  # `kth_largest` takes up to this many passes of max; a larger k sorts (lax.top_k)


def kth_largest(x: jax.Array, k: int) -> jax.Array:
  """The k-th largest value over the last axis, counting repeats (lax.top_k(x, k)[0][..., -1:]), [..., 1].

  For the small k of top-k sampling, k passes of max over the values below the last one found: XLA:CPU runs
  lax.top_k on a row of Gemma's 262,144 logits as a sort (seconds for a batch's rows), a max in one pass. A value
  seen c times counts c times, so the pass stops moving once the values at or above it number k."""
  if k > TOP_K_PASSES:
    return jax.lax.top_k(x, k)[0][..., -1:]
  kth = jnp.max(x, axis=-1, keepdims=True)
  for _ in range(k - 1):
    enough = jnp.sum(x >= kth, axis=-1, keepdims=True) >= k
    below = jnp.max(jnp.where(x < kth, x, -jnp.inf), axis=-1, keepdims=True)
    kth = jnp.where(enough, kth, below)
  return kth


def sample_from_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
  """One categorical draw per row of probs [..., V] (zero-probability tokens are never drawn)."""
  return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


ARGMAX_BLOCK = 128  # `argmax` reduces blocks of this many logits with plain max reductions


def argmax(logits: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis, as int32: the first index of the largest value. (Logits with a NaN give an
  index in range, not necessarily jnp.argmax's first NaN.)

  XLA:CPU runs argmax's (value, index) reduction as scalar code: 0.24 ms over SmolLM2's 49,152 logits (2% of a
  decode step on 2 cores), 0.73 ms over a 5-token verification's. Here a plain max reduction (vectorised) finds
  each block of ARGMAX_BLOCK logits' largest value, and argmax runs over those block maxima and then within the
  first block that holds the largest one: 0.010 and 0.037 ms."""
  v = logits.shape[-1]
  if v % ARGMAX_BLOCK:
    fill = jnp.full(logits.shape[:-1] + (-v % ARGMAX_BLOCK,), -jnp.inf, logits.dtype)
    logits = jnp.concatenate([logits, fill], axis=-1)
  blocks = logits.reshape(logits.shape[:-1] + (-1, ARGMAX_BLOCK))
  block = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
  inside = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
  return (block * ARGMAX_BLOCK + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def top_k_probabilities(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """(probabilities [..., k] float32, ids [..., k] int32): the k most likely tokens of logits [..., V], most likely
  first, with their probabilities under the whole softmax at temperature 1 (not renormalised over the k): the
  target's next-token distribution as drafters distil it."""
  top_logits, top_ids = jax.lax.top_k(logits, k)
  log_normaliser = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1, keepdims=True)
  return jnp.exp(top_logits.astype(jnp.float32) - log_normaliser), top_ids.astype(jnp.int32)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Next tokens from logits [..., V]: argmax when greedy, else a draw from `probabilities`."""
  if params.greedy:
    return argmax(logits)
  return sample_from_probs(key, probabilities(logits, params))
