"""The speculative decoding loop: one jit-compiled program, a `jax.lax.while_loop` over rounds.

One round, for every row at once:
  1. the drafter proposes gamma tokens x_1..x_gamma (and their draft distributions q when sampling);
  2. the target scores [pending, x_1..x_gamma] in ONE forward at the row's own position (a causal mask makes
     that gamma+1 next-token predictions);
  3. verification (specjax/verify.py) accepts a prefix of a tokens and yields one more token (the correction
     at the first rejection, or the bonus token when all gamma were accepted);
  4. x_1..x_a and that token are committed; the new pending token is the last of them. The target cache now
     holds valid K/V up to the old pending position + a; slots past it are overwritten in later rounds.
Rows accept different numbers of tokens; a finished row (stop token, max_new_tokens) stops changing.
Stats are carried as arrays and read once at the end.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import compilation, distributed, sharding
from specjax.drafters import Drafter, DraftInputs, PromptInfo, RoundResult
from specjax.decoding import (Output, decode_outputs, describe_shapes, is_stop, place_on_mesh, prefill,
                              prepare_batch)
from specjax.model import KVCache, forward, init_cache
from specjax.sampling import SamplingParams, probabilities, sample
from specjax.verify import greedy_verify, speculative_verify


@struct.dataclass
class SpecState:
  sequence: jax.Array  # [B, L] tokens by position: prompt, committed output; pending at `position`
  position: jax.Array  # [B] position of the pending token (the last committed one)
  done: jax.Array  # [B]
  cache: KVCache  # target cache, valid below `position`
  draft_state: object
  key: jax.Array
  rounds: jax.Array  # scalar
  live_rounds: jax.Array  # [B] rounds in which the row was still generating
  accepted: jax.Array  # [B] accepted draft tokens
  rejections: jax.Array  # [B] rounds that ended at a rejected draft (not all gamma accepted)
  accepted_at: jax.Array  # [gamma] rounds (summed over live rows) in which draft i was accepted


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


@functools.partial(jax.jit, static_argnames=("config", "drafter", "gamma", "sampling", "max_new_tokens",
                                             "cache_len", "stop_ids", "cache_sharding"))
def _generate_speculative(params, draft_params, prompt_tokens, lengths, key, *, config, drafter: Drafter,
                          gamma, sampling: SamplingParams, max_new_tokens, cache_len, stop_ids,
                          cache_sharding=None):
  batch, width = prompt_tokens.shape
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
      draft_state=drafter.init(params, draft_params, drafter.options, prompt), key=key,
      rounds=jnp.zeros((), jnp.int32), live_rounds=jnp.zeros(batch, jnp.int32),
      accepted=jnp.zeros(batch, jnp.int32), rejections=jnp.zeros(batch, jnp.int32),
      accepted_at=jnp.zeros(gamma, jnp.int32))

  def cond(s: SpecState):
    return ~jnp.all(s.done)

  def body(s: SpecState):
    key, draft_key, verify_key = jax.random.split(s.key, 3)
    inputs = DraftInputs(sequence=s.sequence, position=s.position, target_cache=s.cache, key=draft_key)
    proposal = drafter.propose(params, draft_params, drafter.options, s.draft_state, inputs, gamma, sampling)
    pending = s.sequence[rows, s.position]
    verify_tokens = jnp.concatenate([pending[:, None], proposal.tokens], axis=1)
    out = forward(params, verify_tokens, proposal.target_cache, s.position, config, return_layer_hidden=with_layers)
    if sampling.greedy:
      accepted_len, next_token = greedy_verify(proposal.tokens, out.logits)
    else:
      accepted_len, next_token = speculative_verify(verify_key, proposal.tokens, proposal.probs,
                                                    probabilities(out.logits, sampling))
    sequence, position, done = _commit(s, proposal.tokens, accepted_len, next_token, lengths,
                                          max_new_tokens, stop_ids)
    live = ~s.done
    accepted = jnp.where(live, accepted_len, 0)
    result = RoundResult(sequence=sequence, position=position, accepted=accepted, verify_hidden=out.hidden,
                         features=_features(out, drafter.feature_layers))
    return SpecState(
        sequence=sequence, position=position, done=done,
        cache=sharding.constrain_cache(out.cache, cache_sharding),
        draft_state=drafter.update(params, draft_params, drafter.options, proposal.state, result), key=key,
        rounds=s.rounds + 1, live_rounds=s.live_rounds + live, accepted=s.accepted + accepted,
        rejections=s.rejections + (live & (accepted_len < gamma)),
        accepted_at=s.accepted_at + jnp.sum(jnp.arange(gamma)[None, :] < accepted[:, None], axis=0))

  s = jax.lax.while_loop(cond, body, state)
  num_generated = s.position - lengths + 1
  tokens = jnp.take_along_axis(s.sequence, lengths[:, None] + jnp.arange(max_new_tokens)[None, :], axis=1)
  stats = {"rounds": s.rounds, "live_rounds": s.live_rounds, "accepted": s.accepted, "rejections": s.rejections,
           "accepted_at": s.accepted_at}
  return tokens, num_generated, stats


def _features(out, layers: tuple[int, ...]):
  """[B, T, F, D]: the residual stream after each of `layers` (None when the drafter reads none)."""
  return jnp.stack([out.layer_hidden[i] for i in layers], axis=2) if layers else None


def generate(model, prompts, *, drafter: Drafter, gamma: int, sampling: SamplingParams, max_new_tokens: int,
             seed: int, mesh, max_len, stop_ids) -> Output:
  """Speculative counterpart of `specjax.generate` (which resolves the sampling and stop arguments and calls this)."""
  if not isinstance(drafter, Drafter):
    raise TypeError(f"drafter must come from specjax.make_drafter, got {type(drafter).__name__}")
  if not isinstance(gamma, (int, np.integer)) or gamma < 1:
    raise ValueError(f"gamma must be a positive integer, got {gamma!r}")
  if drafter.max_gamma is not None and gamma > drafter.max_gamma:
    raise ValueError(f"drafter {drafter.name!r} proposes at most {drafter.max_gamma} tokens a round, got "
                     f"gamma={gamma}")
  batch = prepare_batch(model, prompts, max_new_tokens, extra_positions=gamma + 1, max_len=max_len)
  start = time.perf_counter()
  params, prompt_tokens, lengths, cache_sharding = place_on_mesh(model, batch, mesh)
  (tokens, num_generated, stats), compile_seconds = _speculative_program(
      params, _place_draft_params(drafter, mesh), prompt_tokens, lengths,
      jax.random.PRNGKey(seed), describe=f"{drafter.name}, gamma {gamma}, {describe_shapes(batch)}",
      config=model.config, drafter=drafter.static(), gamma=int(gamma),
      sampling=sampling, max_new_tokens=int(max_new_tokens), cache_len=batch.cache_len, stop_ids=stop_ids,
      cache_sharding=cache_sharding)
  tokens, num_generated, stats = distributed.to_host((tokens, num_generated, stats))  # also multi-process arrays
  seconds = time.perf_counter() - start - compile_seconds
  rows, texts = decode_outputs(model, tokens, num_generated, stop_ids)
  stats = summarize(stats, num_generated, gamma, seconds, forwards_per_step=drafter.forwards_per_step,
                    compile_seconds=compile_seconds)
  return Output(tokens=rows, texts=texts, stats=stats)


_speculative_program = compilation.Program(_generate_speculative, "speculative decoding")


def _place_draft_params(drafter: Drafter, mesh):
  """The drafter's own parameters, placed on the mesh by their declared logical axes."""
  if mesh is None or not jax.tree.leaves(drafter.params):
    return drafter.params
  return sharding.shard_tree(drafter.params, drafter.param_specs, mesh)


def summarize(stats, num_generated, gamma: int, seconds: float, forwards_per_step: int = 1,
              compile_seconds: float = 0.0) -> dict:
  """Host-side stats from the arrays the compiled loop returns; `seconds` excludes `compile_seconds`."""
  rounds = int(stats["rounds"])
  live_rounds = stats["live_rounds"].astype(np.int64)
  accepted = stats["accepted"].astype(np.int64)
  # The first token of every row comes from the prefill; each later one from a verification round.
  from_rounds = num_generated.astype(np.int64) - 1
  proposed = int(live_rounds.sum()) * gamma
  # Drafts the verifier actually tested: every accepted one plus the one rejected in each rejecting round.
  checked = int(accepted.sum() + stats["rejections"].sum())
  new_tokens = int(num_generated.sum())
  return {
      "rounds": rounds,
      "target_calls": rounds + 1,
      "draft_calls": rounds * gamma * forwards_per_step,
      "new_tokens": new_tokens,
      "acceptance_rate": float(accepted.sum() / proposed) if proposed else float("nan"),
      # Leviathan et al.'s alpha, the chance a tested draft is accepted: E[tokens/round] = (1-a^(g+1))/(1-a).
      "alpha": float(accepted.sum() / checked) if checked else float("nan"),
      "mean_accepted": float(from_rounds.sum() / live_rounds.sum()) if live_rounds.sum() else float("nan"),
      "acceptance_per_position": (stats["accepted_at"] / max(1, int(live_rounds.sum()))).tolist(),
      "new_tokens_per_row": num_generated.tolist(),
      "rounds_per_row": live_rounds.tolist(),
      "accepted_per_row": accepted.tolist(),
      "rejections_per_row": stats["rejections"].tolist(),
      "compile_seconds": compile_seconds,
      "seconds": seconds,
      "tokens_per_second": new_tokens / seconds,
  }
