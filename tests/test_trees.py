"""Draft trees: the tree-masked forward, the accepted path's K/V, and the verification rules over trees."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import trees, verify
from specjax.drafters import DraftInputs, draft_head, draft_tree, mtp_parallel
from specjax.model import KVCache, forward, forward_nodes, init_cache, lm_head
from tests.task_drafters import perturbed
from specjax.sampling import sample_from_probs

# Two rows, each its own tree over 7 nodes (block indices of the parents: 0 is the pending token).
PARENTS = np.array([[0, 0, 1, 2, 2, 5, 0],  # siblings at depths 1 and 2; block 6 three deep through second siblings
                    [0, 1, 2, 3, 4, 5, 6]], np.int32)  # a chain of 7
PROMPT_LENGTHS = np.array([8, 5])  # ragged: each row's block at its own offset


def block_paths(parents_row):
  """Each block index's path from the pending token (block indices)."""
  paths = [[0]]
  for i, parent in enumerate(parents_row):
    paths.append(paths[parent] + [i + 1])
  return paths


@pytest.fixture(scope="module")
def prefilled(tiny):
  """The tiny model's cache after ragged prompts, and a random block [pending, 7 nodes] per row."""
  rng = np.random.default_rng(0)
  vocab = tiny.config.vocab_size
  # As wide as the block, so that the prefill and every path's causal forward share one compilation.
  prompts = rng.integers(0, vocab, (2, PARENTS.shape[1] + 1))
  cache = chain_forward(tiny.params, jnp.asarray(prompts), init_cache(tiny.config, 2, 32), jnp.zeros(2, jnp.int32),
                        config=tiny.config).cache
  return prompts, cache, jnp.asarray(rng.integers(0, vocab, (2, PARENTS.shape[1] + 1)), jnp.int32)


@functools.partial(jax.jit, static_argnames=("config",))
def tree_forward(params, block_tokens, cache, parents, *, config):
  tree = trees.describe(parents, *parents.shape)
  return forward(params, block_tokens, cache, jnp.asarray(PROMPT_LENGTHS), config, block=tree.block_mask()), tree


@functools.partial(jax.jit, static_argnames=("config",))
def chain_forward(params, tokens, cache, position, *, config):
  return forward(params, tokens, cache, position, config)


def path_forward(model, block_tokens, cache, row, path):
  """A causal forward of the block's tokens along `path` in `row` (entry `row` of the output; the other row runs
  zeros), padded to the block's length (the prefill's compilation; what follows a path's tokens changes neither
  their logits nor their K/V)."""
  tokens = np.zeros(block_tokens.shape, np.int32)
  tokens[row, :len(path)] = np.asarray(block_tokens[row])[np.asarray(path)]
  out = chain_forward(model.params, jnp.asarray(tokens), cache, jnp.asarray(PROMPT_LENGTHS), config=model.config)
  return jax.tree.map(lambda a: a[row:row + 1], out)


def test_describe_gives_depths_and_ancestors():
  tree = trees.describe(jnp.asarray(PARENTS), *PARENTS.shape)
  np.testing.assert_array_equal(tree.depths, [[0, 1, 1, 2, 2, 2, 3, 1], list(range(8))])
  for row in range(2):
    for j, path in enumerate(block_paths(PARENTS[row])):
      assert np.flatnonzero(tree.ancestors[row, j]).tolist() == path
  chain = trees.describe(None, 2, 7)
  np.testing.assert_array_equal(chain.depths, tree.depths[1:].repeat(2, axis=0))
  np.testing.assert_array_equal(chain.ancestors[0], tree.ancestors[1])


def test_a_tree_forward_gives_each_node_the_logits_of_its_path_forwarded_as_a_chain(tiny, prefilled):
  """Every node sees the committed cache and its ancestors at position offset + depth: exactly a causal forward of
  [pending, ..., node] from the same cache."""
  _, cache, block_tokens = prefilled
  out, _ = tree_forward(tiny.params, block_tokens, cache, jnp.asarray(PARENTS), config=tiny.config)
  for row in range(2):
    for j, path in enumerate(block_paths(PARENTS[row])):
      chain = path_forward(tiny, block_tokens, cache, row, path)
      np.testing.assert_allclose(out.logits[row, j], chain.logits[0, len(path) - 1], rtol=1e-4, atol=1e-4)


def test_the_accepted_path_leaves_the_cache_a_chain_of_its_tokens_would(tiny, prefilled):
  """After the move, slots offset .. offset + depth hold the K/V a causal forward of the path writes there; the
  committed slots before the block are untouched."""
  _, cache, block_tokens = prefilled
  out, tree = tree_forward(tiny.params, block_tokens, cache, jnp.asarray(PARENTS), config=tiny.config)
  end = jnp.asarray([6, 4])  # block 6 (depth 3, through siblings that are not first) and block 4 of the chain
  block_path = trees.path(tree, end, 4)
  np.testing.assert_array_equal(block_path, [[0, 2, 5, 6, 6], [0, 1, 2, 3, 4]])
  moved = trees.move_path(out.cache, jnp.asarray(PROMPT_LENGTHS), block_path)
  for row, depth in enumerate([3, 4]):
    path = np.asarray(block_path[row, :depth + 1])
    chain = path_forward(tiny, block_tokens, cache, row, path)
    start = PROMPT_LENGTHS[row]
    for layer in range(tiny.config.num_layers):
      for got, want in [(moved.k[layer], chain.cache.k[layer]), (moved.v[layer], chain.cache.v[layer])]:
        np.testing.assert_allclose(got[row, :start + depth + 1], want[0, :start + depth + 1], rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnames=("config",))
def nodes_forward(params, tokens, cache, committed, positions, ancestors, *, config):
  return forward_nodes(params, tokens, cache, committed, positions, ancestors, config)


def test_tree_nodes_drafted_apart_see_what_a_causal_forward_of_their_path_sees(tiny, prefilled):
  """A draft's expansion of a tree's nodes (`forward_nodes`): two nodes a row, each with its own ancestors' K/V,
  depth by depth from the pending token; each node's logits are those of a causal forward of its path, and the
  cache is left as it was."""
  _, cache, block_tokens = prefilled
  paths = [[0, 1, 2, 3], [0, 4, 5, 6]]  # two paths through each row's block tokens, one per node
  offset = jnp.asarray(PROMPT_LENGTHS)
  kv_shape = (2, len(paths), 0, tiny.config.num_kv_heads, tiny.config.head_dim)
  layers = range(tiny.config.num_layers)
  ancestors = KVCache(k=[jnp.zeros(kv_shape) for _ in layers], v=[jnp.zeros(kv_shape) for _ in layers])
  for depth in range(len(paths[0])):
    tokens = block_tokens[:, np.array([path[depth] for path in paths])]
    positions = jnp.broadcast_to((offset + depth)[:, None], tokens.shape)
    out = nodes_forward(tiny.params, tokens, cache, offset - 1, positions, ancestors, config=tiny.config)
    assert out.cache.k[0].shape[2] == depth + 1  # each node carries its ancestors' keys and its own
    ancestors = out.cache
    for row in range(2):
      for node, path in enumerate(paths):
        chain = path_forward(tiny, block_tokens, cache, row, path[:depth + 1])
        np.testing.assert_allclose(out.logits[row, node], chain.logits[0, depth], rtol=1e-4, atol=1e-4)


def test_greedy_tree_verify_accepts_the_deepest_path_of_argmax_matches():
  vocab = 8
  # Row 0 (the tree of PARENTS[0]), the target's argmax after each block index: blocks 1 and 2 (both children of
  # the pending token) match, block 1's child 3 does not, block 2's first child 4 does not, its second child 5 and
  # 5's child 6 do.
  target_tokens = np.array([[3, 5, 4, 1, 2, 6, 7, 0], [1, 2, 3, 4, 0, 0, 0, 0]])
  drafts = np.array([[3, 3, 0, 1, 4, 6, 2], [1, 2, 3, 1, 0, 0, 0]])
  logits = jax.nn.one_hot(target_tokens, vocab) * 5.0
  end, next_token = verify.greedy_verify(jnp.asarray(drafts), logits, parents=jnp.asarray(PARENTS))
  np.testing.assert_array_equal(end, [6, 3])  # row 0: block 6 at depth 3; row 1: three drafts then a mismatch
  np.testing.assert_array_equal(next_token, [7, 4])
  # Only the first 5 nodes drafted in row 0: node 5 (block 6) is not, so the deepest accepted is block 5.
  end, _ = verify.greedy_verify(jnp.asarray(drafts), logits, jnp.asarray([5, 7]), jnp.asarray(PARENTS))
  np.testing.assert_array_equal(end, [5, 3])


def residual_kept_after_a_rejected_sibling(key, draft_tokens, draft_probs, target_probs, lengths=None, parents=None):
  """A broken tree verifier: a rejected sibling leaves p unchanged for the siblings after it (the residual is
  taken only once no child is left)."""
  accept_key, residual_key = jax.random.split(key)
  batch, nodes = draft_tokens.shape
  parents = trees.describe(parents, batch, nodes).parents
  u = jax.random.uniform(accept_key, draft_tokens.shape, jnp.float32)
  rows = jnp.arange(batch)
  current, p, residual = jnp.zeros(batch, jnp.int32), target_probs[:, 0], target_probs[:, 0]
  for i in range(nodes):
    x, q = draft_tokens[:, i], draft_probs[:, i]
    child = (parents[:, i] == current) & verify.drafted(draft_tokens, lengths)[:, i]
    accept = child & (u[:, i] * q[rows, x] < p[rows, x])
    left = jnp.maximum(residual - q, 0.0)
    left = left / jnp.sum(left, axis=-1, keepdims=True)
    p = jnp.where(accept[:, None], target_probs[:, i + 1], p)
    residual = jnp.where(accept[:, None], target_probs[:, i + 1], jnp.where(child[:, None], left, residual))
    current = jnp.where(accept, i + 1, current)
  return current, sample_from_probs(residual_key, residual)


SIBLING_P = jnp.asarray([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
SIBLING_Q = jnp.asarray([0.05, 0.1, 0.3, 0.3, 0.15, 0.1])


@functools.partial(jax.jit, static_argnames=("rule", "n"))
def emitted_after_siblings(rule, n):
  """One depth, three siblings drawn without replacement from q (Gumbel top-3), each tested with q renormalised
  without the siblings before it: (the emitted token [n], the accepted block index [n])."""
  key_draft, key_verify = jax.random.split(jax.random.PRNGKey(5))
  gumbel = jax.random.gumbel(key_draft, (n, 6))
  siblings = jax.lax.top_k(jnp.log(SIBLING_Q) + gumbel, 3)[1].astype(jnp.int32)
  removed = jnp.cumsum(jax.nn.one_hot(siblings, 6), axis=1) - jax.nn.one_hot(siblings, 6)  # earlier siblings
  draft_probs = jnp.where(removed > 0, 0.0, SIBLING_Q)
  draft_probs = draft_probs / jnp.sum(draft_probs, axis=-1, keepdims=True)
  target_probs = jnp.broadcast_to(SIBLING_P, (n, 4, 6))
  end, next_token = rule(key_verify, siblings, draft_probs, target_probs, None, jnp.zeros((n, 3), jnp.int32))
  return jnp.where(end > 0, siblings[jnp.arange(n), jnp.maximum(end - 1, 0)], next_token), end


def sibling_samples(rule, n=200_000):
  """The emitted tokens' frequencies (`emitted_after_siblings`) and the accepted block indices."""
  emitted, end = emitted_after_siblings(rule, n)
  return np.bincount(np.asarray(emitted), minlength=6) / n, np.asarray(end)


def test_recursive_rejection_over_siblings_emits_p():
  observed, end = sibling_samples(verify.speculative_verify)
  np.testing.assert_allclose(observed, [0.4, 0.25, 0.2, 0.1, 0.05, 0.0], atol=4e-3)
  assert {0, 1, 2, 3} <= set(end.tolist())  # every sibling accepted sometimes, and all rejected


def test_the_sibling_rule_test_detects_a_residual_not_updated_after_a_rejected_sibling():
  observed, _ = sibling_samples(residual_kept_after_a_rejected_sibling)
  assert np.max(np.abs(observed - np.array([0.4, 0.25, 0.2, 0.1, 0.05, 0.0]))) > 0.02


def test_a_static_tree_keeps_the_rank_paths_of_highest_expected_acceptance():
  """Values: (0) .6, (0, 0) .3, (1) .2, (0, 1) .18, then (0, 2) .06: four nodes, depth by depth, parents first."""
  accuracy = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]]
  parents, heads, ranks = draft_tree.static_tree(accuracy, depth=2, nodes=4)
  assert (parents, heads, ranks) == ((0, 0, 1, 1), (0, 0, 1, 1), (0, 1, 0, 1))
  parents, heads, ranks = draft_tree.static_tree(accuracy, depth=1, nodes=3)  # one level: the heads' ranks
  assert (parents, heads, ranks) == ((0, 0, 0), (0, 0, 0), (0, 1, 2))
  with pytest.raises(ValueError, match="holds 3 nodes, got tree_nodes=4"):
    draft_tree.static_tree(accuracy, depth=1, nodes=4)


def test_rank_accuracy_counts_each_heads_rank_that_is_the_targets_next_token(tiny):
  """A fresh head is the target's own LM head over h_t; with the target's token t + 2 set to its rank-(t mod 3)
  token at t (and position 5 masked), head 1's hits by rank are the positions of each residue."""
  drafter = specjax.make_drafter("mtp_parallel", tiny, path=None, num_heads=1)
  rng = np.random.default_rng(0)
  length = 12
  features = rng.standard_normal((1, length, 1, tiny.config.hidden_size)).astype(np.float32)
  ranked = np.argsort(-np.asarray(lm_head(tiny.params, jnp.asarray(features[:, :, 0]), tiny.config))[0], axis=-1)
  teacher = np.zeros((1, length, 8), np.int32)
  for t in range(length - 1):
    teacher[0, t + 1, 0] = ranked[t, t % 3]
  mask = np.ones((1, length), bool)
  mask[0, 5] = False  # what head 1 compares at position 4
  batch = {"features": features, "teacher_ids": teacher, "mask": mask}
  depths = mtp_parallel.depth_logits(tiny.params, drafter.params, drafter.options, batch)
  hits, counted = draft_tree.rank_hits(depths, drafter.params, batch, ranks=4)
  assert int(counted[0]) == length - 2  # the last position has no next token, position 4's is masked
  np.testing.assert_array_equal(hits[0], [4, 3, 3, 0])  # t in 0..10 but 4: residues 0, 1, 2 four, three, three times

  class Cache:  # two layers, the target's last one second: what rank_accuracy reads
    path, meta = "a test", {"feature_layers": [0, tiny.config.num_layers - 1]}

    def __len__(self):
      return 1

    def batch(self, indices):
      return {"features": np.concatenate([-features, features], axis=2), "teacher_ids": teacher, "mask": mask}
  accuracy, compared = draft_tree.rank_accuracy(tiny, drafter, Cache())
  assert int(compared[0]) == length - 2
  np.testing.assert_allclose(accuracy[0, :4], np.asarray([4, 3, 3, 0]) / (length - 2))


@pytest.mark.slow
def test_a_blocks_rank_accuracy_compares_slot_i_with_the_targets_token_i_ahead(tiny):
  """Block slot i at anchor t drafts token t + i: the target's greedy token at t + i - 1. With the teacher's greedy
  tokens set to the block's own rank-0 tokens at every slot, every rank-0 hit counts and no other rank does."""
  drafter = perturbed(specjax.make_drafter("block", tiny, path=None, block_size=2), seed=2)
  from specjax.drafters import block
  rng = np.random.default_rng(3)
  length, layers = 10, len(drafter.feature_layers)
  batch = {"tokens": rng.integers(0, 32, (1, length)).astype(np.int32),
           "features": rng.standard_normal((1, length, layers, tiny.config.hidden_size)).astype(np.float32),
           "mask": np.ones((1, length), bool)}
  depths = block.depth_logits(tiny.params, drafter.params, drafter.options, batch)
  assert [shift for _, shift in depths] == [0, 1]
  top = np.asarray(jnp.argmax(depths[0][0], -1))  # slot 1 at t: the target's token at t
  batch["teacher_ids"] = np.zeros((1, length, 4), np.int32)
  batch["teacher_ids"][0, :, 0] = top[0]
  hits, counted = draft_tree.rank_hits(depths[:1], drafter.params, batch, ranks=3)
  assert int(counted[0]) == length and list(np.asarray(hits[0])) == [length, 0, 0]

  class Cache:
    path, meta = "a test", {"feature_layers": list(drafter.feature_layers)}

    def __len__(self):
      return 1

    def batch(self, indices):
      return batch
  accuracy, compared = draft_tree.rank_accuracy(tiny, drafter, Cache())
  assert accuracy.shape[0] == 2 and accuracy[0, 0] == 1.0 and list(compared) == [length, length - 1]


def test_a_checkpoints_measured_rank_accuracy_makes_its_trees_static(tiny, tmp_path):
  from specjax.drafters import draft_head
  fresh = specjax.make_drafter("mtp_parallel", tiny, path=None, num_heads=2)
  path = draft_head.save(fresh, str(tmp_path / "heads.safetensors"), tiny)
  assert specjax.make_drafter("mtp_parallel", tiny, path=path).options.rank_accuracy is None  # grown: EAGLE-2
  stored = draft_head.save_rank_accuracy(path, [[0.5, 0.25], [0.4, 0.125]], source="a test")
  assert stored == str(tmp_path / "heads.ranks.json")
  loaded = specjax.make_drafter("mtp_parallel", tiny, path=path)
  assert loaded.options.rank_accuracy == ((0.5, 0.25), (0.4, 0.125))
  with pytest.raises(ValueError, match="a row of ranks per draft depth"):
    specjax.make_drafter("mtp_parallel", tiny, path=path, rank_accuracy=[[0.5, 0.25]])


def test_prompt_lookup_offers_earlier_continuations_with_different_first_tokens_as_branches(tiny):
  """Row 0 ends in "1 2": its bigram matched at 8 (then 7 3), at 4 (then 8 9) and at 1 (then 7 again, not a new
  branch); no trigram "3 1 2" before. Row 1 ends in a token seen nowhere before: one branch, a guess."""
  sequence = jnp.asarray([[5, 1, 2, 7, 1, 2, 8, 9, 1, 2, 7, 3, 1, 2, 0, 0],
                          [4, 4, 4, 4, 4, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
  position = jnp.asarray([13, 5])
  drafter = specjax.make_drafter("prompt_lookup", tiny)
  inputs = DraftInputs(sequence=sequence, position=position, target_cache=None, key=jax.random.PRNGKey(0),
                       tree_nodes=8)
  propose = jax.jit(lambda inputs: drafter.propose(None, {}, drafter.options, (), inputs, 3, specjax.SamplingParams()))
  proposal = propose(inputs)
  # Branches of 3 (the last cut to 2): node i hangs from the pending token at the start of a branch, else from node
  # i - 1 (block index i).
  np.testing.assert_array_equal(proposal.parents, [[0, 1, 2, 0, 4, 5, 0, 7]] * 2)
  np.testing.assert_array_equal(proposal.tokens[0, :6], [7, 3, 1, 8, 9, 1])
  np.testing.assert_array_equal(proposal.tokens[1], [6] * 8)  # no match: the pending token, as a chain guesses
  np.testing.assert_array_equal(proposal.lengths, [6, 3])  # the found branches (and the first one) are drafted
  chain = propose(inputs.replace(tree_nodes=None))
  assert chain.parents is None
  np.testing.assert_array_equal(chain.tokens, proposal.tokens[:, :3])  # a chain is the first branch
