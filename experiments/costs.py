r"""What a draft step and a verification cost, measured inside compiled loops in the same run as the decoding.

Per method (drafter and gamma), in units of one autoregressive target step (a 1-token forward, t_1):

  c = t_draft / gamma / t_1     t_draft: one `propose` call for gamma tokens (layer skip: gamma forwards through
                                its layers + LM head; MTP heads: gamma heads; prompt lookup: the n-gram search)
  r = t_verify / t_1            t_verify: one target forward over gamma + 1 tokens

and Leviathan et al.'s (2023) prediction from the measured alpha (`specjax.leviathan`):

  predicted speedup = (1 - alpha^(gamma+1)) / (1 - alpha) / (gamma c + r).

Each is timed as the decode loop runs it: a standalone jit call of one forward costs ~20 ms more on XLA:CPU
(per-call work a loop hoists), which would distort c and r. So every cost is a `fori_loop` of `calls`
iterations, and seconds per iteration = (t(long loop) - t(short loop)) / (long - short): the fixed per-call
overhead cancels. The costs are interleaved (one long/short pair of every cost in turn, `repeats` rounds, the
median per cost), so a drift of the shared machine hits them alike; the cache holds a real context (the prompt
of median length and half of its autoregressive answer) in a cache of the prompts' median size, donated and
threaded through the loop as in decoding.

The same setup also gives the bytes each step moves: c_bytes = a draft step's bytes over a target step's, both
XLA's counts as compiled here (`specjax.roofline`), and r_bytes = a verification's bytes over a 1-token step's, as
the analytic cost model counts them (experiments/cost_model.py `step_bytes`: the weights once, as the model stores
them, a quantized target's blocks and scales, and the cache in use, ~1); the memory bandwidth of the device
(`measure_read_bandwidth`, `measure_copy_bandwidth`), against which the 1-token step's bytes over its time give its
roofline fraction; and its compute rate on a prefill-scale product (`measure_flop_rate`), which with the bandwidth
is what the cost model times a program with.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments import cost_model
from specjax import roofline
from specjax.decoding import decode_draft_params, decode_params
from specjax.drafters import DraftInputs, Drafter, PromptInfo, RoundResult
from specjax.model import forward, init_cache
from specjax.sampling import SamplingParams


@functools.partial(jax.jit, static_argnames=("config",), donate_argnums=(1,))
def _target_loop(params, cache, tokens, position, calls, *, config):
  def body(i, carry):
    tokens, cache = carry
    out = forward(params, tokens, cache, position, config)
    return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache  # a dependency between iterations
  return jax.lax.fori_loop(0, calls, body, (tokens, cache))


@functools.partial(jax.jit, static_argnames=("drafter", "gamma", "sampling", "hidden_size", "dtype"),
                   donate_argnums=(2, 3))
def _propose_loop(target_params, params, state, target_cache, sequence, position, key, calls, *, drafter, gamma,
                  sampling, hidden_size, dtype):
  rows = jnp.arange(sequence.shape[0])

  def body(i, carry):
    state, cache, sequence = carry
    inputs = DraftInputs(sequence=sequence, position=position, target_cache=cache, key=key)
    proposal = drafter.propose(target_params, params, drafter.options, state, inputs, gamma, sampling)
    # The round's `update`, on hidden states that depend on the proposal: a drafter that drafts from its state
    # alone (MTP heads) would otherwise propose the same tokens every iteration, and XLA would hoist the call.
    hidden = jnp.zeros((rows.size, gamma + 1, hidden_size), dtype) + proposal.tokens[:, :1, None].astype(dtype) * 0.0
    features = (jnp.broadcast_to(hidden[:, :, None], (rows.size, gamma + 1, len(drafter.feature_layers), hidden_size))
                if drafter.feature_layers else None)
    sequence = sequence.at[rows, position].set(proposal.tokens[:, -1])
    result = RoundResult(sequence=sequence, position=position, accepted=jnp.zeros_like(position),
                         verify_hidden=hidden, features=features, verify_position=position,
                         drafted=True)
    state = drafter.update(target_params, params, drafter.options, proposal.state, result)
    return state, proposal.target_cache, sequence
  return jax.lax.fori_loop(0, calls, body, (state, target_cache, sequence))


@functools.partial(jax.jit, static_argnames=("drafter",))
def _draft_init(target_params, params, prompt, *, drafter):
  return drafter.init(target_params, params, drafter.options, prompt)


def timed(run: Callable[[int], Any], calls: int) -> float:
  """Wall seconds of `run(calls)` until its result (a pytree) is ready; the first call includes its compile."""
  start = time.perf_counter()
  jax.block_until_ready(run(calls))
  return time.perf_counter() - start


def interleaved_seconds(runs: dict[str, Callable[[int], Any]], repeats: int, short: int = 2,
                        long: int = 8, min_seconds: float = 0.05, max_calls: int = 4096) -> dict[str, float]:
  """Seconds per loop iteration of each `run(calls)` (a pytree to wait for), median over `repeats` rounds.

  Every run is compiled and warmed first, and its long loop lengthened (doubling from `long`, at most `max_calls`)
  until it takes `min_seconds`, so that the difference a round measures stands clear of timer and scheduler noise
  even for steps of microseconds (a tiny model, prompt lookup's search); `calls` is traced, so no length compiles
  anew. Then each round times a long and a short loop of every run in turn. A run whose median difference is not
  positive (noise from other processes larger than its loop's time) is measured again with its long loop doubled,
  until it is or the loop reaches `max_calls`.
  """
  lengths = {}
  for name, run in runs.items():
    timed(run, short)
    calls = long
    while timed(run, calls) < min_seconds and calls < max_calls:
      calls *= 2
    lengths[name] = calls

  def median_step(names):
    deltas: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
      for name in names:
        deltas[name].append((timed(runs[name], lengths[name]) - timed(runs[name], short)) / (lengths[name] - short))
    return {name: statistics.median(d) for name, d in deltas.items()}

  seconds = median_step(list(runs))
  while again := [name for name, s in seconds.items() if s <= 0 and lengths[name] < max_calls]:
    lengths.update({name: min(2 * lengths[name], max_calls) for name in again})
    seconds.update(median_step(again))
  return seconds


_sum = jax.jit(lambda x: jnp.sum(jnp.sum(x.reshape(256, -1), axis=1)))


def measure_read_bandwidth(megabytes: int = 512, repeats: int = 7) -> float:
  """Median bytes/s read by a jitted sum over a `megabytes` float32 array on JAX's default device (XLA splits the
  array's rows over the cores it uses). A decode step's bytes over this is its roofline fraction.

  On the 2-core CPU of README's benchmarks this gives 26-31 GB/s, where `measure_copy_bandwidth`'s in-place pass
  gives 31-39 GB/s counting its reads and writes, and one numpy copy on one thread 21 GB/s."""
  x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
  jax.block_until_ready(_sum(x))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(_sum(x))
    times.append(time.perf_counter() - start)
  return x.nbytes / float(np.median(times))


_plus_one = jax.jit(lambda x: x + 1.0, donate_argnums=0)


def measure_copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
  """Median bandwidth (bytes/s, read + write counted) of a jitted in-place pass `x + 1` over a `megabytes` float32
  array on JAX's default device: the accelerator's own memory on a GPU/TPU, what its decode steps read from.

  `benchmarks/bench_costs.py` divides by it (its accelerator figures were measured so); decode roofline fractions
  divide by `measure_read_bandwidth`. The input is donated, so no call allocates (and first touches) a fresh
  output."""
  x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
  x = jax.block_until_ready(_plus_one(x))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    x = jax.block_until_ready(_plus_one(x))
    times.append(time.perf_counter() - start)
  return 2 * x.nbytes / float(np.median(times))


_product = jax.jit(lambda a, b: a @ b)

FLOP_SHAPE = (2048, 576, 1536)  # (M, K, N): a prefill-scale product of SmolLM2's (2048 tokens through an MLP matrix)


def measure_flop_rate(shape: Sequence[int] = FLOP_SHAPE, repeats: int = 7) -> float:
  """Median FLOP/s of a jitted float32 product [M, K] @ [K, N] (2 M K N flops) on JAX's default device: the peak
  compute rate the cost model (experiments/cost_model.py) times a program's arithmetic with, as the read bandwidth
  times its bytes."""
  m, k, n = shape
  a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
  jax.block_until_ready(_product(a, b))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(_product(a, b))
    times.append(time.perf_counter() - start)
  return 2 * m * k * n / float(np.median(times))


def prefilled_cache(model, context: Sequence[int], cache_len: int, rows: int = 1):
  """A target KV cache of `cache_len` positions holding `context` in each of `rows` rows."""
  prompt = jnp.asarray([list(context)] * rows, jnp.int32)
  return _target_loop(decode_params(model), init_cache(model.config, rows, cache_len), prompt,
                      jnp.zeros(rows, jnp.int32), 1, config=model.config)[1]


def forward_run(model, context: Sequence[int], cache_len: int, *, tokens: int = 1, rows: int = 1
                ) -> Callable[[int], Any]:
  """`run(calls)` for `interleaved_seconds`: `calls` target forwards over `tokens` new tokens in each of `rows` rows,
  written at position len(context) of a cache prefilled with `context` (donated and threaded through the loop, as
  in decoding)."""
  cache = {"cache": prefilled_cache(model, context, cache_len, rows)}
  new = jnp.full((rows, tokens), context[-1], jnp.int32)
  position = jnp.full((rows,), len(context), jnp.int32)

  def run(calls):
    out, cache["cache"] = _target_loop(decode_params(model), cache["cache"], new, position, calls,
                                       config=model.config)
    return out
  return run


def measure(model, methods: Sequence[tuple[str, Drafter, int]], context: Sequence[int], cache_len: int, *,
            rows: int = 1, repeats: int = 5, sampling: SamplingParams = SamplingParams(),
            count_bytes: bool = True) -> dict[str, Any]:
  """Costs of every (name, drafter, gamma) in `methods` (the module docstring), for `rows` copies of `context`.

  Returns {"context_tokens", "cache_len", "rows", "target_seconds": {tokens: s}, "draft_seconds": {name: s},
  "methods": {name: {"gamma", "draft_cost", "verify_cost"[, "draft_cost_bytes", "verify_cost_bytes"]}}} and,
  with `count_bytes`, "target_step_bytes" (`cost_model.step_bytes` of the weights as `model.params` stores them),
  "target_step_bytes_xla", "draft_step_bytes" {name: B}, "read_bandwidth" (bytes/s, `measure_read_bandwidth` over
  "read_megabytes"), "roofline_fraction": the 1-token target step's bytes / its time / that bandwidth, and
  "flop_rate" (FLOP/s, `measure_flop_rate` of a float32 product of "flop_shape"). Target and draft steps run on the
  weights as generate's loop reads them (`specjax.decoding.decode_params`, `decode_draft_params`).
  """
  config, params = model.config, model.params
  decoded = decode_params(model)  # the weights as generate's loop reads them
  position = len(context)
  if position + max([g for _, _, g in methods] or [0]) + 2 > cache_len:
    raise ValueError(f"a cost context of {position} tokens does not fit a cache of {cache_len} positions")
  sequence = np.zeros((rows, cache_len), np.int32)
  sequence[:, :position + 1] = list(context) + [context[-1]]  # the pending token at `position`
  positions = jnp.full((rows,), position, jnp.int32)
  sequence, key = jnp.asarray(sequence), jax.random.PRNGKey(0)
  prompt_tokens = jnp.asarray([list(context)] * rows, jnp.int32)
  state = {"cache": prefilled_cache(model, context, cache_len, rows)}

  def prompt_info(drafter: Drafter) -> PromptInfo:
    features = (jnp.zeros((rows, position, len(drafter.feature_layers), config.hidden_size), jnp.dtype(config.dtype))
                if drafter.feature_layers else None)
    return PromptInfo(tokens=prompt_tokens, lengths=jnp.full((rows,), position, jnp.int32),
                      first_token=jnp.full((rows,), context[-1], jnp.int32),
                      last_hidden=jnp.zeros((rows, config.hidden_size), jnp.dtype(config.dtype)), features=features,
                      cache_len=cache_len)

  draft_states: dict[str, Any] = {}

  def draft_run(name: str, drafter: Drafter, gamma: int):
    static, draft_params = drafter.static(), decode_draft_params(drafter)
    draft_states[name] = _draft_init(decoded, draft_params, prompt_info(drafter), drafter=static)

    def run(calls):
      draft_states[name], state["cache"], _ = _propose_loop(
          decoded, draft_params, draft_states[name], state["cache"], sequence, positions, key, calls, drafter=static,
          gamma=gamma, sampling=sampling, hidden_size=config.hidden_size, dtype=config.dtype)
      return state["cache"]
    return run

  gammas = sorted({g for _, _, g in methods})
  runs = {"target 1": forward_run(model, context, cache_len, rows=rows)}
  runs.update({f"target {g + 1}": forward_run(model, context, cache_len, tokens=g + 1, rows=rows) for g in gammas})
  runs.update({f"draft {name}": draft_run(name, drafter, gamma) for name, drafter, gamma in methods})
  seconds = interleaved_seconds(runs, repeats)
  t_1 = seconds["target 1"]
  costs: dict[str, Any] = {
      "context_tokens": position, "cache_len": cache_len, "rows": rows, "repeats": repeats,
      "target_seconds": {1: t_1, **{g + 1: seconds[f"target {g + 1}"] for g in gammas}},
      "draft_seconds": {name: seconds[f"draft {name}"] for name, _, _ in methods},
      "methods": {name: {"gamma": gamma, "draft_cost": seconds[f"draft {name}"] / gamma / t_1,
                         "verify_cost": seconds[f"target {gamma + 1}"] / t_1}
                  for name, _, gamma in methods}}
  if count_bytes:
    # The weights' bytes as the model stores them: a quantized target's blocks and scales, not float32's.
    costs["target_step_bytes"] = cost_model.step_bytes(config, position, rows, params=params)
    # The roofline of autoregressive decoding: the 1-token step's bytes at the read bandwidth measured now.
    costs["read_megabytes"] = 512 if jax.default_backend() == "cpu" else 2048
    costs["read_bandwidth"] = measure_read_bandwidth(costs["read_megabytes"])
    costs["roofline_fraction"] = costs["target_step_bytes"] / t_1 / costs["read_bandwidth"]
    costs["flop_shape"] = list(FLOP_SHAPE)
    costs["flop_rate"] = measure_flop_rate(FLOP_SHAPE)
    costs["target_step_bytes_xla"] = roofline.target_step_bytes_xla(params, state["cache"], config, positions)
    costs["draft_step_bytes"] = {}
    for name, drafter, gamma in methods:
      inputs = DraftInputs(sequence=sequence, position=positions, target_cache=state["cache"], key=key)
      step = roofline.draft_step_bytes(drafter, params, draft_states[name], inputs, sampling)
      costs["draft_step_bytes"][name] = step
      costs["methods"][name].update(
          draft_cost_bytes=step / costs["target_step_bytes_xla"],
          verify_cost_bytes=cost_model.step_bytes(config, position, rows, gamma + 1, params=params)
          / costs["target_step_bytes"])
  return costs
