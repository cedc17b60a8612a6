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
    # top_k past the vocabulary keeps every token (as HF's TopKLogitsWarper does) instead of failing in lax.top_k.
    kth = jax.lax.top_k(logits, min(params.top_k, logits.shape[-1]))[0][..., -1:]
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


def sample_from_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
  """One categorical draw per row of probs [..., V] (zero-probability tokens are never drawn)."""
  return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def argmax(logits: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis, as int32: the first index of the largest value (of the first NaN, if any).

  Written as a max followed by a min over the indices where it is reached: XLA:CPU runs argmax's (value, index)
  reduction as scalar code, 0.24 ms over SmolLM2's 49,152 logits (2% of a decode step on 2 cores) and 0.73 ms over
  a 5-token verification's, against 0.02 and 0.14 ms for these two plain reductions."""
  top = jnp.max(logits, axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  at_top = (logits == top) | jnp.isnan(logits)  # a NaN makes top NaN, and argmax returns the first NaN
  return jnp.min(jnp.where(at_top, index, logits.shape[-1]), axis=-1)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Next tokens from logits [..., V]: argmax when greedy, else a draw from `probabilities`."""
  if params.greedy:
    return argmax(logits)
  return sample_from_probs(key, probabilities(logits, params))
