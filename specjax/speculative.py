"""The speculative decoding loop: one jit-compiled program, a `jax.lax.while_loop` over rounds.

One round, for every row at once:
  0. the drafting policy (specjax/adaptive.py) chooses the round: how many tokens it drafts, gamma every round
     (`FixedGamma`), or as many as pay by the costs (`AdaptiveDrafting`), none at all (a plain target step) where
     drafting cannot pay, with bars on the draft's confidence at which a row stops early; or, with `tree_nodes`, a
     tree (every round with `FixedGamma`, where it pays with `AdaptiveDrafting`);
  1. the drafter proposes up to that many tokens x_1..x_n (and their draft distributions q when sampling);
  2. the target scores [pending, x_1..x_n] in ONE forward at the row's own position (a causal mask makes that
     n + 1 next-token predictions), in the narrowest compiled width that holds the longest draft (only the
     pending token in a plain step); a drafter that ran the target's own first k layers hands over their output,
     and only layers k..L-1 run for all positions;
  3. verification (specjax/verify.py) accepts a prefix of a tokens and yields one more token (the correction
     at the first rejection, or the bonus token when all the row's drafts were accepted);
  4. x_1..x_a and that token are committed; the new pending token is the last of them. The target cache now
     holds valid K/V up to the old pending position + a; slots past it are overwritten in later rounds;
     in a tree round the drafter proposes a tree of N nodes instead (specjax/trees.py), verified in one
     forward over [pending, its N nodes] under a tree mask; the accepted root-to-leaf path is committed, and its
     K/V and the target's outputs along it are moved where a chain of its tokens would have put them, so what
     follows sees a chain;
  5. the drafter updates its state from the verification, and the policy observes what the round drafted and
     what was accepted.
Rows accept different numbers of tokens; a finished row (stop token, max_new_tokens) stops changing.
Stats are carried as arrays and read once at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import calibration, compilation, control, distributed, sharding, trees
from specjax.adaptive import (AdaptiveDrafting, Choice, FixedGamma, Outcome, Policy, is_policy, priced_forward_costs,
                              width_index)
from specjax.drafters import Drafter, DraftInputs, PromptInfo, Proposal, RoundResult, tree_drafters
from specjax.decoding import (Output, decode_draft_params, decode_outputs, describe_shapes, is_stop, place_on_mesh,
                              prefill, prepare_batch)
from specjax.model import KVCache, forward, init_cache
from specjax.sampling import SamplingParams, probabilities, sample
from specjax.stats import summarize
from specjax.verify import greedy_verify, speculative_verify


@struct.dataclass
class Counts:
  """Stats carried through the loop as arrays and read once at the end."""
  live_rounds: jax.Array  # [B] rounds in which the row was still generating
  proposed: jax.Array  # [B] draft tokens proposed (drafted slots of live rows)
  accepted: jax.Array  # [B] accepted draft tokens
  rejections: jax.Array  # [B] rounds that ended at a rejected draft (not at the end of the row's drafts)
  proposed_at: jax.Array  # [gamma] live rows that drafted slot i, over rounds
  accepted_at: jax.Array  # [gamma] live rows whose draft i was accepted, over rounds
  width_rounds: jax.Array  # [gamma + 1] rounds by the longest draft a row made (0: a 1-token target step)
  plain_steps: jax.Array  # scalar: rounds that did not draft at all (adaptive drafting's fallback)
  tree_rounds: jax.Array  # scalar: rounds that drafted a tree
  draft_steps: jax.Array  # scalar: draft steps run

  @classmethod
  def zero(cls, batch: int, gamma: int):
    zeros = functools.partial(jnp.zeros, dtype=jnp.int32)
    return cls(zeros(batch), zeros(batch), zeros(batch), zeros(batch), zeros(gamma), zeros(gamma), zeros(gamma + 1),
               zeros(()), zeros(()), zeros(()))

  def add(self, live, lengths, accepted, rejected, drafted, tree, draft_steps) -> "Counts":
    """One round: live [B] rows, lengths [B] drafted (a tree: the depth it reaches), accepted [B], rejected [B]
    (ended at a rejection); whether it drafted, and whether it drafted a tree."""
    slots = jnp.arange(self.accepted_at.shape[0])[None, :]
    return Counts(
        live_rounds=self.live_rounds + live, proposed=self.proposed + lengths, accepted=self.accepted + accepted,
        rejections=self.rejections + rejected,
        proposed_at=self.proposed_at + jnp.sum(slots < lengths[:, None], axis=0),
        accepted_at=self.accepted_at + jnp.sum(slots < accepted[:, None], axis=0),
        width_rounds=self.width_rounds.at[jnp.max(lengths)].add(1), plain_steps=self.plain_steps + ~drafted,
        tree_rounds=self.tree_rounds + tree, draft_steps=self.draft_steps + jnp.where(drafted, draft_steps, 0))


@struct.dataclass
class SpecState:
  sequence: jax.Array  # [B, L] tokens by position: prompt, committed output; pending at `position`
  position: jax.Array  # [B] position of the pending token (the last committed one)
  done: jax.Array  # [B]
  cache: KVCache  # target cache, valid below `position`
  draft_state: Any
  policy: Any  # the drafting policy's state (e.g. `specjax.adaptive.Acceptance`)
  key: jax.Array
  rounds: jax.Array  # scalar
  counts: Counts


def _commit(state: SpecState, draft_tokens, accepted_len, next_token, lengths, max_new_tokens, stop_ids):
  """Writes x_1..x_a and the next token after the pending one, truncated at a stop token or the budget."""
  gamma = draft_tokens.shape[1]
  rows = jnp.arange(draft_tokens.shape[0])
  block = jnp.concatenate([draft_tokens, next_token[:, None]], axis=1)
  block = block.at[rows, accepted_len].set(next_token)  # [B, gamma+1]; valid through index a
  offsets = jnp.arange(gamma + 1)
  produced = state.position - lengths + 1  # tokens generated so far, pending included
  valid = offsets[None, :] <= accepted_len[:, None]
  stops = valid & is_stop(block, stop_ids)
  first_stop = jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1), gamma + 1)
  count = jnp.minimum(jnp.minimum(accepted_len + 1, first_stop + 1), max_new_tokens - produced)
  count = jnp.where(state.done, 0, count)
  write = offsets[None, :] < count[:, None]
  target_pos = jnp.where(write, state.position[:, None] + 1 + offsets[None, :], state.sequence.shape[1])
  sequence = state.sequence.at[rows[:, None], target_pos].set(block, mode="drop")
  done = state.done | (first_stop < count) | (produced + count >= max_new_tokens)
  return sequence, state.position + count, done


@functools.partial(jax.jit, static_argnames=("config", "drafter", "policy", "sampling", "max_new_tokens",
                                             "cache_len", "stop_ids", "cache_sharding"))
def _generate_speculative(params, draft_params, prompt_tokens, lengths, key, *, config, drafter: Drafter,
                          policy: Policy, sampling: SamplingParams, max_new_tokens, cache_len, stop_ids,
                          cache_sharding=None):
  batch, width = prompt_tokens.shape
  gamma = policy.gamma  # the most tokens a round drafts (a tree's depth): the width of the draft buffers
  tree_nodes = getattr(policy, "tree_nodes", None)  # a tree round's nodes (None: no tree rounds)
  rows = jnp.arange(batch)
  cache = sharding.constrain_cache(init_cache(config, batch, cache_len), cache_sharding)
  with_layers = bool(drafter.feature_layers)
  logits, last_hidden, out = prefill(params, config, prompt_tokens, lengths, cache, return_layer_hidden=with_layers)
  key, first_key = jax.random.split(key)
  first = sample(first_key, logits, sampling)
  sequence = jnp.zeros((batch, cache_len), jnp.int32).at[:, :width].set(prompt_tokens)
  sequence = sequence.at[rows, lengths].set(first)
  prompt = PromptInfo(tokens=prompt_tokens, lengths=lengths, first_token=first, last_hidden=last_hidden,
                      features=_features(out, drafter.feature_layers), cache_len=cache_len)
  state = SpecState(
      sequence=sequence, position=lengths, done=is_stop(first, stop_ids) | (max_new_tokens == 1),
      cache=sharding.constrain_cache(out.cache, cache_sharding),
      draft_state=drafter.init(params, draft_params, drafter.options, prompt), policy=policy.init(), key=key,
      rounds=jnp.zeros((), jnp.int32), counts=Counts.zero(batch, gamma))

  def cond(s: SpecState):
    return ~jnp.all(s.done)

  def body(s: SpecState) -> SpecState:
    choice = policy.choose(s.policy)
    plain, chain, tree = choice.kinds()
    # One branch per kind of round (`control.run_if`, not `jax.lax.cond`: the cache is updated in place, not
    # copied), so a plain step runs neither the drafter nor a choice of verify width; a kind the policy never
    # chooses is not compiled.
    s = control.run_if(chain, lambda s: round_(s, choice, "chain"), s)
    s = control.run_if(tree, lambda s: round_(s, choice, "tree"), s)
    return control.run_if(plain, lambda s: round_(s, choice, "plain"), s)

  def round_(s: SpecState, choice: Choice, kind: str) -> SpecState:
    """Draft up to `choice.budget` tokens (kind "chain"), a tree of `tree_nodes` nodes ("tree") or nothing
    ("plain": a plain target step), verify and commit them; the drafter updates, and the policy observes the
    round."""
    key, draft_key, verify_key = jax.random.split(s.key, 3)
    drafting, nodes = kind != "plain", tree_nodes if kind == "tree" else None
    proposal = (_propose(params, draft_params, drafter, s, draft_key, gamma, choice, sampling, nodes)
                if drafting else _no_proposal(params, draft_params, drafter, s, draft_key, gamma, sampling))
    live = ~s.done
    # Nodes drafted (a chain's are its slots, at most the budget), and the depth they reach.
    drafted = jnp.where(live, proposal.lengths if nodes else jnp.minimum(proposal.lengths, choice.budget), 0)
    tree = None if proposal.parents is None else trees.describe(proposal.parents, batch, nodes)
    depth = drafted if tree is None else _depth_of(tree, drafted)
    # The cache and the drafter's state travel through the verification below; the rest of the proposal is read only.
    verified = (s.replace(cache=proposal.target_cache, draft_state=proposal.state), jnp.zeros_like(drafted),
                jnp.zeros_like(live))
    verify_round = functools.partial(verify, s, proposal._replace(target_cache=None, state=None), tree, drafted,
                                     depth, verify_key, drafting)
    # In the narrowest compiled width that holds [pending, x_1..x_n], n the longest draft a row made (a tree: all
    # its nodes).
    widths = policy.widths if nodes is None else (nodes + 1,)
    chosen = width_index(widths, jnp.max(drafted)) if drafting and len(widths) > 1 else 0
    for i, width in enumerate(widths):
      verified = control.run_if(chosen == i, functools.partial(verify_round, width=width), verified)
    s, accepted, rejected = verified
    outcome = Outcome(budget=choice.budget, drafted=depth, accepted=accepted, rejected=rejected,
                      stopped=live & (depth < choice.budget), tree=nodes is not None)
    return s.replace(policy=policy.observe(s.policy, outcome), key=key, rounds=s.rounds + 1,
                     counts=s.counts.add(live, depth, accepted, rejected, jnp.asarray(drafting),
                                         jnp.asarray(nodes is not None, jnp.int32), proposal.steps))

  def verify(before: SpecState, proposal: Proposal, tree: trees.Tree | None, drafted, depth, key, drafting: bool,
             carry, width: int):
    """The target over the first `width` of [pending, x_1..x_gamma] (or over [pending, the tree's nodes]) in one
    forward; the accepted drafts and the next token committed, and the drafter's update. Returns (state, accepted
    [B], rejected [B])."""
    s, live = carry[0], ~before.done
    tokens = jnp.concatenate([before.sequence[rows, before.position][:, None], proposal.tokens], axis=1)
    # A drafter's reused layers ran along a chain; a tree's nodes wrote no cache, so its block runs every layer.
    reuse_layers = drafter.reuse_layers if tree is None else 0
    out = _verify_forward(params, config, tokens, proposal, s.cache, before.position, width, reuse_layers, with_layers,
                          jnp.max(drafted) if drafting else None, None if tree is None else tree.block_mask())
    # No row drafted past slot width - 1, so verification reads the first width - 1 drafts only (none in a plain
    # step: the next token is the target's own).
    drafts = proposal.tokens[:, :width - 1]
    parents = None if tree is None else tree.parents
    if sampling.greedy:
      end, next_token = greedy_verify(drafts, out.logits, drafted, parents)
    else:
      end, next_token = speculative_verify(key, drafts, proposal.probs[:, :width - 1],
                                           probabilities(out.logits, sampling), drafted, parents)
    features = _features(out, drafter.feature_layers)
    if tree is None:  # a chain's accepted path is its first `end` drafts, already where the commit puts them
      accepted_len, path_tokens, cache, hidden = end, proposal.tokens, out.cache, out.hidden
    else:
      block_path = trees.path(tree, end, gamma)
      accepted_len = jnp.take_along_axis(tree.depths, end[:, None], axis=1)[:, 0]
      path_tokens = trees.along_path(tokens, block_path)[:, 1:]
      cache = trees.move_path(out.cache, before.position, block_path)
      hidden = trees.along_path(out.hidden, block_path)
      features = None if features is None else trees.along_path(features, block_path)
    sequence, position, done = _commit(s, path_tokens, accepted_len, next_token, lengths, max_new_tokens, stop_ids)
    accepted = jnp.where(live, accepted_len, 0)
    # The drafter's update sees the `width` verified positions only (a plain step: the pending one; a tree: its
    # accepted path, gamma + 1 positions): the sequential MTP module runs its block over every position it is handed.
    result = RoundResult(sequence=sequence, position=position, accepted=accepted, verify_hidden=hidden,
                         features=features, verify_position=before.position, drafted=drafting, tree=tree is not None)
    s = s.replace(sequence=sequence, position=position, done=done,
                  cache=sharding.constrain_cache(cache, cache_sharding),
                  draft_state=drafter.update(params, draft_params, drafter.options, s.draft_state, result))
    return s, accepted, live & (accepted_len < depth)

  s = jax.lax.while_loop(cond, body, state)
  num_generated = s.position - lengths + 1
  tokens = jnp.take_along_axis(s.sequence, lengths[:, None] + jnp.arange(max_new_tokens)[None, :], axis=1)
  return tokens, num_generated, {"rounds": s.rounds, **dataclasses.asdict(s.counts)}


def _propose(params, draft_params, drafter: Drafter, s: SpecState, key, gamma: int, choice: Choice, sampling,
             tree_nodes: int | None = None):
  """The drafter's proposal of up to `choice.budget` (>= 1) tokens (or a tree of `tree_nodes` nodes), with lengths
  and steps filled in."""
  inputs = DraftInputs(sequence=s.sequence, position=s.position, target_cache=s.cache, key=key,
                       budget=jnp.asarray(choice.budget), keep_bars=choice.keep_bars, go_bars=choice.go_bars,
                       tree_nodes=tree_nodes)
  proposal = drafter.propose(params, draft_params, drafter.options, s.draft_state, inputs, gamma, sampling)
  if (proposal.parents is None) != (tree_nodes is None):
    raise ValueError(f"drafter {drafter.name!r} proposed a {'chain' if proposal.parents is None else 'tree'} "
                     f"where the round drafts a {'chain' if tree_nodes is None else 'tree'}")
  return proposal._replace(
      lengths=(jnp.full(s.position.shape, tree_nodes or gamma, jnp.int32) if proposal.lengths is None
               else proposal.lengths),
      steps=jnp.asarray(gamma if proposal.steps is None else proposal.steps, jnp.int32))


def _no_proposal(params, draft_params, drafter: Drafter, s: SpecState, key, gamma: int, sampling) -> Proposal:
  """What a round that does not draft passes on: zeros shaped like a chain's proposal, the drafter's state
  unchanged."""
  inputs = DraftInputs(sequence=s.sequence, position=s.position, target_cache=s.cache, key=key,
                       budget=jnp.asarray(1))
  shapes = jax.eval_shape(lambda: drafter.propose(params, draft_params, drafter.options, s.draft_state, inputs,
                                                  gamma, sampling))
  empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  return empty._replace(state=s.draft_state, target_cache=s.cache, lengths=jnp.zeros(s.position.shape, jnp.int32),
                        steps=jnp.zeros((), jnp.int32))


def _depth_of(tree: trees.Tree, drafted: jax.Array) -> jax.Array:
  """[B] the depth the first `drafted` [B] nodes of `tree` reach."""
  drafted_block = jnp.arange(tree.nodes + 1)[None, :] <= drafted[:, None]
  return jnp.max(jnp.where(drafted_block, tree.depths, 0), axis=1)


def _verify_forward(params, config, tokens, proposal: Proposal, cache, position, width: int, reuse_layers: int,
                    with_layers: bool, longest: jax.Array | None, block=None):
  """The target over the first `width` of tokens [B, gamma+1] = [pending, x_1..x_gamma] written from `position`;
  outputs over those `width` positions. `longest`: the longest draft a row made (None: a plain step).

  A drafter that ran the target's layers 0..k-1 (k = `reuse_layers`) for n steps has written their K/V for
  [pending, x_1..x_{n-1}] into `cache` (the proposal's target cache) and hands over their output
  (`proposal.hidden`), so only layers k..L-1 run for all positions (LayerSkip's self-speculation), and layers
  0..k-1 run for x_n only when a row kept it (n <= `longest`: the draft ended at a token a row kept: its budget, or
  every row stopped going on). A draft whose every row dropped the last step's token ran one step past the longest
  draft, so every position verification reads already has its layer k-1 output. No row drafted past x_longest,
  and causal attention keeps the positions after it (whose inputs are left as zeros or are tokens no row kept) out
  of the logits that verification reads. `block`: the tree mask of a tree's block (`specjax.trees`), whose forward
  reuses no layers (its caller passes reuse_layers=0).
  """
  tokens = tokens[:, :width]
  if longest is None or not reuse_layers:
    out = forward(params, tokens, cache, position, config, return_layer_hidden=with_layers, block=block)
  else:
    steps, rows = proposal.steps, jnp.arange(tokens.shape[0])
    hidden = jnp.pad(proposal.hidden, ((0, 0), (0, 1), (0, 0)))[:, :width]

    def last(carry):  # layers 0..k-1 for x_n, the one drafted token they did not run for
      hidden, cache = carry
      out = forward(params, tokens[rows, steps][:, None], cache, position + steps, config,
                    layers=range(reuse_layers), compute_logits=False)
      return hidden.at[:, steps].set(out.hidden[:, 0].astype(hidden.dtype)), out.cache

    hidden, cache = control.run_if(steps <= longest, last, (hidden, cache))
    out = forward(params, None, cache, position, config, layers=range(reuse_layers, config.num_layers),
                  return_layer_hidden=with_layers, hidden=hidden)
    out = out._replace(layer_hidden=[hidden] + out.layer_hidden if with_layers else None)
  if reuse_layers and with_layers:  # layer k-1's output and later: the layers before it ran on one token only
    kept = out.layer_hidden[reuse_layers - config.num_layers - 1:]
    out = out._replace(layer_hidden=[None] * (reuse_layers - 1) + kept)
  return out


def _features(out, layers: tuple[int, ...]):
  """[B, T, F, D]: the residual stream after each of `layers` (None when the drafter reads none)."""
  return jnp.stack([out.layer_hidden[i] for i in layers], axis=2) if layers else None


def generate(model, prompts, *, drafter: Drafter, gamma: int, sampling: SamplingParams, max_new_tokens: int,
             seed: int, mesh, max_len, stop_ids, adaptive: bool | Policy = True,
             tree_nodes: int | None = None) -> Output:
  """Speculative counterpart of `specjax.generate` (which resolves the sampling and stop arguments and calls this).

  gamma is the most tokens a round drafts; `adaptive` is the drafting policy (specjax/adaptive.py): True
  (`AdaptiveDrafting()`: fewer tokens where that pays, and unsure rows stop early), False (`FixedGamma()`: gamma
  every round), or a policy object. `tree_nodes=N`: rounds may draft a tree of N nodes, gamma deep (a drafter
  with `Drafter.trees`): every round with `FixedGamma`, where it pays with `AdaptiveDrafting` (chains and plain
  steps elsewhere); None drafts chains.
  """
  if not isinstance(drafter, Drafter):
    raise TypeError(f"drafter must come from specjax.make_drafter, got {type(drafter).__name__}")
  if not isinstance(gamma, (int, np.integer)) or gamma < 1:
    raise ValueError(f"gamma must be a positive integer, got {gamma!r}")
  if drafter.max_gamma is not None and gamma > drafter.max_gamma:
    raise ValueError(f"drafter {drafter.name!r} proposes at most {drafter.max_gamma} tokens a round, got "
                     f"gamma={gamma}")
  policy = AdaptiveDrafting() if adaptive is True else FixedGamma() if adaptive is False else adaptive
  if not is_policy(policy):
    raise TypeError(f"adaptive must be True, False or a drafting policy (specjax.AdaptiveDrafting, "
                    f"specjax.FixedGamma), got {adaptive!r}")
  if tree_nodes is not None:
    if not isinstance(tree_nodes, (int, np.integer)) or tree_nodes < 1:
      raise ValueError(f"tree_nodes must be a positive integer (or None: a chain), got {tree_nodes!r}")
    if not drafter.trees:
      raise ValueError(f"drafter {drafter.name!r} drafts chains only: tree_nodes needs a drafter that drafts trees "
                       f"({', '.join(tree_drafters())}, or one of your own with Drafter.trees)")
    if "tree_nodes" not in inspect.signature(policy.plan).parameters:
      raise ValueError(f"the drafting policy {type(policy).__name__} drafts chains only (its plan takes no "
                       "tree_nodes): pass adaptive=True or False with tree_nodes, or a policy that plans trees")
  if drafter.reuse_layers and any(i < drafter.reuse_layers - 1 for i in drafter.feature_layers):
    raise ValueError(f"drafter {drafter.name!r} reuses the target's first {drafter.reuse_layers} layers, so "
                     f"verification has no features of layers {drafter.feature_layers} over all positions")
  # A round writes its block past the committed tokens: gamma drafts, or a tree's nodes, and the pending token.
  batch = prepare_batch(model, prompts, max_new_tokens, extra_positions=max(gamma, tree_nodes or 0) + 1,
                        max_len=max_len)
  # The round costs depend on the rows one forward processes: the batch over the mesh's "data" axis.
  rows_per_forward = max(1, len(batch.lengths) // (mesh.shape.get("data", 1) if mesh is not None else 1))
  # Adaptive drafting's forward costs f(n), measured for this model, dtype, rows and host (once: later calls read the
  # cache) or typed; resolved before the compiled program, which reads them as constants.
  forward_costs = calibration.for_generation(policy, model, rows=rows_per_forward, gamma=int(gamma),
                                             tree_nodes=tree_nodes, mesh=mesh)
  if forward_costs is not None:
    policy = dataclasses.replace(policy, forward_costs=forward_costs.points)
  policy = (policy.plan(drafter.cost, int(gamma), rows_per_forward) if tree_nodes is None
            else policy.plan(drafter.cost, int(gamma), rows_per_forward, tree_nodes=int(tree_nodes)))
  start = time.perf_counter()
  params, prompt_tokens, lengths, cache_sharding = place_on_mesh(model, batch, mesh)
  (tokens, num_generated, stats), compile_seconds = _speculative_program(
      params, _place_draft_params(drafter, mesh), prompt_tokens, lengths, jax.random.PRNGKey(seed),
      describe=(f"{drafter.name}, gamma {gamma}{f', trees of {tree_nodes} nodes' if tree_nodes else ''}, "
                f"{type(policy).__name__}, {describe_shapes(batch)}"),
      config=model.config, drafter=drafter.static(), policy=policy, sampling=sampling,
      max_new_tokens=int(max_new_tokens), cache_len=batch.cache_len, stop_ids=stop_ids, cache_sharding=cache_sharding)
  tokens, num_generated, stats = distributed.to_host((tokens, num_generated, stats))  # also multi-process arrays
  seconds = time.perf_counter() - start - compile_seconds
  rows, texts = decode_outputs(model, tokens, num_generated, stop_ids)
  stats = summarize(stats, num_generated, seconds, forwards_per_step=drafter.forwards_per_step,
                    compile_seconds=compile_seconds)
  if forward_costs is not None:
    # The points of the table the plan read (all of a calibrated one's; a typed one interpolated there).
    stats["forward_costs"] = [list(point) for point in priced_forward_costs(forward_costs.points, rows_per_forward,
                                                                            int(gamma), tree_nodes)]
    stats["forward_costs_source"] = forward_costs.source
    stats["forward_costs_seconds"] = sum(forward_costs.seconds.values())  # measuring them, compiling included
  return Output(tokens=rows, texts=texts, stats=stats)


_speculative_program = compilation.Program(_generate_speculative, "speculative decoding")


def _place_draft_params(drafter: Drafter, mesh):
  """The drafter's own parameters, placed on the mesh by their declared logical axes (on one device: packed
  for the CPU kernels, `decode_draft_params`)."""
  if mesh is None:
    return decode_draft_params(drafter)
  if not jax.tree.leaves(drafter.params):
    return drafter.params
  return sharding.shard_tree(drafter.params, drafter.param_specs, mesh)
