"""`generate`: batched autoregressive or speculative decoding, each one jit-compiled program.

The host only encodes prompts, pads them into a shape bucket and decodes the result; prefill and every
decode step run inside one compiled `jax.lax.while_loop` (no host sync per token).

`generate_recorded` runs the same autoregressive program and also keeps what the target computes on the way
at every position of a row, prompt and answer: the residual stream after chosen layers and its top-K next-token
probabilities. That is a drafter's training data for the target's own answers (EAGLE's choice) without a second
forward over the finished text.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import compilation, distributed, sharding, speculative
from specjax.adaptive import Policy
from specjax.decoding import (Output, check_ids, decode_outputs, describe_shapes, is_stop, place_on_mesh, prefill,
                              prepare_batch)
from specjax.loading import Model
from specjax.model import ForwardOutput, KVCache, forward, init_cache, lm_head
from specjax.sampling import SamplingParams, sample, top_k_probabilities
from specjax.stats import summarize_autoregressive


@dataclasses.dataclass(frozen=True)
class RecordSpec:
  """What the decode loop keeps at every position 0..length-1 of a row (a static argument of the program)."""
  feature_layers: tuple[int, ...]  # 0-based layers whose output residual stream is kept, in this order
  top_k: int  # the target's most likely next tokens kept per position
  length: int  # positions kept per row; later ones are dropped
  dtype: str  # of the kept features


@struct.dataclass
class Recording:
  """The target's computation at each position of each row (see `RecordSpec`); positions past a row's last
  token hold leftovers of the batch's padding."""
  features: jax.Array  # [B, length, F, D] residual stream after each feature layer
  top_ids: jax.Array  # [B, length, K] int32, most likely first
  top_probs: jax.Array  # [B, length, K] float32, softmax of the logits at temperature 1

  @classmethod
  def empty(cls, batch: int, hidden_size: int, record: RecordSpec) -> Recording:
    return cls(features=jnp.zeros((batch, record.length, len(record.feature_layers), hidden_size), record.dtype),
               top_ids=jnp.zeros((batch, record.length, record.top_k), jnp.int32),
               top_probs=jnp.zeros((batch, record.length, record.top_k), jnp.float32))

  def kept(self, out: ForwardOutput, top: tuple[jax.Array, jax.Array], positions: jax.Array,
           record: RecordSpec) -> Recording:
    """With `out`, a forward over tokens [B, T] at `positions` [B, T] (its layer_hidden returned), and `top`, the
    `top_k_probabilities` of its logits, written in; positions past `record.length` are dropped."""
    features = jnp.stack([out.layer_hidden[i] for i in record.feature_layers], axis=2).astype(record.dtype)
    top_probs, top_ids = top
    rows = jnp.arange(positions.shape[0])[:, None]
    return Recording(features=self.features.at[rows, positions].set(features, mode="drop"),
                     top_ids=self.top_ids.at[rows, positions].set(top_ids, mode="drop"),
                     top_probs=self.top_probs.at[rows, positions].set(top_probs, mode="drop"))


def next_token_top_k(params, config, hidden: jax.Array, k: int, positions_per_chunk: int = 16):
  """`top_k_probabilities` of the logits of hidden [B, T, D] (before the final norm), in chunks of
  `positions_per_chunk` positions: the logits of a whole prompt batch ([B, T, V] float32) would take a GB."""
  batch, length, width = hidden.shape
  if length <= positions_per_chunk or length % positions_per_chunk:
    return top_k_probabilities(lm_head(params, hidden, config), k)
  chunks = hidden.reshape(batch, length // positions_per_chunk, positions_per_chunk, width).swapaxes(0, 1)
  probs, ids = jax.lax.map(lambda h: top_k_probabilities(lm_head(params, h, config), k), chunks)
  return probs.swapaxes(0, 1).reshape(batch, length, k), ids.swapaxes(0, 1).reshape(batch, length, k)


@struct.dataclass
class DecodeState:
  tokens: jax.Array  # [B, max_new_tokens] generated ids (-1 = none yet)
  num_generated: jax.Array  # [B]
  positions: jax.Array  # [B] position of the last generated token (its K/V is not cached yet)
  done: jax.Array  # [B]
  settled: jax.Array  # [B] done, and the last token has run through the target too
  cache: KVCache
  key: jax.Array
  steps: jax.Array  # scalar: decode forwards run
  recording: Recording | None


@functools.partial(jax.jit, static_argnames=("config", "sampling", "max_new_tokens", "cache_len", "stop_ids",
                                             "cache_sharding", "record"))
def _generate_autoregressive(params, prompt_tokens, lengths, key, limits=None, *, config, sampling, max_new_tokens,
                             cache_len, stop_ids, cache_sharding=None, record: RecordSpec | None = None):
  """Decodes rows until each reaches a stop token or its limit of new tokens (`limits` [B], at most
  max_new_tokens; default max_new_tokens). With `record`, also returns the `Recording` of every position, the
  last token's included: the loop then runs one step more, feeding each finished row's last token once."""
  batch, width = prompt_tokens.shape
  rows = jnp.arange(batch)
  limits = jnp.full(batch, max_new_tokens, jnp.int32) if limits is None else limits
  cache = sharding.constrain_cache(init_cache(config, batch, cache_len), cache_sharding)
  logits, _, out = prefill(params, config, prompt_tokens, lengths, cache, return_layer_hidden=record is not None)
  recording = None
  if record is not None:
    # The prompt's positions, padding included: the decode steps overwrite a row's positions from its length on.
    recording = Recording.empty(batch, config.hidden_size, record).kept(
        out, next_token_top_k(params, config, out.hidden, record.top_k),
        jnp.broadcast_to(jnp.arange(width), (batch, width)), record)
  key, sub = jax.random.split(key)
  first = sample(sub, logits, sampling)
  done = is_stop(first, stop_ids) | (limits <= 1)
  state = DecodeState(
      tokens=jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first),
      num_generated=jnp.ones(batch, jnp.int32),
      positions=lengths,
      done=done, settled=jnp.zeros(batch, bool),
      cache=sharding.constrain_cache(out.cache, cache_sharding), key=key, steps=jnp.zeros((), jnp.int32),
      recording=recording)

  def cond(s: DecodeState):
    return ~jnp.all(s.done if record is None else s.settled)

  def body(s: DecodeState):
    last = s.tokens[rows, s.num_generated - 1]
    out = forward(params, last[:, None], s.cache, s.positions, config, return_layer_hidden=record is not None)
    key, sub = jax.random.split(s.key)
    nxt = sample(sub, out.logits[:, 0], sampling)
    live = ~s.done
    index = jnp.where(live, s.num_generated, max_new_tokens)  # out of bounds -> dropped
    num_generated = s.num_generated + live
    # A finished row runs its last token again at the same position: the same values are written again.
    recording = None if record is None else s.recording.kept(
        out, top_k_probabilities(out.logits, record.top_k), s.positions[:, None], record)
    return DecodeState(
        tokens=s.tokens.at[rows, index].set(nxt, mode="drop"),
        num_generated=num_generated,
        positions=s.positions + live,
        done=s.done | (live & (is_stop(nxt, stop_ids) | (num_generated >= limits))),
        settled=s.done,
        cache=sharding.constrain_cache(out.cache, cache_sharding), key=key, steps=s.steps + 1,
        recording=recording)

  state = jax.lax.while_loop(cond, body, state)
  return state.tokens, state.num_generated, state.steps, state.recording


_autoregressive_program = compilation.Program(_generate_autoregressive, "autoregressive decoding")


def generate(model: Model, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             drafter=None, gamma: int = 4, adaptive: bool | Policy = True, tree_nodes: int | None = None, mesh=None,
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
      forward_costs=, prior_alpha=, memory=, plain_memory=, optimism=)` sets its options (forward_costs None: the
      target's forward costs measured for this model, dtype, batch and host at the first call, then cached;
      specjax/calibration.py). False:
      `specjax.FixedGamma()`, gamma tokens every round. Lossless either way.
    tree_nodes: N lets a round draft a tree of N nodes, gamma deep, verified in one target forward (specjax/trees.py;
      drafters that draft trees: mtp_parallel, mtp_sequential): every round with adaptive=False; with adaptive
      drafting, the rounds where a tree pays more than a chain or a plain step. None: chains of up to gamma tokens.
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
    (new_tokens / seconds, so compilation is not in it); with adaptive drafting, `forward_costs` (the points of
    f(n) the plan read), `forward_costs_source` ("calibrated", "cached" or "typed table") and
    `forward_costs_seconds` (measuring them in this call, compiling included; 0.0 otherwise).
  """
  sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  if tree_nodes is not None and drafter is None:
    raise ValueError("tree_nodes drafts trees for a drafter: pass drafter= too")
  if stop_ids is None:
    stop_ids = model.tokenizer.stop_ids if model.tokenizer else ()
  stop_ids = tuple(sorted(int(t) for t in stop_ids))
  if drafter is not None:
    return speculative.generate(model, prompts, drafter=drafter, gamma=gamma, sampling=sampling,
                                max_new_tokens=max_new_tokens, seed=seed, mesh=mesh, max_len=max_len,
                                stop_ids=stop_ids, adaptive=adaptive, tree_nodes=tree_nodes)
  batch = prepare_batch(model, prompts, max_new_tokens, max_len=max_len)
  start = time.perf_counter()
  params, prompt_tokens, lengths, cache_sharding = place_on_mesh(model, batch, mesh)
  (tokens, num_generated, steps, _), compile_seconds = _autoregressive_program(
      params, prompt_tokens, lengths, jax.random.PRNGKey(seed),
      describe=f"{describe_shapes(batch)}, up to {max_new_tokens} new tokens",
      config=model.config, sampling=sampling, max_new_tokens=int(max_new_tokens), cache_len=batch.cache_len,
      stop_ids=stop_ids, cache_sharding=cache_sharding)
  tokens, num_generated, steps = distributed.to_host((tokens, num_generated, steps))  # also multi-process arrays
  seconds = time.perf_counter() - start - compile_seconds
  rows, texts = decode_outputs(model, tokens, num_generated, stop_ids)
  stats = summarize_autoregressive(steps, num_generated, seconds, compile_seconds=compile_seconds)
  return Output(tokens=rows, texts=texts, stats=stats)


@dataclasses.dataclass
class Recorded:
  """Rows of prompt then answer, and what the target computed at each of their positions (`Recording`), as host
  arrays of `record.length` positions per row, zeros past a row's end."""
  tokens: np.ndarray  # [B, length] int32
  lengths: np.ndarray  # [B] int32: prompt and answer
  prompt_lengths: np.ndarray  # [B] int32
  features: np.ndarray  # [B, length, F, D] record.dtype
  top_ids: np.ndarray  # [B, length, K] int32
  top_probs: np.ndarray  # [B, length, K] float32
  stats: dict  # steps (decode forwards), new_tokens, compile_seconds, seconds


def generate_recorded(model: Model, prompts: Sequence[Sequence[int]], record: RecordSpec, *,
                      temperature: float = 0.0, key: jax.Array | None = None,
                      stop_ids: Sequence[int] | None = None) -> Recorded:
  """Answers each prompt (token ids) with up to what fits in `record.length` positions, and keeps the target's
  features and top-K next-token probabilities at every position, prompt and answer, the last token's included.

  One autoregressive program, as `generate` runs it (greedy at temperature 0, else sampled from the target's
  softmax at `temperature` with PRNG `key`, default PRNGKey(0)); the recording adds the prompt's next-token
  top-K, one top-K per decode step and one more step for the last tokens, not a second forward over the rows.
  """
  sampling = SamplingParams(temperature=temperature)
  if stop_ids is None:
    stop_ids = model.tokenizer.stop_ids if model.tokenizer else ()
  stop_ids = tuple(sorted(int(t) for t in stop_ids))
  if record.length > model.config.max_position_embeddings:
    raise ValueError(f"record.length {record.length} exceeds the context length {model.config.max_position_embeddings}")
  bad = [i for i, p in enumerate(prompts) if len(p) >= record.length]
  if bad:
    raise ValueError(f"prompts {bad[:5]} leave no room for an answer in record.length {record.length} positions")
  # Each row ends at position record.length - 1 at the latest, so the cache needs record.length positions.
  batch = prepare_batch(model, prompts, record.length - max(len(p) for p in prompts))
  # Prompts padded to a multiple of 16, not to a power of two: a compile per width is seconds, and a long
  # regeneration would otherwise prefill up to twice its prompts.
  batch = dataclasses.replace(batch, tokens=batch.tokens[:, :-(-int(batch.lengths.max()) // 16) * 16])
  start = time.perf_counter()
  params, prompt_tokens, lengths, _ = place_on_mesh(model, batch, None)
  limits = jnp.asarray(record.length - batch.lengths, jnp.int32)
  (tokens, num_generated, steps, recording), compile_seconds = _autoregressive_program(
      params, prompt_tokens, lengths, jax.random.PRNGKey(0) if key is None else key, limits,
      describe=f"{describe_shapes(batch)}, recording {record}",
      config=model.config, sampling=sampling, max_new_tokens=record.length, cache_len=batch.cache_len,
      stop_ids=stop_ids, record=record)
  tokens, num_generated, steps, recording = jax.device_get((tokens, num_generated, steps, recording))
  seconds = time.perf_counter() - start - compile_seconds
  rows = np.zeros((len(prompts), record.length), np.int32)
  for i, n in enumerate(num_generated):
    rows[i, :batch.lengths[i]] = batch.tokens[i, :batch.lengths[i]]
    rows[i, batch.lengths[i]:batch.lengths[i] + n] = tokens[i, :n]
  row_lengths = (batch.lengths + num_generated).astype(np.int32)
  valid = np.arange(record.length)[None, :] < row_lengths[:, None]
  return Recorded(
      tokens=rows, lengths=row_lengths, prompt_lengths=batch.lengths,
      features=np.where(valid[:, :, None, None], recording.features, 0).astype(record.dtype),
      top_ids=np.where(valid[:, :, None], recording.top_ids, 0), top_probs=np.where(valid[:, :, None],
                                                                                    recording.top_probs, 0),
      stats={"steps": int(steps), "new_tokens": int(num_generated.sum()), "compile_seconds": compile_seconds,
             "seconds": seconds})


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
