"""Drafters: a few pure functions over the drafter's own state pytree.

A drafter is a `Drafter`: three functions, hashable static `options`, its own `params` pytree (arrays
passed into the compiled program as arguments, never baked in as constants) and their declaration
`param_specs` (shape and logical axes of every array, like `specjax.model.param_shapes` for the target).
Every function receives the target's parameters and the drafter's own, so a drafter may read both (layer
skip runs the target's layers and owns nothing; an MTP head owns its head and reads the target's LM head):

  init(target_params, params, options, prompt: PromptInfo) -> state
      after the target's prefill (e.g. a draft model prefills its own cache).
  propose(target_params, params, options, state, inputs: DraftInputs, gamma, sampling) -> Proposal
      up to gamma draft tokens (gamma is static, the buffers' width) and, when sampling, their processed draft
      distributions q. A drafter may draft fewer: at most `inputs.budget` (the engine's choice this round),
      and a row may stop early when the draft is unsure (its joint confidence below the bars `inputs.keep_bars`
      and `inputs.go_bars`, see `keeps`); `Proposal.lengths` says how many slots each row drafted, and later slots
      are never accepted.
  update(target_params, params, options, state, result: RoundResult) -> state
      after verification, given each row's accepted length and the target's hidden states at the verified
      positions (what MTP heads draft from). Also after a round in which the drafter did not run
      (`result.drafted` False: a plain target step, one position), so a drafter that keeps its own cache can
      follow.

A drafter that drafts trees (`Drafter.trees`, and `TREES = True` in its module: `tree_drafters`) proposes, when
`inputs.tree_nodes` is N, a tree of N nodes at most gamma deep (`Proposal.parents`, specjax/trees.py) instead of a
chain; `draft_tree.grow` builds EAGLE-2's trees from any drafter that can score the children of a set of nodes. Its
`update` then sees the tree's accepted path (`RoundResult.tree`), and must leave what a chain of those tokens would.

A drafter that runs the target's own first k layers on [pending, x_1, ...] (`reuse_layers = k`, early exit)
writes the target's K/V for those layers as it drafts and hands over their output (`Proposal.hidden`), so
verification runs layers 0..k-1 only for the token the draft did not process (LayerSkip's cache reuse).

A drafter describes what it costs in one `DraftCost` (a draft step, a round's part that does not grow with its
length, following a plain step, the target layers it reuses), which the drafting policy plans rounds with
(`specjax.adaptive`).

A trainable drafter also has `loss(target_params, params, options, batch) -> (loss, metrics)` over a batch
of cached target features (`specjax.data.features`); `specjax.train` trains `params` with the target frozen.

`draft_tokens` is the autoregressive drafting loop shared by model-based drafters (draft model, layer
skip): they only supply one forward step; `draft_tree_tokens` grows their trees from that step and a forward over a
depth's nodes (`model.forward_nodes`). Adding a drafter = adding one file that defines these functions
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

from specjax.drafters import draft_tree
from specjax.model import KVCache
from specjax.sampling import SamplingParams, argmax, probabilities, sample_from_probs


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
  budget: jax.Array | None = None  # scalar in 1..gamma: draft at most this many tokens (None: gamma)
  # Bars on a row's joint confidence at each slot, [gamma] or one for all (`keeps`; 0: rows never stop early): to keep
  # the slot, and to draft the next one
  keep_bars: jax.Array | float = 0.0
  go_bars: jax.Array | float = 0.0
  tree_nodes: int | None = struct.field(pytree_node=False, default=None)  # N: draft a tree of N nodes (None: a chain)


class Proposal(NamedTuple):
  tokens: jax.Array  # [B, gamma]; slots past a row's length hold anything
  probs: jax.Array | None  # [B, gamma, V] draft distributions q (None when greedy)
  state: Any
  target_cache: KVCache  # returned unchanged unless the drafter writes into it
  lengths: jax.Array | None = None  # [B] slots drafted per row; later slots are never accepted (None: all gamma)
  steps: jax.Array | None = None  # scalar: draft steps run (None: gamma), for `draft_calls`
  hidden: jax.Array | None = None  # [B, gamma, D] output of layers 0..k-1 at [pending, x_1..] (`reuse_layers`)
  # [B, N] a tree's parents (block indices, specjax/trees.py): tokens and probs are then over its N nodes, and
  # lengths counts nodes drafted (None: a chain)
  parents: jax.Array | None = None


@struct.dataclass
class RoundResult:
  """What verification decided, for `update`: the target ran over w positions from `verify_position` and committed
  the token after each of the first accepted + 1 of them (a row's later positions hold stale values: drafts it
  rejected, or nothing)."""
  sequence: jax.Array  # [B, L] after committing this round's tokens
  position: jax.Array  # [B] new pending position: verify_position + accepted + 1 (less for a row that finished)
  accepted: jax.Array  # [B] draft tokens accepted this round (0 for finished rows)
  # [B, w, D] target hidden states over [pending, x_1..x_{w-1}], w the verification's width (always > accepted)
  verify_hidden: jax.Array
  features: jax.Array | None  # [B, w, F, D] after each of `Drafter.feature_layers` (or None)
  verify_position: jax.Array  # [B] position of the first verified token (the pending one before this round)
  # True: the drafter proposed this round. False: a plain target step (the round did not draft: w = 1 position)
  drafted: bool = struct.field(pytree_node=False, default=True)
  # True: the round verified a tree; the w positions are its accepted path (gamma + 1, past the path's depth stale)
  tree: bool = struct.field(pytree_node=False, default=False)


@dataclasses.dataclass(frozen=True)
class DraftCost:
  """What a drafter's work costs, each over one target step at the same batch size: to first order the weights it
  reads, since a decode step is memory-bound (Leviathan et al. 2023's c; `specjax.leviathan.draft_cost`)."""
  step: float = 0.0  # c: one draft step
  plain_step: float = 0.0  # following a plain target step: `update` over its one token (`RoundResult.drafted` False)
  reused: float = 0.0  # the target's layers 0..k-1 the drafter runs itself (`Drafter.reuse_layers` = k)
  round: float = 0.0  # a drafting round's part that does not grow with its length (a forward that drafts them all)

  def __post_init__(self):
    if not (self.step >= 0.0 and self.plain_step >= 0.0 and self.round >= 0.0 and 0.0 <= self.reused < 1.0):
      raise ValueError(f"draft costs are shares of a target step: step, plain_step, round >= 0 and reused in "
                       f"[0, 1); got {self}")


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
  reuse_layers: int = 0  # k > 0: drafts run the target's layers 0..k-1 and hand over their output (see above)
  cost: DraftCost = DraftCost()  # for the drafting policy (`specjax.adaptive`)
  trees: bool = False  # propose drafts a tree when `DraftInputs.tree_nodes` is set

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
  if sampling.greedy:
    return greedy_draft(logits, token_map), None
  q = draft_probabilities(logits, sampling, token_map, vocab_size)
  return sample_from_probs(key, q), q


def greedy_draft(logits: jax.Array, token_map: jax.Array | None = None) -> jax.Array:
  """The greedy draft tokens [...] of draft logits [..., V'] (over `token_map` when truncated)."""
  index = argmax(logits)
  return index if token_map is None else token_map[index]


def draft_probabilities(logits: jax.Array, sampling: SamplingParams, token_map: jax.Array | None = None,
                        vocab_size: int | None = None) -> jax.Array:
  """q [..., V] of draft logits [..., V'] (sampling): zero outside a truncated draft vocabulary `token_map`."""
  if token_map is not None:
    full = jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, logits.dtype)
    logits = full.at[..., token_map].set(logits)
  return probabilities(logits, sampling)


def confidence(logits: jax.Array, q: jax.Array | None) -> jax.Array:
  """The draft's top probability [...]: max q when sampling, max softmax(logits) when greedy.

  It depends on the tokens before a slot only, never on the token drawn there, so stopping on it keeps
  speculative sampling exact (Kangaroo's and EAGLE-2's confidence).
  """
  if q is not None:
    return jnp.max(q, axis=-1)
  logits = logits.astype(jnp.float32)
  return 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), axis=-1)


def keeps(joint: jax.Array, inputs: DraftInputs, slot, gamma: int) -> tuple[jax.Array, jax.Array]:
  """(keep, go): whether rows whose joint confidence at `slot` (0-based) is `joint` keep that slot, and whether they
  go on to draft the next one: at or above `inputs.keep_bars[slot]`, and at or above `inputs.go_bars[slot]` as well.

  The joint confidence at slot i is the product of the draft's top probabilities (`confidence`) over slots
  0..i, about the chance that drafts 0..i are all accepted (EAGLE-2's path value). A row drafts slot i + 1 only if
  it kept slot i and goes on from it (`specjax.adaptive.confidence_bars` derives both bars from the costs).
  """
  def bar(bars):
    return jnp.broadcast_to(jnp.asarray(bars, jnp.float32), (gamma,))[slot]
  keep = joint >= bar(inputs.keep_bars)
  return keep, keep & (joint >= bar(inputs.go_bars))


def draft_lengths(confidences: jax.Array, inputs: DraftInputs, gamma: int) -> jax.Array:
  """[B] leading slots kept (`keeps`) from the top probabilities [B, gamma] of a whole draft, at most the budget:
  slot i counts when the row kept it and went on from every slot before it."""
  budget = gamma if inputs.budget is None else inputs.budget
  joint = jnp.cumprod(confidences.astype(jnp.float32), axis=1)
  keep, go = keeps(joint, inputs, jnp.arange(gamma)[None, :], gamma)
  went_on = jnp.concatenate([jnp.ones_like(go[:, :1]), go[:, :-1]], axis=1)
  drafted = keep & went_on & (jnp.arange(gamma)[None, :] < budget)
  return jnp.sum(jnp.cumprod(drafted.astype(jnp.int32), axis=1), axis=1)


def draft_tokens(step, cache, inputs: DraftInputs, gamma: int, sampling: SamplingParams,
                 token_map: jax.Array | None = None, vocab_size: int | None = None, keep_hidden: bool = False):
  """Shared autoregressive drafting loop: `step(cache, tokens [B, T], positions [B]) -> (logits [B, V], hidden
  [B, D], cache)`, hidden being what `keep_hidden` collects into `Proposal.hidden`.

  The first step reads tokens at positions pending-1 and pending; later steps read the previous draft. A
  `jax.lax.while_loop` drafts until the budget is spent or every row has stopped at an unsure slot, so no
  step runs once no row can use it. With a truncated draft vocabulary, `step` returns logits [B, V'] over
  `token_map` (see `choose_tokens`). Returns a Proposal without state.
  """
  rows = jnp.arange(inputs.sequence.shape[0])
  first_tokens = jnp.stack([inputs.sequence[rows, inputs.position - 1], inputs.sequence[rows, inputs.position]], 1)
  keys = jax.random.split(inputs.key, gamma)
  budget = gamma if inputs.budget is None else inputs.budget

  def choose(logits, key):
    token, q = choose_tokens(logits, key, sampling, token_map, vocab_size)
    return token, q, confidence(logits, q)

  def write(buffers, i, token, q, hidden):
    tokens, probs, hiddens = buffers
    return (tokens.at[:, i].set(token), None if q is None else probs.at[:, i].set(q),
            hiddens.at[:, i].set(hidden) if keep_hidden else None)

  logits, hidden, cache = step(cache, first_tokens, inputs.position - 1)
  token, q, sure = choose(logits, keys[0])
  batch = rows.size
  buffers = (jnp.zeros((batch, gamma), jnp.int32),
             None if q is None else jnp.zeros((batch, gamma) + q.shape[1:], q.dtype),
             jnp.zeros((batch, gamma) + hidden.shape[1:], hidden.dtype) if keep_hidden else None)
  kept, active = keeps(sure, inputs, 0, gamma)  # active: the row drafts the next slot
  lengths = kept.astype(jnp.int32)
  carry = (jnp.ones((), jnp.int32), cache, token, sure, active, lengths, write(buffers, 0, token, q, hidden))

  def more(carry):
    i, _, _, _, active, _, _ = carry
    return (i < budget) & jnp.any(active)

  def one(carry):
    i, cache, token, joint, active, lengths, buffers = carry
    logits, hidden, cache = step(cache, token[:, None], inputs.position + i)
    nxt, q, sure = choose(logits, keys[i])
    joint = joint * sure
    kept, go = keeps(joint, inputs, i, gamma)
    return i + 1, cache, nxt, joint, active & go, lengths + (active & kept), write(buffers, i, nxt, q, hidden)

  if gamma == 1:  # static: no loop at all (what a single step costs, e.g. for specjax.roofline's byte count)
    steps, cache, _, _, _, lengths, (tokens, probs, hiddens) = carry
  else:
    steps, cache, _, _, _, lengths, (tokens, probs, hiddens) = jax.lax.while_loop(more, one, carry)
  return Proposal(tokens=tokens, probs=probs, state=None, target_cache=cache, lengths=lengths, steps=steps,
                  hidden=hiddens)


def draft_tree_tokens(step, expand_step, cache, ancestors, inputs: DraftInputs, gamma: int, sampling: SamplingParams,
                      token_map: jax.Array | None = None, vocab_size: int | None = None) -> Proposal:
  """EAGLE-2's tree of `inputs.tree_nodes` nodes at most gamma deep (`draft_tree.grow`) from a model drafter, the
  tree counterpart of `draft_tokens`: `step` (as `draft_tokens` takes it) reads [pending - 1, pending] into the cache
  and gives the first distribution; `expand_step(cache, tokens [B, k], committed [B], positions [B, k], ancestors)
  -> (logits [B, k, V'], ancestors)` scores the children of k nodes of a depth, node j at position positions[b, j]
  seeing the cache up to slot committed[b] (the pending token's) and its own ancestors' keys and values
  (`ancestors`, [B, k, ...] arrays: what a node carries; the argument is what a depth-1 node carries), and returns
  the children's. Nodes write nothing into the cache, so it holds the committed tokens only. Returns a Proposal
  without state, its target_cache the cache after the first step."""
  rows = jnp.arange(inputs.sequence.shape[0])
  first_tokens = jnp.stack([inputs.sequence[rows, inputs.position - 1], inputs.sequence[rows, inputs.position]], 1)
  first_logits, _, cache = step(cache, first_tokens, inputs.position - 1)

  def expand(depth, tokens, node_ancestors):  # the nodes of depth - 1 sit at pending + depth - 1
    positions = jnp.broadcast_to((inputs.position + depth - 1)[:, None], tokens.shape)
    return expand_step(cache, tokens, inputs.position, positions, node_ancestors)

  tokens, probs, parents = draft_tree.grow(first_logits, ancestors, expand, gamma, inputs.tree_nodes, sampling,
                                           token_map, vocab_size)
  return Proposal(tokens=tokens, probs=probs, state=None, target_cache=cache, steps=jnp.asarray(gamma, jnp.int32),
                  parents=parents)


_FACTORIES = {
    "draft_model": "specjax.drafters.draft_model",
    "layer_skip": "specjax.drafters.layer_skip",
    "mtp_parallel": "specjax.drafters.mtp_parallel",
    "block": "specjax.drafters.block",
    "mtp_sequential": "specjax.drafters.mtp_sequential",
    "prompt_lookup": "specjax.drafters.prompt_lookup",
}


def available() -> list[str]:
  return sorted(_FACTORIES)


def module(name: str):
  """The module that defines drafter `name`."""
  if name not in _FACTORIES:
    raise ValueError(f"unknown drafter {name!r}; available: {', '.join(available())}")
  return importlib.import_module(_FACTORIES[name])


# The option through which each trained drafter takes a checkpoint file (`make_drafter(name, model, <it>=file)`).
_CHECKPOINT_OPTION = {"block": "path", "draft_model": "draft", "layer_skip": "adapter", "mtp_parallel": "path",
                      "mtp_sequential": "path"}


def checkpoint_option(name: str) -> str:
  """The `make_drafter` option of drafter `name` that loads a trained checkpoint file."""
  if name not in _CHECKPOINT_OPTION:
    raise ValueError(f"drafter {name!r} loads no checkpoint; those that do: {', '.join(sorted(_CHECKPOINT_OPTION))}")
  return _CHECKPOINT_OPTION[name]


def shipped_names(name: str, target: str) -> list[str]:
  """The names by which drafter `name` loads the checkpoint shipped for `target` (a `specjax.config.MODEL_SHAPES`
  name) through its `checkpoint_option`: "default", and those its module's `SHIPPED_NAMES` spell for the target."""
  checkpoint_option(name)
  extra = getattr(importlib.import_module(_FACTORIES[name]), "SHIPPED_NAMES", ())
  return ["default"] + [n.format(target=target) for n in extra]


def tree_drafters() -> list[str]:
  """The drafters whose `make` builds drafters that draft trees (their module's `TREES`)."""
  return [name for name in available() if getattr(importlib.import_module(_FACTORIES[name]), "TREES", False)]


def _make_parameters(name: str) -> list[inspect.Parameter]:
  """The parameters of drafter `name`'s `make` after the target model."""
  if name not in _FACTORIES:
    raise ValueError(f"unknown drafter {name!r}; available: {', '.join(available())}")
  return list(inspect.signature(importlib.import_module(_FACTORIES[name]).make).parameters.values())[1:]


def option_names(name: str) -> list[str]:
  """The options drafter `name`'s `make` takes by name (after the target model)."""
  return [p.name for p in _make_parameters(name) if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def make_drafter(name: str, model, **options) -> Drafter:
  """Builds a drafter for `model` (the target). Names: see `available()`; options: each module's `make`."""
  parameters, valid = _make_parameters(name), option_names(name)
  make = importlib.import_module(_FACTORIES[name]).make
  unknown = sorted(set(options) - set(valid))
  if unknown and not any(p.kind == p.VAR_KEYWORD for p in parameters):  # a **options factory checks its own
    raise TypeError(f"drafter {name!r} has no option {', '.join(map(repr, unknown))}; "
                    f"its options: {', '.join(valid) or 'none'}")
  return make(model, **options)
