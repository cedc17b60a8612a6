"""Draft trees: many candidate continuations verified in one target forward (SpecInfer, Miao et al. 2024; Medusa, Cai
et al. 2024; EAGLE-2, Li et al. 2024).

A round verifies a block [pending, node_0, ..., node_{N-1}]: block index 0 is the pending token and node i sits at
block index i + 1. A tree is `parents` [B, N] int32, node i's parent as a block index (0: the pending token), a
parent always before its children (parents[b, i] <= i), one tree per row. A chain x_1..x_N is the tree whose node i
hangs from block index i (`chain_parents`); `parents=None` names it wherever a tree is passed.

The target runs over the block in one forward with a `specjax.model.BlockMask`: node j at position offset + depth(j)
(RoPE), seeing the committed cache and its own ancestors (and itself), written at cache slot offset + j. After
verification the accepted root-to-leaf path (`path`) is moved where a chain's tokens would be: its depth-d node's
keys and values to slot offset + d (`move_path`), so the cache holds exactly what a chain of the accepted tokens would
have written, and the slots past it are stale, overwritten by the next round's block before any query sees them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import ops
from specjax.model import BlockMask, KVCache


class Tree(NamedTuple):
  """A tree's structure over the block (block index 0 the pending token, node i at i + 1)."""
  parents: jax.Array  # [B, N] block index of each node's parent
  depths: jax.Array  # [B, N + 1] 0 for the pending token
  ancestors: jax.Array  # [B, N + 1, N + 1] bool: ancestors[b, j, a] when a is j or an ancestor of j

  @property
  def nodes(self) -> int:
    return self.parents.shape[1]

  def block_mask(self) -> BlockMask:
    return BlockMask(depths=self.depths, visible=self.ancestors)


def chain_parents(batch: int, nodes: int) -> np.ndarray:
  """A chain's parents: node i hangs from block index i (the pending token, then node i - 1)."""
  return np.broadcast_to(np.arange(nodes, dtype=np.int32), (batch, nodes))


def describe(parents: jax.Array | None, batch: int, nodes: int) -> Tree:
  """The depths and ancestors of the tree `parents` [B, N] (None: the chain of N nodes, as constants).

  Ancestry is the transitive closure of the parent relation: R = I + P squared ceil(log2(N + 1)) times, P[j, a] = 1
  when a is j's parent."""
  if parents is None:
    block = np.arange(nodes + 1)
    return Tree(parents=jnp.asarray(chain_parents(batch, nodes)),
                depths=jnp.asarray(np.broadcast_to(block, (batch, nodes + 1)), jnp.int32),
                ancestors=jnp.asarray(np.broadcast_to(block[None, :] <= block[:, None], (batch, nodes + 1, nodes + 1))))
  parent_of = jax.nn.one_hot(parents, nodes + 1, dtype=jnp.float32)  # [B, N, N + 1]
  reach = jnp.eye(nodes + 1, dtype=jnp.float32) + jnp.pad(parent_of, ((0, 0), (1, 0), (0, 0)))
  for _ in range(int(np.ceil(np.log2(nodes + 1)))):
    reach = jnp.minimum(jnp.einsum("bja,bak->bjk", reach, reach), 1.0)
  ancestors = reach > 0
  return Tree(parents=parents, depths=jnp.sum(ancestors, axis=-1).astype(jnp.int32) - 1, ancestors=ancestors)


def path(tree: Tree, end: jax.Array, depth: int) -> jax.Array:
  """[B, depth + 1] block indices of the path from the pending token to block index `end` [B]: entry d is its node at
  depth d (0: the pending token); entries past end's depth repeat `end`."""
  d = jnp.arange(depth + 1)[None, :, None]
  on_path = jnp.take_along_axis(tree.ancestors, end[:, None, None], axis=1)[:, 0]  # [B, N + 1]
  at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == d)  # [B, depth + 1, N + 1]
  return jnp.where(jnp.any(at_depth, axis=2), jnp.argmax(at_depth, axis=2), end[:, None]).astype(jnp.int32)


def along_path(x: jax.Array, block_path: jax.Array) -> jax.Array:
  """x [B, N + 1, ...] over the block, gathered along `path` [B, depth + 1]: [B, depth + 1, ...]."""
  index = block_path.reshape(block_path.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, index, axis=1)


def move_path(cache: KVCache, offset: jax.Array, block_path: jax.Array) -> KVCache:
  """The keys and values of the path's nodes (written at slots offset + block index) moved to slots offset + depth,
  where a chain of the same tokens would have written them. Every slot read comes before the writes, so a node that
  moves onto another's slot is read first."""
  rows = jnp.arange(offset.shape[0])[:, None]
  source = offset[:, None] + block_path
  target = offset[:, None] + jnp.arange(block_path.shape[1])[None, :]

  def move(layer):
    return ops.cache_write(layer, layer[rows, source], target)

  return KVCache(k=[move(k) for k in cache.k], v=[move(v) for v in cache.v])
