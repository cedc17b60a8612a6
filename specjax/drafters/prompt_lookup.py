"""Prompt lookup (n-gram) drafting (Saxena 2023, "Prompt Lookup Decoding").

For n from the largest size down, find the latest earlier occurrence of the last n tokens in prompt +
output and propose the gamma tokens that followed it. Known tokens only: a continuation that runs past the
pending token repeats the pending token. With no match the pending token itself is proposed. A copied token has
confidence 1 and a guess 0, so under positive confidence bars (adaptive drafting) a row proposes only the tokens it
copied, none without a match; a slot whose keep bar is 0 (`specjax.adaptive.confidence_bars`: a verification that
costs no more with it) keeps a guess too, and the draft ends there.

A tree of N nodes, gamma deep, offers several earlier matches as branches: the root's children are the first tokens
of up to ceil(N / gamma) earlier continuations that begin with different tokens (the next is the latest match, of
the longest n-gram that still has one, whose first token no branch before it has), each the chain of gamma tokens
that followed it (the last branch cut to fit N). A chain is the tree of one branch. Branches found come first; the
nodes of branches with no match are not drafted, except the first branch's (the chain's guess).

Proposals are deterministic, so q is one-hot and the sampling test accepts x with probability p(x) (a tree's
siblings: specjax/verify.py's rule for deterministic siblings).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import Drafter, DraftInputs, Proposal, draft_lengths, keep_state, no_state
from specjax.sampling import SamplingParams

TREES = True  # offers several earlier matches as branches (`propose` with `DraftInputs.tree_nodes`)


@dataclasses.dataclass(frozen=True)
class Options:
  ngram_sizes: tuple[int, ...]
  vocab_size: int


def _matches(sequence, position, n: int):
  """[B, L] bool: whether the n-gram starting at each index ends before `position` and equals the one ending at it."""
  length = sequence.shape[1]
  starts = jnp.arange(length)
  rows = jnp.arange(sequence.shape[0])
  match = (starts[None, :] + n - 1 < position[:, None]) & (position[:, None] >= n - 1)
  for k in range(n):
    query = sequence[rows, jnp.maximum(position - n + 1 + k, 0)]
    shifted = jnp.pad(sequence[:, k:], ((0, 0), (0, k)), constant_values=-1)
    match &= shifted == query[:, None]
  return match


def continuations(sequence, position, ngram_sizes: tuple[int, ...], branches: int):
  """(starts [B, branches], found [B, branches]): where up to `branches` earlier continuations of the last tokens
  start, each the latest match of the largest n-gram size that matches (`ngram_sizes` largest first) among those whose
  first token no earlier branch has. Found branches come first (a branch that finds none leaves none to later ones)."""
  starts = jnp.arange(sequence.shape[1])
  rows = jnp.arange(sequence.shape[0])
  matches = [(n, _matches(sequence, position, n), jnp.pad(sequence[:, n:], ((0, 0), (0, n)), constant_values=-1))
             for n in ngram_sizes]  # (n, matches, the token after each match)
  begins, found, firsts = [], [], []
  for _ in range(branches):
    begin, hit = jnp.zeros_like(position), jnp.zeros(position.shape, bool)
    for n, match, following in matches:
      fresh = match
      for first in firsts:
        fresh &= following != first[:, None]
      latest = jnp.max(jnp.where(fresh, starts[None, :], -1), axis=1)
      take = ~hit & (latest >= 0)
      begin, hit = jnp.where(take, latest + n, begin), hit | take
    firsts.append(jnp.where(hit, sequence[rows, begin], -1))
    begins.append(begin)
    found.append(hit)
  return jnp.stack(begins, axis=1), jnp.stack(found, axis=1)


def propose(target_params, params, options: Options, state, inputs: DraftInputs, gamma: int,
            sampling: SamplingParams):
  seq, pos = inputs.sequence, inputs.position
  rows = jnp.arange(seq.shape[0])
  nodes = inputs.tree_nodes or gamma
  node = np.arange(nodes)
  branch, depth = node // gamma, node % gamma  # node i: the depth-th token (0-based) of branch i // gamma
  starts, found = continuations(seq, pos, options.ngram_sizes, -(-nodes // gamma))
  index = starts[:, branch] + depth[None, :]
  node_found = found[:, branch]
  tokens = jnp.where(node_found, seq[rows[:, None], jnp.minimum(index, pos[:, None])], seq[rows, pos][:, None])
  probs = None if sampling.greedy else jax.nn.one_hot(tokens, options.vocab_size, dtype=jnp.float32)
  if inputs.tree_nodes:
    # A branch's first token hangs from the pending token (block 0), each later one from the node before it.
    parents = jnp.broadcast_to(jnp.asarray(np.where(depth == 0, 0, node), jnp.int32), tokens.shape)
    lengths = jnp.sum(node_found | (branch == 0)[None, :], axis=1).astype(jnp.int32)
  else:
    # Confidence 1 for a copied continuation, 0 for a guess (no match, or past the pending token): with adaptive
    # drafting a row proposes only what it copied.
    parents = None
    copied = node_found & (index <= pos[:, None])
    lengths = draft_lengths(copied.astype(jnp.float32), inputs, gamma)
  return Proposal(tokens=tokens, probs=probs, state=state, target_cache=inputs.target_cache, lengths=lengths,
                  steps=jnp.zeros((), jnp.int32), parents=parents)


def make(model, ngram_sizes=(3, 2, 1)) -> Drafter:
  if isinstance(ngram_sizes, int):
    ngram_sizes = (ngram_sizes,)
  sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
  if not sizes or sizes[-1] < 1:
    raise ValueError(f"ngram_sizes must be positive integers, got {ngram_sizes}")
  return Drafter(name="prompt_lookup", init=no_state, propose=propose, update=keep_state,
                 options=Options(ngram_sizes=sizes, vocab_size=model.config.vocab_size), params={}, param_specs={},
                 forwards_per_step=0, trees=TREES)
