"""Verification of draft tokens: the rule that makes speculative decoding lossless.

Notation: the target scores the pending token plus gamma drafts x_1..x_gamma in one forward, giving
next-token distributions p_1..p_{gamma+1} (p_i is the target's distribution for the slot of x_i, and
p_{gamma+1} the one after the last draft). The drafter drew x_i from q_i.

Greedy: accept the longest prefix with x_i == argmax p_i; the next token is argmax p_{a+1}, where a is the
number accepted. The output equals greedy autoregressive decoding token for token.

Sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al.
2023, "Accelerating Large Language Model Decoding with Speculative Sampling"): accept x_i with probability
min(1, p_i(x_i) / q_i(x_i)), in order, stopping at the first rejection. At a rejection in slot i the next
token is drawn from the residual norm(max(0, p_i - q_i)); if all gamma are accepted, one bonus token is
drawn from p_{gamma+1}. Each emitted token is then distributed exactly as p: P(emit y) =
q(y) min(1, p(y)/q(y)) + (1 - sum_z min(q(z), p(z))) * max(0, p(y) - q(y)) / sum_z max(0, p(z) - q(z)) = p(y).
Treating q_{gamma+1} as zero makes the bonus draw the same residual formula. p and q are the processed
distributions (temperature, top-k, top-p applied alike), so the output follows the processed target.
A residual with no mass (p == q, reachable only through float rounding) falls back to p.

Draft lengths: a row may draft fewer than gamma tokens (`lengths` [B], decided before the tokens it skips
were drawn: specjax/adaptive.py). Slots past its length are never accepted, and the first of them is drawn
from p with q treated as zero, exactly as the bonus token is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import argmax, sample_from_probs


def accepted_length(accept: jax.Array) -> jax.Array:
  """Length of the all-True prefix of accept [B, gamma]."""
  return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1)


def drafted(draft_tokens: jax.Array, lengths: jax.Array | None) -> jax.Array:
  """[B, gamma] True at the slots each row drafted (all when `lengths` is None)."""
  slots = jnp.arange(draft_tokens.shape[1])[None, :]
  return jnp.ones(draft_tokens.shape, bool) if lengths is None else slots < lengths[:, None]


def greedy_verify(draft_tokens: jax.Array, target_logits: jax.Array,
                  lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """draft_tokens [B, gamma], target_logits [B, gamma+1, V], lengths [B] -> (accepted_len [B], next_token [B])."""
  target_tokens = argmax(target_logits)
  accepted_len = accepted_length((draft_tokens == target_tokens[:, :-1]) & drafted(draft_tokens, lengths))
  next_token = jnp.take_along_axis(target_tokens, accepted_len[:, None], axis=1)[:, 0]
  return accepted_len, next_token


def speculative_verify(key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
                       lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Speculative sampling.

  Args:
    draft_tokens [B, gamma]; draft_probs q [B, gamma, V]; target_probs p [B, gamma+1, V] (float32);
    lengths [B]: slots drafted per row (None: all gamma).
  Returns:
    (accepted_len [B], next_token [B]): the correction drawn from the residual, or the bonus token.
  """
  accept_key, residual_key = jax.random.split(key)
  is_drafted = drafted(draft_tokens, lengths)
  draft_probs = jnp.where(is_drafted[..., None], draft_probs, 0.0)  # an undrafted slot has q = 0
  p_draft = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], axis=-1)[..., 0]
  q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
  u = jax.random.uniform(accept_key, p_draft.shape, jnp.float32)
  accepted_len = accepted_length((u * q_draft < p_draft) & is_drafted)  # u < p/q without dividing by q
  rows = jnp.arange(draft_tokens.shape[0])
  p = target_probs[rows, accepted_len]
  q = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))[rows, accepted_len]  # zero q at the bonus slot
  residual = jnp.maximum(p - q, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)
  return accepted_len, sample_from_probs(residual_key, residual)
