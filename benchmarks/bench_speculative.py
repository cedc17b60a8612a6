r"""Speculative decoding on SmolLM2-135M (fp32, greedy, batch 1) against autoregressive decoding, with costs.

  python benchmarks/bench_speculative.py [--quick] [--per_category=2] [--max_new_tokens=128]
      [--out=workdirs/bench_speculative.json] [--compilation_cache=workdirs/jax_cache]
  python benchmarks/bench_speculative.py --quick --costs_from=workdirs/bench_speculative.json  # costs only

On 2 shared CPU cores --quick (13 prompts, 64 tokens, 7 methods) takes ~20 minutes, most of it compiling a
program per method and prompt shape; --compilation_cache makes a second run skip that.

Methods: autoregressive; prompt lookup (gamma in --pl_gammas); layer-skip early exit (--exit_layers, gamma
--layer_skip_gamma); the searched skip set of --skip_set if that file exists (its own gamma; see
specjax/layer_skip_search.py); the target drafting for itself (draft_model, draft = target: every draft is
accepted, so it measures what a round costs). Prompts: the first --per_category Spec-Bench questions of
each category, chat template.

Timing: every prompt runs every method in turn (--repeats times), so a drift of the shared machine hits all
methods alike. A call that compiled (a new prompt shape) is rerun and only the rerun is timed; the first
call's extra time is reported as compile seconds. Per method: tokens/s (median over prompts) and speedup
(median over prompts of tokens/s / the autoregressive tokens/s on the same prompt).

Costs, measured in the same run inside compiled loops (as the decode loops run them; per-call overhead
cancelled by differencing a long and a short loop) on a KV cache of the prompts' median size, medians of
--cost_repeats:
  t_1     one target forward of 1 token (an autoregressive step),
  t_v     one target forward of gamma + 1 tokens (a verification),
  t_draft one call of the drafter's `propose` for gamma tokens (layer skip: gamma forwards through its
          layers + LM head; prompt lookup: the n-gram search; draft model: gamma forwards of the draft),
and the expected speedup of Leviathan et al. (2023):
  E[tokens per round] = (1 - α^(γ+1)) / (1 - α),   predicted = E / (γ·c + v),
  c = t_draft / γ / t_1,  v = t_v / t_1,
with α the measured per-token acceptance (`leviathan.alpha_from_stats`: accepted drafts over
accepted drafts + rejections). efficiency = measured speedup / predicted: below 1, the decode loop costs
more than its forwards (commit, bookkeeping, copies) or the prompts differ from the cost context.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

import specjax
from experiments import spec_bench
from specjax import compilation, layer_skip_search as lss
from specjax import leviathan
from specjax.drafters import DraftInputs, PromptInfo
from specjax.decoding import prepare_batch
from specjax.model import forward, init_cache
from specjax.sampling import SamplingParams

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model name or path for specjax.load (fp32).")
_PER_CATEGORY = flags.DEFINE_integer("per_category", 2, "First N Spec-Bench questions of each category.")
_CATEGORIES = flags.DEFINE_list("categories", [], "Spec-Bench categories (default: all 13).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per prompt (at most).")
_QUICK = flags.DEFINE_bool("quick", False, "1 question per category, 64 new tokens, fewer cost calls.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Timed calls per prompt and method.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft tokens per round of the self-draft method.")
_PL_GAMMAS = flags.DEFINE_list("pl_gammas", ["3", "5"], "Prompt-lookup gammas.")
_EXIT_LAYERS = flags.DEFINE_list("exit_layers", ["24", "28"], "Layer-skip early-exit points.")
_LAYER_SKIP_GAMMA = flags.DEFINE_integer("layer_skip_gamma", 3, "Gamma of the early-exit methods.")
_SKIP_SET = flags.DEFINE_string("skip_set", "configs/layer_skip_sets/smollm2-135m.json",
                                "Searched skip set (layer_skip_search record); skipped when the file is absent.")
_METHODS = flags.DEFINE_list("methods", [], "Run only these methods (and autoregressive).")
_COSTS_FROM = flags.DEFINE_string("costs_from", "", "Skip decoding: reuse the records of this earlier --out "
                                  "JSON (same flags) and measure only the costs.")
_COST_REPEATS = flags.DEFINE_integer("cost_repeats", 7, "Timed loop pairs per cost measurement (median).")
_OUT = flags.DEFINE_string("out", "workdirs/bench_speculative.json", "JSON results.")
_COMPILATION_CACHE = flags.DEFINE_string("compilation_cache", "", "JAX persistent compilation cache folder.")

_FLAG_HOLDERS = (_MODEL, _PER_CATEGORY, _CATEGORIES, _MAX_NEW_TOKENS, _QUICK, _REPEATS, _GAMMA, _PL_GAMMAS,
                 _EXIT_LAYERS, _LAYER_SKIP_GAMMA, _SKIP_SET, _METHODS, _COSTS_FROM, _COST_REPEATS, _OUT,
                 _COMPILATION_CACHE)


@dataclasses.dataclass(frozen=True)
class Method:
  name: str
  drafter: specjax.Drafter | None
  gamma: int


def make_methods(model: specjax.Model) -> list[Method]:
  methods = [Method("autoregressive", None, 1)]
  for g in _PL_GAMMAS.value:
    methods.append(Method(f"prompt_lookup_g{g}", specjax.make_drafter("prompt_lookup", model), int(g)))
  for k in _EXIT_LAYERS.value:
    methods.append(Method(f"layer_skip_exit{k}", specjax.make_drafter("layer_skip", model, exit_layer=int(k)),
                          _LAYER_SKIP_GAMMA.value))
  if _SKIP_SET.value and os.path.exists(_SKIP_SET.value):
    record = lss.read_skip_set(_SKIP_SET.value)
    options = lss.load_skip_set(_SKIP_SET.value, model=model)
    methods.append(Method("layer_skip_searched", specjax.make_drafter("layer_skip", model, **options),
                          int(record["gamma"])))
  methods.append(Method("self_draft", specjax.make_drafter("draft_model", model, draft=model), _GAMMA.value))
  if _METHODS.value:
    unknown = set(_METHODS.value) - {m.name for m in methods}
    if unknown:
      raise app.UsageError(f"unknown methods {sorted(unknown)}; available: {[m.name for m in methods]}")
    methods = [m for m in methods if m.drafter is None or m.name in _METHODS.value]
  return methods


# --- Costs -------------------------------------------------------------------------------------------------
# Each cost is timed inside a compiled loop, as the decode loops run it: a standalone jit call of one
# forward costs ~20 ms more on XLA:CPU (per-call work that a loop hoists), which would distort c and v.
# Per-iteration seconds = (t(long loop) - t(short loop)) / (difference in iterations), so the call's fixed
# overhead cancels.

@functools.partial(jax.jit, static_argnames=("config",), donate_argnums=(1,))
def _target_loop(params, cache, tokens, position, calls, *, config):
  def body(i, carry):
    tokens, cache = carry
    out = forward(params, tokens, cache, position, config)
    return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache  # a dependency between iterations
  return jax.lax.fori_loop(0, calls, body, (tokens, cache))


@functools.partial(jax.jit, static_argnames=("drafter", "gamma"), donate_argnums=(2, 3))
def _propose_loop(target_params, params, state, target_cache, sequence, position, key, calls, *, drafter, gamma):
  rows = jnp.arange(sequence.shape[0])

  def body(i, carry):
    state, cache, sequence = carry
    inputs = DraftInputs(sequence=sequence, position=position, target_cache=cache, key=key)
    proposal = drafter.propose(target_params, params, drafter.options, state, inputs, gamma, SamplingParams())
    # Feeding a proposed token back as the pending one keeps the loop from hoisting a constant proposal.
    return proposal.state, proposal.target_cache, sequence.at[rows, position].set(proposal.tokens[:, -1])
  return jax.lax.fori_loop(0, calls, body, (state, target_cache, sequence))


@functools.partial(jax.jit, static_argnames=("drafter",))
def _draft_init(target_params, params, prompt, *, drafter):
  return drafter.init(target_params, params, drafter.options, prompt)


def _seconds_per_iteration(run, repeats: int, short: int = 2, long: int = 10) -> float:
  """run(calls) -> a pytree to wait for (and whose donated buffers it replaces); compile not counted."""
  def timed(calls):
    start = time.perf_counter()
    jax.block_until_ready(run(calls))
    return time.perf_counter() - start
  timed(short)
  deltas = [(timed(long) - timed(short)) / (long - short) for _ in range(repeats)]
  return statistics.median(deltas)


def measure_costs(model: specjax.Model, methods: list[Method], context: list[int], cache_len: int,
                  repeats: int) -> dict:
  """Seconds of one target forward over 1 and gamma + 1 tokens, and of each drafter's propose call.

  The cache holds `context` (a real prompt + output) and the new tokens go right after it; the cache is
  donated and threaded through, as in the compiled decode loop.
  """
  config, params = model.config, model.params
  position = len(context)
  sequence = np.zeros((1, cache_len), np.int32)
  sequence[0, :position + 1] = context + [context[-1]]  # the pending token at `position`
  positions = jnp.full((1,), position, jnp.int32)
  sequence, key = jnp.asarray(sequence), jax.random.PRNGKey(0)
  state = {"cache": _target_loop(params, init_cache(config, 1, cache_len), jnp.asarray([context]),
                                 jnp.zeros(1, jnp.int32), 1, config=config)[1]}

  def target(num_tokens):
    tokens = jnp.repeat(sequence[:, position:position + 1], num_tokens, axis=1)

    def run(calls):
      out, state["cache"] = _target_loop(params, state["cache"], tokens, positions, calls, config=config)
      return out
    return _seconds_per_iteration(run, repeats)

  gammas = sorted({m.gamma for m in methods if m.drafter is not None})
  costs = {"context_tokens": position, "cache_len": cache_len, "target_seconds": {1: target(1)}}
  for g in gammas:
    costs["target_seconds"][g + 1] = target(g + 1)
  costs["draft_seconds"] = {}
  prompt = PromptInfo(tokens=jnp.asarray([context]), lengths=jnp.asarray([position], jnp.int32),
                      first_token=jnp.asarray([context[-1]], jnp.int32),
                      last_hidden=jnp.zeros((1, config.hidden_size), jnp.dtype(config.dtype)), features=None,
                      cache_len=cache_len)
  for m in methods:
    if m.drafter is None:
      continue
    static, draft_params = m.drafter.static(), m.drafter.params
    draft = {"state": _draft_init(params, draft_params, prompt, drafter=static)}

    def run(calls):
      draft["state"], state["cache"], _ = _propose_loop(params, draft_params, draft["state"], state["cache"],
                                                        sequence, positions, key, calls, drafter=static,
                                                        gamma=m.gamma)
      return state["cache"]
    costs["draft_seconds"][m.name] = _seconds_per_iteration(run, repeats)
  return costs


# --- Timed decoding ----------------------------------------------------------------------------------------

def decode(model, methods: list[Method], questions, prompts, max_new_tokens: int) -> tuple[list, dict, float]:
  """Every prompt through every method in turn; returns (records, compile seconds per method, wall seconds)."""
  def call(method, ids):
    before = compilation.count()
    start = time.perf_counter()
    out = specjax.generate(model, [ids], max_new_tokens=max_new_tokens, drafter=method.drafter,
                           gamma=method.gamma)
    return out, time.perf_counter() - start, compilation.count() - before

  compile_seconds = {m.name: 0.0 for m in methods}
  records = []
  start_all = time.perf_counter()
  for index, (q, ids) in enumerate(tqdm(list(zip(questions, prompts)), desc="prompts", unit="prompt")):
    reference = None
    for repeat in range(_REPEATS.value):
      for m in methods:
        out, seconds, compiled = call(m, ids)
        if compiled:  # time a compiled call instead; the difference is compilation
          first = seconds
          out, seconds, _ = call(m, ids)
          compile_seconds[m.name] += max(0.0, first - seconds)
        reference = out.tokens[0] if reference is None else reference
        s = out.stats
        records.append({"method": m.name, "gamma": m.gamma, "prompt": index, "question_id": q.question_id,
                        "category": q.category, "prompt_tokens": len(ids), "repeat": repeat, "seconds": seconds,
                        "new_tokens": s["new_tokens"], "tokens_per_second": s["new_tokens"] / seconds,
                        "matches_autoregressive": out.tokens[0] == reference,
                        "stats": {k: v for k, v in s.items() if k not in ("seconds", "tokens_per_second")},
                        "tokens": out.tokens[0] if m.drafter is None and repeat == 0 else None})
  return records, compile_seconds, time.perf_counter() - start_all


def main(argv):
  del argv
  if _COMPILATION_CACHE.value:
    jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE.value)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  per_category = 1 if _QUICK.value else _PER_CATEGORY.value
  max_new_tokens = 64 if _QUICK.value else _MAX_NEW_TOKENS.value
  cost_repeats = min(_COST_REPEATS.value, 5) if _QUICK.value else _COST_REPEATS.value
  load_start = os.getloadavg()
  model = specjax.load(_MODEL.value, dtype="float32")
  questions = spec_bench.select(spec_bench.load_questions(), categories=_CATEGORIES.value, per_category=per_category)
  prompts = [spec_bench.prompt_ids(q, model.tokenizer, chat=True) for q in questions]
  methods = make_methods(model)
  names = [m.name for m in methods]
  print(f"{len(prompts)} prompts x {len(methods)} methods ({', '.join(names)}), {max_new_tokens} new tokens; "
        f"load average {load_start[0]:.1f} on {os.cpu_count()} CPUs")

  if _COSTS_FROM.value:
    with open(_COSTS_FROM.value, encoding="utf-8") as fh:
      previous = json.load(fh)
    if list(previous["summary"]) != names or previous["max_new_tokens"] != max_new_tokens or [
        p["question_id"] for p in previous["prompts"]] != [q.question_id for q in questions]:
      raise app.UsageError(f"{_COSTS_FROM.value} ran other methods, prompts or max_new_tokens: pass the same flags")
    records = previous["records"]
    compile_seconds = {n: previous["summary"][n]["compile_seconds"] for n in names}
    decode_seconds = 60 * previous["decode_minutes"]
    load_start = tuple(previous["environment"]["load_average_start"])
  else:
    records, compile_seconds, decode_seconds = decode(model, methods, questions, prompts, max_new_tokens)

  # Cost context: the prompt of median length with its autoregressive output, in a cache of median size.
  lengths = [len(p) for p in prompts]
  median_index = int(np.argsort(lengths)[len(lengths) // 2])
  answer = next(r["tokens"] for r in records if r["prompt"] == median_index and r["tokens"] is not None)
  context = prompts[median_index] + answer[:max_new_tokens // 2]
  max_gamma = max(m.gamma for m in methods)
  cache_len = int(np.median([prepare_batch(model, [p], max_new_tokens, extra_positions=max_gamma + 1).cache_len
                             for p in prompts]))
  costs = measure_costs(model, methods, context, max(cache_len, len(context) + max_gamma + 2), cost_repeats)
  t_1 = costs["target_seconds"][1]

  summary = {}
  for m in methods:
    rows = [r for r in records if r["method"] == m.name]
    per_prompt = {}
    for r in rows:
      per_prompt.setdefault(r["prompt"], []).append(r["tokens_per_second"])
    rate = {p: statistics.median(v) for p, v in per_prompt.items()}
    base = {p: statistics.median([r["tokens_per_second"] for r in records
                                  if r["method"] == "autoregressive" and r["prompt"] == p]) for p in rate}
    row = {"gamma": m.gamma if m.drafter else None,
           "tokens_per_second": statistics.median(rate.values()),
           "speedup": statistics.median(rate[p] / base[p] for p in rate),
           "speedup_of_totals": (sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)) / (
               sum(r["new_tokens"] for r in records if r["method"] == "autoregressive")
               / sum(r["seconds"] for r in records if r["method"] == "autoregressive")),
           "lossless": all(r["matches_autoregressive"] for r in rows),
           "compile_seconds": compile_seconds[m.name]}
    if m.drafter is not None:
      pooled = lss.merge_stats([r["stats"] for r in rows], m.gamma)
      alpha = leviathan.alpha_from_stats(pooled, m.gamma)
      c = costs["draft_seconds"][m.name] / m.gamma / t_1
      v = costs["target_seconds"][m.gamma + 1] / t_1
      predicted = leviathan.predicted_speedup(alpha, m.gamma, c, v)
      row.update(mean_accepted=pooled["mean_accepted"], acceptance_rate=pooled["acceptance_rate"], alpha=alpha,
                 expected_tokens_per_round=leviathan.expected_tokens_per_round(alpha, m.gamma), draft_cost=c,
                 verify_cost=v, predicted_speedup=predicted, efficiency=row["speedup"] / predicted)
    else:
      row.update(mean_accepted=1.0)
    summary[m.name] = row

  load_end = os.getloadavg()
  header = (f"{'method':<22}{'γ':>3}{'tok/s':>8}{'speedup':>9}{'tok/round':>10}{'acc.rate':>9}{'α':>7}"
            f"{'c':>7}{'v':>7}{'predicted':>10}{'efficiency':>11}{'compile s':>10}{'lossless':>9}")
  lines = [header, "-" * len(header)]
  for name, r in summary.items():
    def f(key, fmt, r=r):
      return format(r[key], fmt) if r.get(key) is not None else "–"
    lines.append(f"{name:<22}{r['gamma'] or '–':>3}{r['tokens_per_second']:>8.2f}{r['speedup']:>9.3f}"
                 f"{r['mean_accepted']:>10.2f}{f('acceptance_rate', '.3f'):>9}{f('alpha', '.3f'):>7}"
                 f"{f('draft_cost', '.3f'):>7}{f('verify_cost', '.2f'):>7}{f('predicted_speedup', '.3f'):>10}"
                 f"{f('efficiency', '.2f'):>11}{r['compile_seconds']:>10.0f}{str(r['lossless']):>9}")
  table = "\n".join(lines)
  target_ms = ", ".join(f"{n} token{'s' if n > 1 else ''} {1e3 * s:.1f} ms"
                        for n, s in sorted(costs["target_seconds"].items()))
  draft_ms = ", ".join(f"{n} {1e3 * s:.1f} ms" if s >= 1e-3 else f"{n} {1e6 * s:.0f} µs"
                       for n, s in costs["draft_seconds"].items())
  print(f"\n{_MODEL.value} fp32 greedy batch 1: {len(prompts)} Spec-Bench prompts ({per_category} per category, "
        f"chat), up to {max_new_tokens} new tokens, {_REPEATS.value} timed call(s) per prompt and method, "
        f"interleaved; jax {jax.__version__}, {os.cpu_count()} CPUs, load average {load_start[0]:.1f} -> "
        f"{load_end[0]:.1f}; decoding took {decode_seconds / 60:.1f} min"
        f"{f' (records from {_COSTS_FROM.value}; costs measured now)' if _COSTS_FROM.value else ''}\n")
  print(table)
  print(f"\ncosts (median of {cost_repeats}, cache {costs['cache_len']} positions, context {costs['context_tokens']} "
        f"tokens): target forward {target_ms}; draft propose (γ tokens) {draft_ms}")
  print("speedup: median over prompts of tokens/s ÷ autoregressive tokens/s on the same prompt; tok/round: "
        "tokens per target forward;\nacc.rate: accepted / proposed drafts; α: accepted / (accepted + rejections); "
        "c, v: draft step and verification cost in AR steps;\npredicted = E(α, γ) / (γc + v) (Leviathan et al.); "
        "efficiency = speedup / predicted.")

  results = {
      "flags": {h.name: h.value for h in _FLAG_HOLDERS},
      "environment": {"jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                      "python": platform.python_version(), "load_average_start": load_start,
                      "load_average_end": load_end},
      "per_category": per_category, "max_new_tokens": max_new_tokens, "decode_minutes": decode_seconds / 60,
      "prompts": [{"question_id": q.question_id, "category": q.category, "prompt_tokens": len(p)}
                  for q, p in zip(questions, prompts)],
      "costs": {**costs, "target_seconds": {str(k): v for k, v in costs["target_seconds"].items()}},
      "summary": summary, "table": table, "records": records,
  }
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w", encoding="utf-8") as fh:
    json.dump(results, fh, indent=1)
  print(f"\nresults in {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
