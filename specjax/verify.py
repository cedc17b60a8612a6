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

Trees (SpecInfer, Miao et al. 2024; Recursive Speculative Decoding, Jeon et al. 2024; Multi-Candidate
Speculative Decoding, Yang et al. 2024): the drafts are nodes of a tree (`parents`, specjax/trees.py; None: a
chain), p_j the target's distribution after block index j. Greedy accepts the deepest node whose path matches the
argmax at every step, and the next token is the argmax after it. Sampling walks down from the pending token: at the
current node with target distribution p, its children are tested in order, child x drawn from q_x given the
siblings before it (the drafter's per-node q: the same q for siblings drawn with replacement, q with the earlier
siblings removed and renormalised for siblings drawn without replacement, one-hot for deterministic top-k
siblings). x is accepted with probability min(1, p(x) / q_x(x)), and the walk moves to x with p = p_x; a rejected
x leaves p' = norm(max(0, p - q_x)), against which the next sibling is tested. When no child is left, the next
token is drawn from p. By the one-slot identity above, P(emit y) = min(q_x(y), p(y)) + (1 - sum min(q_x, p)) p'(y)
= p(y) whatever the next siblings' q, so by induction over the siblings every emitted token follows p. A chain
(one child per node) is the rule above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import trees
from specjax.sampling import argmax, sample_from_probs


def accepted_length(accept: jax.Array) -> jax.Array:
  """Length of the all-True prefix of accept [B, gamma]."""
  return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1)


def drafted(draft_tokens: jax.Array, lengths: jax.Array | None) -> jax.Array:
  """[B, N] True at the nodes each row drafted, the first lengths[b] (all when `lengths` is None)."""
  slots = jnp.arange(draft_tokens.shape[1])[None, :]
  return jnp.ones(draft_tokens.shape, bool) if lengths is None else slots < lengths[:, None]


def greedy_verify(draft_tokens: jax.Array, target_logits: jax.Array, lengths: jax.Array | None = None,
                  parents: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """draft_tokens [B, N], target_logits [B, N+1, V], lengths [B], parents [B, N] (None: a chain) ->
  (end [B], next_token [B]): end is the block index of the deepest accepted node (0: none; for a chain, the
  accepted length), the first such node where two are deepest."""
  batch, nodes = draft_tokens.shape
  tree = trees.describe(parents, batch, nodes)
  target_tokens = argmax(target_logits)
  matches = (draft_tokens == jnp.take_along_axis(target_tokens, tree.parents, axis=1)) & drafted(draft_tokens, lengths)
  matches = jnp.pad(matches, ((0, 0), (1, 0)), constant_values=True)  # [B, N + 1]: the pending token is given
  accepted = ~jnp.any(tree.ancestors & ~matches[:, None, :], axis=2)  # every node on the path from the root matches
  end = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1).astype(jnp.int32)
  return end, jnp.take_along_axis(target_tokens, end[:, None], axis=1)[:, 0]


def speculative_verify(key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
                       lengths: jax.Array | None = None,
                       parents: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Speculative sampling over a chain or a tree (the module docstring).

  Args:
    draft_tokens [B, N]; draft_probs q [B, N, V], node i's; target_probs p [B, N+1, V] (float32) after each block
    index; lengths [B]: nodes drafted per row (None: all N), later nodes are never tested; parents [B, N] (None: a
    chain).
  Returns:
    (end [B], next_token [B]): the block index of the last accepted node (for a chain, the accepted length), and
    the token drawn after it: from the residual left by its rejected children, or from p there.
  """
  accept_key, residual_key = jax.random.split(key)
  batch, nodes = draft_tokens.shape
  parents = trees.describe(parents, batch, nodes).parents
  is_drafted = drafted(draft_tokens, lengths)
  u = jax.random.uniform(accept_key, draft_tokens.shape, jnp.float32)
  rows = jnp.arange(batch)

  def test(i, carry):
    current, p = carry
    x, q = draft_tokens[:, i], draft_probs[:, i]
    child = is_drafted[:, i] & (parents[:, i] == current)
    accept = child & (u[:, i] * q[rows, x] < p[rows, x])  # u < p/q without dividing by q
    residual = jnp.maximum(p - q, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)
    p = jnp.where(accept[:, None], target_probs[:, i + 1], jnp.where(child[:, None], residual, p))
    return jnp.where(accept, i + 1, current), p

  start = (jnp.zeros(batch, jnp.int32), target_probs[:, 0])
  end, p = jax.lax.fori_loop(0, nodes, test, start) if nodes else start  # a plain step verifies no draft
  return end, sample_from_probs(residual_key, p)
