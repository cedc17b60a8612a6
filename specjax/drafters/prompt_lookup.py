"""Prompt lookup (n-gram) drafting (Saxena 2023, "Prompt Lookup Decoding").

For n from the largest size down, find the latest earlier occurrence of the last n tokens in prompt +
output and propose the gamma tokens that followed it. Known tokens only: a continuation that runs past the
pending token repeats the pending token. With no match the pending token itself is proposed. A copied token has
confidence 1 and a guess 0, so under positive confidence bars (adaptive drafting) a row proposes only the tokens it
copied, none without a match; a slot whose keep bar is 0 (`specjax.adaptive.confidence_bars`: a verification that
costs no more with it) keeps a guess too, and the draft ends there.
Proposals are deterministic, so q is one-hot and the sampling test accepts x with probability p(x).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters import Drafter, DraftInputs, Proposal, draft_lengths, keep_state, no_state
from specjax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Options:
  ngram_sizes: tuple[int, ...]
  vocab_size: int


def _latest_match(sequence, position, n: int):
  """Start index of the latest n-gram ending before `position` equal to the one ending at it (-1 if none)."""
  length = sequence.shape[1]
  starts = jnp.arange(length)
  rows = jnp.arange(sequence.shape[0])
  match = (starts[None, :] + n - 1 < position[:, None]) & (position[:, None] >= n - 1)
  for k in range(n):
    query = sequence[rows, jnp.maximum(position - n + 1 + k, 0)]
    shifted = jnp.pad(sequence[:, k:], ((0, 0), (0, k)), constant_values=-1)
    match &= shifted == query[:, None]
  return jnp.max(jnp.where(match, starts[None, :], -1), axis=1)


def propose(target_params, params, options: Options, state, inputs: DraftInputs, gamma: int,
            sampling: SamplingParams):
  seq, pos = inputs.sequence, inputs.position
  rows = jnp.arange(seq.shape[0])
  start, found = jnp.zeros_like(pos), jnp.zeros(pos.shape, bool)
  for n in options.ngram_sizes:  # largest first: the first size that matches wins
    s = _latest_match(seq, pos, n)
    take = ~found & (s >= 0)
    start, found = jnp.where(take, s + n, start), found | take
  index = start[:, None] + jnp.arange(gamma)[None, :]
  tokens = jnp.where(found[:, None], seq[rows[:, None], jnp.minimum(index, pos[:, None])], seq[rows, pos][:, None])
  probs = None if sampling.greedy else jax.nn.one_hot(tokens, options.vocab_size, dtype=jnp.float32)
  # Confidence 1 for a copied continuation, 0 for a guess (no match, or past the pending token): with adaptive
  # drafting a row proposes only what it copied.
  copied = found[:, None] & (index <= pos[:, None])
  return Proposal(tokens=tokens, probs=probs, state=state, target_cache=inputs.target_cache,
                  lengths=draft_lengths(copied.astype(jnp.float32), inputs, gamma), steps=jnp.zeros((), jnp.int32))


def make(model, ngram_sizes=(3, 2, 1)) -> Drafter:
  if isinstance(ngram_sizes, int):
    ngram_sizes = (ngram_sizes,)
  sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
  if not sizes or sizes[-1] < 1:
    raise ValueError(f"ngram_sizes must be positive integers, got {ngram_sizes}")
  return Drafter(name="prompt_lookup", init=no_state, propose=propose, update=keep_state,
                 options=Options(ngram_sizes=sizes, vocab_size=model.config.vocab_size), params={}, param_specs={},
                 forwards_per_step=0)
