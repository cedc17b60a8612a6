"""Drafters: a few pure functions over the drafter's own state pytree.

A drafter is a `Drafter`: three functions, hashable static `options`, its own `params` pytree (arrays
passed into the compiled program as arguments, never baked in as constants) and their declaration
`param_specs` (shape and logical axes of every array, like `specjax.model.param_shapes` for the target).
Every function receives the target's parameters and the drafter's own, so a drafter may read both (layer
skip runs the target's layers and owns nothing; an MTP head owns its head and reads the target's LM head):

  init(target_params, params, options, prompt: PromptInfo) -> state
      after the target's prefill (e.g. a draft model prefills its own cache).
  propose(target_params, params, options, state, inputs: DraftInputs, gamma, sampling) -> Proposal
      gamma draft tokens and, when sampling, their processed draft distributions q.
  update(target_params, params, options, state, result: RoundResult) -> state
      after verification, given each row's accepted length and the target's hidden states at the verified
      positions (what MTP heads draft from).

A trainable drafter also has `loss(target_params, params, options, batch) -> (loss, metrics)` over a batch
of cached target features (`specjax.features`); `specjax.train` trains `params` with the target frozen.

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
  first_token: jax.Array  # [B] the token the prefill produced (the first pending token, at position lengths)
  last_hidden: jax.Array  # [B, D] target hidden state (before the final norm) at each prompt's last position
  features: jax.Array | None  # [B, T, F, D] residual stream after each of `Drafter.feature_layers` (or None)
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
  features: jax.Array | None  # [B, gamma+1, F, D] after each of `Drafter.feature_layers` (or None)


@dataclasses.dataclass(frozen=True)
class Drafter:
  """A drafter; everything but `params` is static (hashable), so equal drafters share one compilation."""
  name: str
  init: Callable
  propose: Callable
  update: Callable
  options: Any = ()
  params: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)  # the drafter's own
  param_specs: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)  # ParamSpec tree
  loss: Callable | None = None  # loss(target_params, params, options, batch) -> (loss, metrics); None: untrainable
  forwards_per_step: int = 1  # model forwards per draft token (0 for lookup drafters), for `draft_calls`
  feature_layers: tuple[int, ...] = ()  # target layers whose outputs the drafter reads (PromptInfo/RoundResult)
  max_gamma: int | None = None  # most draft tokens one round can propose (None: unbounded)

  def static(self) -> "Drafter":
    return dataclasses.replace(self, params=None, param_specs=None)


def keep_state(target_params, params, options, state, result):
  """`update` for drafters that carry no state across rounds."""
  return state


def no_state(target_params, params, options, prompt):
  """`init` for drafters that carry no state."""
  return ()


def choose_tokens(logits: jax.Array, key: jax.Array, sampling: SamplingParams, token_map: jax.Array | None = None,
                  vocab_size: int | None = None):
  """Draft tokens [...] and q [..., V] (None when greedy) from draft logits [..., V'].

  With a truncated draft vocabulary (`token_map` [V']: draft index -> token id), q is zero outside it, so
  verification over the full vocabulary stays lossless.
  """
  if token_map is not None and sampling.greedy:
    return token_map[jnp.argmax(logits, axis=-1)], None
  if token_map is not None:
    full = jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, logits.dtype)
    logits = full.at[..., token_map].set(logits)
  if sampling.greedy:
    return sample(key, logits, sampling), None
  q = probabilities(logits, sampling)
  return sample_from_probs(key, q), q


def draft_tokens(step, cache, inputs: DraftInputs, gamma: int, sampling: SamplingParams,
                 token_map: jax.Array | None = None, vocab_size: int | None = None):
  """Shared autoregressive drafting loop: `step(cache, tokens [B, T], positions [B]) -> (logits [B, V], cache)`.

  The first step reads tokens at positions pending-1 and pending; later steps read the previous draft.
  With a truncated draft vocabulary, `step` returns logits [B, V'] over `token_map` (see `choose_tokens`).
  Returns (tokens [B, gamma], q [B, gamma, V] or None, cache).
  """
  rows = jnp.arange(inputs.sequence.shape[0])
  first_tokens = jnp.stack([inputs.sequence[rows, inputs.position - 1], inputs.sequence[rows, inputs.position]], 1)
  keys = jax.random.split(inputs.key, gamma)

  def choose(logits, key):
    return choose_tokens(logits, key, sampling, token_map, vocab_size)

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
    "mtp_parallel": "specjax.drafters.mtp_parallel",
    "mtp_sequential": "specjax.drafters.mtp_sequential",
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
