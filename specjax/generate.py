"""`generate`: batched autoregressive or speculative decoding, each one jit-compiled program.

The host only encodes prompts, pads them into a shape bucket and decodes the result; prefill and every
decode step run inside one compiled `jax.lax.while_loop` (no host sync per token).
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from specjax import compilation, distributed, sharding, speculative
from specjax.adaptive import Policy
from specjax.decoding import (Output, check_ids, decode_outputs, describe_shapes, is_stop, place_on_mesh, prefill,
                              prepare_batch)
from specjax.loading import Model
from specjax.model import KVCache, forward, init_cache
from specjax.sampling import SamplingParams, sample


@struct.dataclass
class DecodeState:
  tokens: jax.Array  # [B, max_new_tokens] generated ids (-1 = none yet)
  num_generated: jax.Array  # [B]
  positions: jax.Array  # [B] position of the last generated token (its K/V is not cached yet)
  done: jax.Array  # [B]
  cache: KVCache
  key: jax.Array
  steps: jax.Array  # scalar: decode forwards run


@functools.partial(jax.jit, static_argnames=("config", "sampling", "max_new_tokens", "cache_len", "stop_ids",
                                             "cache_sharding"))
def _generate_autoregressive(params, prompt_tokens, lengths, key, *, config, sampling, max_new_tokens, cache_len,
                             stop_ids, cache_sharding=None):
  batch = prompt_tokens.shape[0]
  rows = jnp.arange(batch)
  cache = sharding.constrain_cache(init_cache(config, batch, cache_len), cache_sharding)
  logits, _, out = prefill(params, config, prompt_tokens, lengths, cache)
  key, sub = jax.random.split(key)
  first = sample(sub, logits, sampling)
  state = DecodeState(
      tokens=jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first),
      num_generated=jnp.ones(batch, jnp.int32),
      positions=lengths,
      done=is_stop(first, stop_ids) | (max_new_tokens == 1),
      cache=sharding.constrain_cache(out.cache, cache_sharding), key=key, steps=jnp.zeros((), jnp.int32))

  def cond(s: DecodeState):
    return ~jnp.all(s.done)

  def body(s: DecodeState):
    last = s.tokens[rows, s.num_generated - 1]
    out = forward(params, last[:, None], s.cache, s.positions, config)
    key, sub = jax.random.split(s.key)
    nxt = sample(sub, out.logits[:, 0], sampling)
    live = ~s.done
    index = jnp.where(live, s.num_generated, max_new_tokens)  # out of bounds -> dropped
    num_generated = s.num_generated + live
    return DecodeState(
        tokens=s.tokens.at[rows, index].set(nxt, mode="drop"),
        num_generated=num_generated,
        positions=s.positions + live,
        done=s.done | (live & (is_stop(nxt, stop_ids) | (num_generated >= max_new_tokens))),
        cache=sharding.constrain_cache(out.cache, cache_sharding), key=key, steps=s.steps + 1)

  state = jax.lax.while_loop(cond, body, state)
  return state.tokens, state.num_generated, state.steps


_autoregressive_program = compilation.Program(_generate_autoregressive, "autoregressive decoding")


def generate(model: Model, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             drafter=None, gamma: int = 4, adaptive: bool | Policy = True, mesh=None,
             max_len: int | None = None, stop_ids: Sequence[int] | None = None) -> Output:
  """Generates up to `max_new_tokens` per prompt; rows stop at a stop token (EOS, end of turn).

  Args:
    model: from `specjax.load`.
    prompts: strings (encoded as given, no chat template) or lists of token ids; lengths may differ.
    temperature, top_k, top_p: 0 temperature is greedy.
    seed: PRNG seed for sampling.
    drafter: from `specjax.make_drafter`; None decodes autoregressively.
    gamma: the most draft tokens a speculative round proposes (every round's, with adaptive=False).
    adaptive: the drafting policy (specjax/adaptive.py). True: `specjax.AdaptiveDrafting()`, each round drafts the
      length that the running acceptance and the drafter's costs make pay (none: a plain target step), and a row
      stops drafting at a slot where the draft is unsure; `specjax.AdaptiveDrafting(min_confidence=,
      forward_costs=, prior_alpha=, memory=, plain_memory=, optimism=)` sets its options. False:
      `specjax.FixedGamma()`, gamma tokens every round. Lossless either way.
    mesh: a `jax.sharding.Mesh` from `specjax.sharding.make_mesh` to run sharded (rows over "data", heads /
      MLP / vocab over "model"; the batch must divide the data axis). Parameters are placed on the mesh
      each call unless already there: pass `sharding.shard_model(model, mesh)` to place them once.
    max_len: KV-cache capacity (default: the model's context length).
    stop_ids: tokens that end a row (default: the tokenizer's EOS and end-of-turn tokens).
  Returns:
    Output(tokens, texts, stats). tokens end with the stop token when a row produced one; texts leave it out.
    stats holds counts, `compile_seconds` (tracing and compiling the program: the first call with a new
    shape bucket, i.e. batch size, padded prompt width and cache size; 0.0 afterwards), `seconds` (the rest
    of the call: placing inputs, decoding, fetching the results) and `tokens_per_second`
    (new_tokens / seconds, so compilation is not in it).
  """
  sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  if stop_ids is None:
    stop_ids = model.tokenizer.stop_ids if model.tokenizer else ()
  stop_ids = tuple(sorted(int(t) for t in stop_ids))
  if drafter is not None:
    return speculative.generate(model, prompts, drafter=drafter, gamma=gamma, sampling=sampling,
                                max_new_tokens=max_new_tokens, seed=seed, mesh=mesh, max_len=max_len,
                                stop_ids=stop_ids, adaptive=adaptive)
  batch = prepare_batch(model, prompts, max_new_tokens, max_len=max_len)
  start = time.perf_counter()
  params, prompt_tokens, lengths, cache_sharding = place_on_mesh(model, batch, mesh)
  (tokens, num_generated, steps), compile_seconds = _autoregressive_program(
      params, prompt_tokens, lengths, jax.random.PRNGKey(seed),
      describe=f"{describe_shapes(batch)}, up to {max_new_tokens} new tokens",
      config=model.config, sampling=sampling, max_new_tokens=int(max_new_tokens), cache_len=batch.cache_len,
      stop_ids=stop_ids, cache_sharding=cache_sharding)
  tokens, num_generated, steps = distributed.to_host((tokens, num_generated, steps))  # also multi-process arrays
  seconds = time.perf_counter() - start - compile_seconds
  rows, texts = decode_outputs(model, tokens, num_generated, stop_ids)
  new_tokens = int(num_generated.sum())
  stats = {"rounds": int(steps), "target_calls": int(steps) + 1, "draft_calls": 0,
           "new_tokens": new_tokens, "new_tokens_per_row": num_generated.tolist(),
           "mean_accepted": 1.0, "compile_seconds": compile_seconds, "seconds": seconds,
           "tokens_per_second": new_tokens / seconds}
  return Output(tokens=rows, texts=texts, stats=stats)


def logits(model: Model, token_ids: Sequence[int]) -> jax.Array:
  """Logits [T, vocab] (float32) of the model over one sequence."""
  token_ids = [int(t) for t in token_ids]
  if not token_ids:
    raise ValueError("token_ids is empty")
  if len(token_ids) > model.config.max_position_embeddings:
    raise ValueError(f"{len(token_ids)} tokens exceed the context length {model.config.max_position_embeddings}")
  check_ids(token_ids, model.config.vocab_size, "token_ids")
  return _logits(model.params, jnp.asarray([token_ids], jnp.int32), config=model.config)[0]


@functools.partial(jax.jit, static_argnames=("config",))
def _logits(params, ids, *, config):
  cache = init_cache(config, ids.shape[0], ids.shape[1])
  return forward(params, ids, cache, jnp.zeros(ids.shape[0], jnp.int32), config).logits
