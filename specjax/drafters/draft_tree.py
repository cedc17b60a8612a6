"""Draft trees grown from a drafter's own distributions: EAGLE-2's expand and rerank (Li et al. 2024, "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees").

A node's value is the product of the draft's probabilities along its path, about the chance that the target accepts
the whole path. Depth 1 holds the top-k tokens of the draft's first distribution. Each further depth expands the k
nodes of the previous depth with the highest value (one draft step over k positions), each proposing its top-k
children: k^2 candidates. The tree is the N candidates of highest value over all depths. A child's value never
exceeds its parent's and a parent is a candidate before its children (ties go to the earlier candidate), so the N
hold the parent of each of theirs; they are put in the order they were drafted, every parent before its children
(`specjax.trees`).

Tokens are chosen deterministically, so when sampling each node's q is one-hot at its token: the rule of
specjax/verify.py for deterministic siblings (accept x with probability p(x), and a rejected x leaves p without x,
renormalised). The tree's shape depends on the draft alone, never on the target's draws, which keeps that exact.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import SamplingParams

TOP_K = 8  # children per expanded node, and nodes expanded per depth (EAGLE-2 uses 8-10)


def grow(first_logits: jax.Array, payload: Any, expand: Callable, depth: int, nodes: int, sampling: SamplingParams,
         token_map: jax.Array | None = None, vocab_size: int | None = None, top_k: int = TOP_K):
  """A tree of `nodes` nodes at most `depth` deep: (tokens [B, N], probs [B, N, V] (None when greedy), parents [B, N]
  block indices).

  first_logits [B, V']: the draft's distribution after the pending token. payload: what the drafter carries for a
  node of depth 1, per row ([B, ...] arrays, shared by all depth-1 nodes). expand(d, tokens [B, k], payload
  [B, k, ...]) -> (logits [B, k, V'], payload [B, k, ...]): one draft step over k nodes of depth d - 1, giving the
  distribution of their children (depth d) and the payload the children carry. With a truncated draft vocabulary
  the logits are over `token_map` [V'] (token ids).
  """
  batch, vocab = first_logits.shape
  k = min(top_k, vocab)
  candidates = k + (depth - 1) * k * k
  if nodes > candidates:
    raise ValueError(f"a tree of {depth} levels expanding {k} nodes a level holds at most {candidates} nodes, got "
                     f"tree_nodes={nodes}")

  def children(logits, base):  # the top-k children of each node: (values [B, M * k], vocabulary indices [B, M * k])
    logp, index = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
    return (base[..., None] + logp).reshape(batch, -1), index.reshape(batch, -1)

  def take(tree, index):  # [B, M, ...] -> [B, k, ...] at index [B, k]
    return jax.tree.map(lambda a: jnp.take_along_axis(a, index.reshape(index.shape + (1,) * (a.ndim - 2)), axis=1),
                        tree)

  values, index = children(first_logits[:, None], jnp.zeros((batch, 1), jnp.float32))
  layer_payload = jax.tree.map(lambda a: jnp.repeat(a[:, None], k, axis=1), payload)
  layer_ids = jnp.broadcast_to(jnp.arange(k), (batch, k))
  all_values, all_index, all_parents = [values], [index], [jnp.full((batch, k), -1)]
  for d in range(2, depth + 1):
    best = jax.lax.top_k(values, k)[1]  # the layer's k most valuable nodes
    chosen = take(index, best)
    logits, child_payload = expand(d, chosen if token_map is None else token_map[chosen], take(layer_payload, best))
    values, index = children(logits, take(values, best))
    parent_ids = jnp.repeat(take(layer_ids, best), k, axis=1)
    layer_payload = jax.tree.map(lambda a: jnp.repeat(a, k, axis=1), child_payload)
    layer_ids = sum(v.shape[1] for v in all_values) + jnp.broadcast_to(jnp.arange(k * k), (batch, k * k))
    all_values, all_index, all_parents = all_values + [values], all_index + [index], all_parents + [parent_ids]
  # Rerank: the N most valuable (top_k keeps the earlier of equal values), in the order drafted.
  selected = jnp.sort(jax.lax.top_k(jnp.concatenate(all_values, axis=1), nodes)[1], axis=1)
  tokens = jnp.take_along_axis(jnp.concatenate(all_index, axis=1), selected, axis=1)
  tokens = tokens if token_map is None else token_map[tokens]
  parent_ids = jnp.take_along_axis(jnp.concatenate(all_parents, axis=1), selected, axis=1)
  # A parent's block index: 1 + how many selected candidates come before it (0: the pending token).
  parents = jnp.where(parent_ids < 0, 0, 1 + jnp.sum(selected[:, None, :] < parent_ids[:, :, None], axis=2))
  probs = None if sampling.greedy else jax.nn.one_hot(tokens, vocab_size or vocab, dtype=jnp.float32)
  return tokens.astype(jnp.int32), probs, parents.astype(jnp.int32)


def static_tree(accuracy, depth: int, nodes: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  """Medusa's static tree (Cai et al. 2024, section 2.1.2) from accuracy [K][R] (a drafter's k-th distribution of a
  round, a parallel head's or a block slot's: its rank-r token is the target's): the `nodes` rank paths (r_1..r_d),
  d <= depth, of highest expected acceptance prod_k accuracy[k][r_k].

  Best first from the root: a path's value never exceeds its prefix's, and a path is a candidate only once its prefix
  is chosen, so the chosen paths hold each one's parent (equal values: the path found first). Returns per node, in
  the order of depth then choice (every parent before its children): its parent's block index (0: the pending
  token, node i at i + 1; `specjax.trees`), its depth - 1 and its rank."""
  depth = min(depth, len(accuracy))
  frontier = [(-float(a), (r,)) for r, a in enumerate(accuracy[0])]
  heapq.heapify(frontier)
  chosen = []
  while frontier and len(chosen) < nodes:
    value, path = heapq.heappop(frontier)
    chosen.append(path)
    if len(path) < depth:
      for r, a in enumerate(accuracy[len(path)]):
        heapq.heappush(frontier, (value * float(a), path + (r,)))
  if len(chosen) < nodes:
    raise ValueError(f"a static tree {depth} deep over {len(accuracy[0])} ranks holds {len(chosen)} nodes, got "
                     f"tree_nodes={nodes}")
  ordered = sorted(chosen, key=lambda path: (len(path), chosen.index(path)))
  block = {path: i + 1 for i, path in enumerate(ordered)}
  return (tuple(block.get(path[:-1], 0) for path in ordered), tuple(len(path) - 1 for path in ordered),
          tuple(path[-1] for path in ordered))


def static_tree_tokens(logits: jax.Array, accuracy, depth: int, nodes: int, sampling: SamplingParams,
                       token_map: jax.Array | None = None, vocab_size: int | None = None):
  """`static_tree`'s nodes from a round's per-depth draft logits [B, depth, V'] (over `token_map` when truncated):
  (tokens [B, N], probs [B, N, V] one-hot at them (None when greedy), parents [B, N])."""
  parents, node_depths, node_ranks = static_tree(accuracy, depth, nodes)
  top = jax.lax.top_k(logits, len(accuracy[0]))[1]  # [B, depth, R] draft-vocabulary indices
  tokens = top[:, np.asarray(node_depths), np.asarray(node_ranks)]
  tokens = (tokens if token_map is None else token_map[tokens]).astype(jnp.int32)
  probs = None if sampling.greedy else jax.nn.one_hot(tokens, vocab_size, dtype=jnp.float32)
  return tokens, probs, jnp.broadcast_to(jnp.asarray(parents, jnp.int32), tokens.shape)


# ------------------------------------------------------------------------------- measured rank accuracy


def rank_hits(depths, params, batch, ranks: int = TOP_K) -> tuple[jax.Array, jax.Array]:
  """(hits [D, R], counted [D]) over a batch of cached features (`specjax.data.features.FeatureCache.batch`): for
  each of a drafter's depths, (logits [B, T, V'] over its draft vocabulary, shift) from its module's `depth_logits`,
  the positions t where its rank-r token is the target's greedy token at t + shift, and the positions compared."""
  hits, counted = [], []
  for logits, shift in depths:
    top = jax.lax.top_k(logits, ranks)[1]
    top = top if "token_map" not in params else params["token_map"][top]
    target = _shifted(jnp.asarray(batch["teacher_ids"])[..., 0], shift, 0)
    valid = _shifted(jnp.asarray(batch["mask"]), shift, False)
    hits.append(jnp.sum((top == target[..., None]) & valid[..., None], axis=(0, 1)))
    counted.append(jnp.sum(valid))
  return jnp.stack(hits), jnp.stack(counted)


def _shifted(x, k, fill):
  return x if k == 0 else jnp.pad(x[:, k:], [(0, 0), (0, k)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)


def rank_accuracy(model, drafter, cache, batch_size: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """(accuracy [D, R], counted [D]): the share of the positions of `cache` (cached features, `FeatureCache`, holding
  the layers the drafter reads: its `feature_layers`, or the target's last) where depth d's rank-r draft token is
  the target's greedy token (`rank_hits` over its module's `depth_logits`: parallel heads, block slots), what
  `static_tree` builds Medusa's tree from; and the positions compared per depth."""
  from specjax import drafters  # the drafters' modules import this one
  module = drafters.module(drafter.name)
  if not hasattr(module, "depth_logits"):
    raise ValueError(f"drafter {drafter.name!r} drafts no per-depth distributions from one forward: it has no static "
                     "tree to measure")
  layers = [int(i) for i in cache.meta["feature_layers"]]
  wanted = list(drafter.feature_layers or (model.config.num_layers - 1,))
  missing = [i for i in wanted if i not in layers]
  if missing:
    raise ValueError(f"{drafter.name} reads target layers {wanted}, but {cache.path} holds layers {layers}")
  index = [layers.index(i) for i in wanted]

  @jax.jit
  def hits_of(target_params, params, batch):
    return rank_hits(module.depth_logits(target_params, params, drafter.options, batch), params, batch)

  hits, counted = 0, 0
  for start in range(0, len(cache), batch_size):
    batch = cache.batch(np.arange(start, min(start + batch_size, len(cache))))
    batch = {k: batch[k] for k in ("tokens", "teacher_ids", "mask") if k in batch} | {
        "features": np.asarray(batch["features"])[:, :, index]}
    h, c = hits_of(model.params, drafter.params, batch)
    hits, counted = hits + np.asarray(h, np.int64), counted + np.asarray(c, np.int64)
  return hits / np.maximum(counted, 1)[:, None], counted
