"""Drafters: a few pure functions over the drafter's own state pytree.

A drafter is a `Drafter`: three functions, hashable static `options`, and a `params` pytree (arrays passed
into the compiled program as arguments, never baked in as constants):

  init(params, options, prompt: PromptInfo) -> state
      after the target's prefill (e.g. a draft model prefills its own cache).
  propose(params, options, state, inputs: DraftInputs, gamma, sampling) -> Proposal
      gamma draft tokens and, when sampling, their processed draft distributions q.
  update(params, options, state, result: RoundResult) -> state
      after verification, given each row's accepted length and the target's hidden states at the verified
      positions (what MTP heads draft from).

`draft_tokens` is the autoregressive drafting loop shared by model-based drafters (draft model, layer
skip): they only supply one forward step. Adding a drafter = adding one file that defines these functions
and a `make(model, **options) -> Drafter` factory, and one line in `_FACTORIES` below.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax.model import KVCache
from specjax.sampling import SamplingParams, probabilities, sample, sample_from_probs


@struct.dataclass
class PromptInfo:
  """What a drafter may read after the target's prefill."""
  tokens: jax.Array  # [B, T] prompts, right-padded
  lengths: jax.Array  # [B]
  last_hidden: jax.Array  # [B, D] target hidden state (before the final norm) at each prompt's last position
  cache_len: int = struct.field(pytree_node=False)


@struct.dataclass
class DraftInputs:
  """The decoding state a drafter proposes from."""
  sequence: jax.Array  # [B, L] every token by position: prompt, committed output, pending token
  position: jax.Array  # [B] position of the pending token (the last committed one; not in any cache yet)
  target_cache: KVCache  # drafters that share the target's cache (layer skip) read and write it
  key: jax.Array


class Proposal(NamedTuple):
  tokens: jax.Array  # [B, gamma]
  probs: jax.Array | None  # [B, gamma, V] draft distributions q (None when greedy)
  state: Any
  target_cache: KVCache  # returned unchanged unless the drafter writes into it


@struct.dataclass
class RoundResult:
  """What verification decided, for `update`."""
  sequence: jax.Array  # [B, L] after committing this round's tokens
  position: jax.Array  # [B] new pending position
  accepted: jax.Array  # [B] draft tokens accepted this round (0 for finished rows)
  verify_hidden: jax.Array  # [B, gamma+1, D] target hidden states over [pending, x_1..x_gamma]


@dataclasses.dataclass(frozen=True)
class Drafter:
  """A drafter; everything but `params` is static (hashable), so equal drafters share one compilation."""
  name: str
  init: Callable
  propose: Callable
  update: Callable
  options: Any = ()
  params: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
  uses_target_params: bool = False  # params are the target's own (layer skip): passed in, never copied
  forwards_per_step: int = 1  # model forwards per draft token (0 for lookup drafters), for `draft_calls`

  def static(self) -> "Drafter":
    return dataclasses.replace(self, params=None)

  def params_for(self, target_params):
    """The pytree passed to this drafter's functions, given the target's parameters."""
    return target_params if self.uses_target_params else self.params


def keep_state(params, options, state, result):
  """`update` for drafters that carry no state across rounds."""
  return state


def draft_tokens(step, cache, inputs: DraftInputs, gamma: int, sampling: SamplingParams):
  """Shared autoregressive drafting loop: `step(cache, tokens [B, T], positions [B]) -> (logits [B, V], cache)`.

  The first step reads tokens at positions pending-1 and pending; later steps read the previous draft.
  Returns (tokens [B, gamma], q [B, gamma, V] or None, cache).
  """
  rows = jnp.arange(inputs.sequence.shape[0])
  first_tokens = jnp.stack([inputs.sequence[rows, inputs.position - 1], inputs.sequence[rows, inputs.position]], 1)
  keys = jax.random.split(inputs.key, gamma)

  def choose(logits, key):
    if sampling.greedy:
      return sample(key, logits, sampling), None
    q = probabilities(logits, sampling)
    return sample_from_probs(key, q), q

  logits, cache = step(cache, first_tokens, inputs.position - 1)
  token, q = choose(logits, keys[0])

  def one(carry, key):
    cache, token, position = carry
    logits, cache = step(cache, token[:, None], position)
    nxt, q = choose(logits, key)
    return (cache, nxt, position + 1), (nxt, q)

  (cache, _, _), (tokens, qs) = jax.lax.scan(one, (cache, token, inputs.position + 1), keys[1:])
  tokens = jnp.concatenate([token[:, None], tokens.T], axis=1)
  probs = None if sampling.greedy else jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
  return tokens, probs, cache


_FACTORIES = {
    "draft_model": "specjax.drafters.draft_model",
    "layer_skip": "specjax.drafters.layer_skip",
    "prompt_lookup": "specjax.drafters.prompt_lookup",
}


def available() -> list[str]:
  return sorted(_FACTORIES)


def make_drafter(name: str, model, **options) -> Drafter:
  """Builds a drafter for `model` (the target). Names: see `available()`; options: each module's `make`."""
  if name not in _FACTORIES:
    raise ValueError(f"unknown drafter {name!r}; available: {', '.join(available())}")
  make = importlib.import_module(_FACTORIES[name]).make
  parameters = list(inspect.signature(make).parameters.values())[1:]  # after the target model
  valid = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
  unknown = sorted(set(options) - set(valid))
  if unknown and not any(p.kind == p.VAR_KEYWORD for p in parameters):  # a **options factory checks its own
    raise TypeError(f"drafter {name!r} has no option {', '.join(map(repr, unknown))}; "
                    f"its options: {', '.join(valid) or 'none'}")
  return make(model, **options)
