r"""Searching which layers a layer-skip drafter should skip, by measured speedup (Draft & Verify style).

  python -m experiments.search_layer_skip --model=smollm2-135m --out=configs/layer_skip_sets/smollm2-135m.json \
      --prompts=4 --max_new_tokens=48 --budget=10 [--objective=measured|proxy] [--gamma=2]

Draft & Verify (Zhang et al. 2023, "Draft & Verify: Lossless Large Language Model Acceleration via
Self-Speculative Decoding") drafts with the target minus a set of skipped layers and chooses that set by
optimizing the speedup on a few calibration prompts (they use Bayesian optimization; we search greedily):

  S_0 = {};  S_{t+1} = S_t ∪ {argmax_l objective(S_t ∪ {l})}, stop when the best addition does not improve
  the objective or `budget` evaluations are spent.

Skipping nothing is not a drafter, so the first step always keeps its best single layer, even when that is
slower than autoregressive decoding: the search reports the least-bad set, with its speedup < 1, rather than
nothing. Early exit (the first k layers) is the skip set {k, ..., L-1}; `exit_layer_sweep` evaluates a list
of k as a 1-D search, and the better of the two searches is saved.

Objectives (higher is better):
  measured: speedup = tokens/s of speculative decoding with the skip set / tokens/s of autoregressive
    decoding, both timed in the same run, interleaved prompt by prompt; the candidate's compilation is
    excluded by a warm-up call; median over `repeats` interleaved rounds.
  proxy: the expected speedup of Leviathan et al. (2023), from the acceptance measured by one (untimed)
    speculative run and a cost model instead of a clock:
      E[tokens per round] = (1 - α^(γ+1)) / (1 - α),   speedup = E / (γ·c + v),
    with α the per-token acceptance (`alpha_from_stats`) and c the draft step's cost relative to one target
    step (`draft_cost`: the fraction of weights it reads, i.e. the layers it runs plus the LM head, since a
    batch-1 decode step is memory-bound), v the verification's cost (`verify_cost`, default 1, the
    memory-bound ideal). Cheap enough for tiny models and tests; blind to the loop's overhead.

Every candidate skip set is a new drafter, hence a new compiled program (tens of seconds for SmolLM2 on a
2-core CPU): keep `budget` modest. Candidate layers are tried least-influential first (ShortGPT's Block
Influence, Men et al. 2024: 1 - cos(layer input, layer output), averaged over the calibration tokens), so a
budget that ends mid-step has tried the likeliest layers.

The searched SmolLM2 sets and what they measured are in configs/layer_skip_sets/ (each record holds its
calibration, every candidate evaluated and the environment).

Deeper sets (`--method=teacher_forced`, `deep_search`): SWIFT (Xia et al. 2024, "SWIFT: On-the-Fly
Self-Speculative Decoding for LLM Inference Acceleration") and Draft & Verify skip about half of the layers,
keeping the first and last. A search that far meets hundreds of sets, so it scores them without generating:

  python -m experiments.search_layer_skip --method=teacher_forced --model=smollm2-135m \
      --out=configs/layer_skip_sets/smollm2-135m-deep.json --sequences=16 --gamma=3 [--verify_cost=1.35] \
      [--candidate_pool=14]

The target runs once over ShareGPT training sequences (`training_sequences`; never Spec-Bench); each set is
then one teacher-forced draft pass through a single compiled program (`teacher_forced_objective`: α is the
draft's agreement with the target's next token as it drafts a round's first token), scored by the speedup
model above; `greedy_path_search` adds the best layer at every step up to `max_skip_fraction` of the layers
and keeps the best set met on the way (`candidate_pool`: over the n least influential layers only, about n^2 / 2
sets). On SmolLM2-135M (pool 14, γ 3, 105 sets, 25 min) agreement fell 3-4 points per skipped layer while the
draft cost fell 3, so the best set skips one layer and no deeper set pays. Whole layers only: skipping attention
and MLP sublayers apart (Draft & Verify) would need the model's forward to take sublayer sets.

The result is a JSON record (`save_skip_set`, written atomically) that `specjax.drafters.layer_skip.load_skip_set`
turns back into `specjax.make_drafter("layer_skip", model, **options)` keyword arguments.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import os
import statistics
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments import cli
import specjax
from specjax import ops
from specjax.data import sequences, sharegpt
from specjax.config import ModelConfig
from specjax.leviathan import alpha_from_stats, draft_cost, expected_tokens_per_round, predicted_speedup
from specjax.drafters.layer_skip import draft_layers
from specjax.model import attend, attention_output, embed, forward, init_cache, lm_head, mlp_block, qkv
from specjax.stats import merge_stats

SkipSet = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """One candidate's score. `speedup` is the objective; the rest is what it was computed from (nan: n/a)."""
  speedup: float
  acceptance_rate: float = math.nan  # accepted / proposed drafts (specjax's stat)
  alpha: float = math.nan  # per-token acceptance probability (Leviathan's α), see alpha_from_stats
  mean_accepted: float = math.nan  # tokens per target forward
  draft_cost: float = math.nan  # c: weights read by a draft step / by a target step
  tokens_per_second: float = math.nan
  baseline_tokens_per_second: float = math.nan
  compile_seconds: float = math.nan


Objective = Callable[[SkipSet], Evaluation]


@dataclasses.dataclass
class SearchResult:
  skip_layers: SkipSet
  evaluation: Evaluation
  history: list[tuple[SkipSet, Evaluation]]  # every candidate evaluated, in order
  evaluations: int
  stopped: str  # why the search ended: "no improvement", "budget", "exhausted" ("max_skip": greedy_path_search)
  path: list[tuple[SkipSet, Evaluation]] = dataclasses.field(default_factory=list)  # greedy_path_search's steps


def exit_skip_set(num_layers: int, exit_layer: int) -> SkipSet:
  """Early exit after `exit_layer` layers as a skip set."""
  return tuple(range(exit_layer, num_layers))


def drafter_options(num_layers: int, skip_layers: Sequence[int]) -> dict:
  """make_drafter options for a skip set: `exit_layer` when it is a suffix (more readable), else skip_layers."""
  skip = sorted(int(i) for i in skip_layers)
  if skip and skip == list(range(skip[0], num_layers)):
    return {"exit_layer": skip[0]}
  return {"skip_layers": skip}


# --- Search ------------------------------------------------------------------------------------------------

def _validate_skip(num_layers: int, skip: SkipSet) -> SkipSet:
  draft_layers(num_layers, skip_layers=skip)  # raises on an empty, out-of-range or full set
  return tuple(sorted(skip))


def _evaluate(objective: Objective, skip: SkipSet, history: list, on_evaluation) -> Evaluation:
  """Scores one candidate and records it (history, progress callback)."""
  evaluation = objective(skip)
  history.append((skip, evaluation))
  if on_evaluation:
    on_evaluation(skip, evaluation)
  return evaluation


def greedy_search(num_layers: int, objective: Objective, *, budget: int,
                  candidate_layers: Sequence[int] | None = None, start: Sequence[int] = (),
                  on_evaluation: Callable[[SkipSet, Evaluation], None] | None = None) -> SearchResult:
  """Greedy forward selection of the skip set that maximizes `objective(skip_layers).speedup`.

  Args:
    num_layers: layers of the target.
    objective: scores a sorted skip set; called at most `budget` times, never twice for one set.
    budget: most objective evaluations.
    candidate_layers: layers that may be skipped, in the order they are tried within a step (a budget that
      runs out mid-step has tried the first ones). Default: all, in index order.
    start: initial skip set (default empty: the first step keeps its best single layer whatever its score).
    on_evaluation: called after each evaluation (progress bars).
  """
  if budget < 1:
    raise ValueError(f"budget must be at least 1, got {budget}")
  candidates = list(range(num_layers) if candidate_layers is None else dict.fromkeys(int(l) for l in candidate_layers))
  bad = [l for l in candidates if not 0 <= l < num_layers]
  if not candidates:
    raise ValueError("no candidate layers to skip")
  if bad:
    raise ValueError(f"candidate layers {bad} are outside 0..{num_layers - 1}")
  current = tuple(sorted(set(int(l) for l in start)))
  best: tuple[SkipSet, Evaluation] | None = None
  if current:
    best = (current, objective(_validate_skip(num_layers, current)))
  history = [best] if best else []
  stopped = "exhausted"
  while True:
    # A skip set must leave at least one layer to run.
    step = [tuple(sorted(current + (l,))) for l in candidates if l not in current and len(current) + 1 < num_layers]
    if not step:
      stopped = "exhausted"
      break
    step_best, tried = None, 0
    for skip in step:
      if len(history) >= budget:
        break
      tried += 1
      evaluation = _evaluate(objective, skip, history, on_evaluation)
      if step_best is None or evaluation.speedup > step_best[1].speedup:
        step_best = (skip, evaluation)
    complete = tried == len(step)
    if step_best is None:
      stopped = "budget"
      break
    if best is not None and step_best[1].speedup <= best[1].speedup:
      stopped = "no improvement" if complete else "budget"
      break
    best = step_best
    current = step_best[0]
    if len(history) >= budget:
      stopped = "budget"
      break
  return SearchResult(skip_layers=best[0], evaluation=best[1], history=history, evaluations=len(history),
                      stopped=stopped)


def exit_layer_sweep(num_layers: int, objective: Objective, exit_layers: Sequence[int],
                     on_evaluation: Callable[[SkipSet, Evaluation], None] | None = None
                     ) -> list[tuple[int, Evaluation]]:
  """Evaluates early exit after each of `exit_layers` layers (skip set {k..L-1}); returns [(k, evaluation)]."""
  results = []
  for k in exit_layers:
    if not 1 <= k < num_layers:
      raise ValueError(f"exit layers must be in [1, {num_layers - 1}], got {k}")
    skip = exit_skip_set(num_layers, k)
    evaluation = objective(skip)
    results.append((int(k), evaluation))
    if on_evaluation:
      on_evaluation(skip, evaluation)
  return results


def memoize(objective: Objective) -> Objective:
  """Scores each skip set once (the greedy search and the exit sweep can meet the same set)."""
  return functools.lru_cache(maxsize=None)(objective)


# --- Objectives on a real model ----------------------------------------------------------------------------

def block_influence(model, prompts: Sequence[Sequence[int]]) -> np.ndarray:
  """ShortGPT's Block Influence per layer: 1 - cos(input, output) of its residual stream, mean over tokens."""
  scores = []
  for ids in prompts:
    tokens = jnp.asarray([list(ids)], jnp.int32)
    scores.append(np.asarray(_block_influence(model.params, tokens, config=model.config)))
  return np.mean(scores, axis=0)


def least_influential(influence: np.ndarray, layers: Sequence[int], n: int = 0) -> list[int]:
  """`layers` ordered least influential first (ties keep their order); the first n of them (0: all)."""
  order = sorted((int(l) for l in layers), key=lambda l: influence[l])
  return order[:n] if n else order


@functools.partial(jax.jit, static_argnames=("config",))
def _block_influence(params, tokens, *, config):
  out = forward(params, tokens, init_cache(config, 1, tokens.shape[1]), jnp.zeros(1, jnp.int32), config,
                compute_logits=False, return_layer_hidden=True)
  states = [jnp.take(params["embed"], tokens, axis=0)] + out.layer_hidden
  cos = [jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1) + 1e-6)
         for a, b in zip(states[:-1], states[1:])]
  return jnp.stack([1.0 - jnp.mean(c) for c in cos])


def _spec_stats(model, prompts, drafter, gamma, max_new_tokens) -> dict:
  return specjax.generate(model, [list(p) for p in prompts], max_new_tokens=max_new_tokens, drafter=drafter,
                          gamma=gamma, adaptive=False).stats  # the proxy's Leviathan model drafts gamma every round


def proxy_objective(model, prompts: Sequence[Sequence[int]], *, gamma: int, max_new_tokens: int,
                    verify_cost: float = 1.0) -> Objective:
  """Leviathan-model speedup from the acceptance of one greedy speculative run over all prompts (one batch).

  verify_cost: a verification forward (gamma + 1 tokens) over one autoregressive step. 1 is the memory-bound
  ideal; experiments/costs.py measures it in every experiment run (on XLA:CPU 1.34-1.54 for 3-6 tokens: small matmuls
  with more than one row take a slower kernel than matrix-vector products).
  """
  def evaluate(skip: SkipSet) -> Evaluation:
    drafter = specjax.make_drafter("layer_skip", model, skip_layers=list(skip))
    stats = _spec_stats(model, prompts, drafter, gamma, max_new_tokens)
    alpha = alpha_from_stats(stats, gamma)
    cost = draft_cost(model.params, model.config, drafter.options.layers)
    return Evaluation(speedup=predicted_speedup(alpha, gamma, cost, verify_cost),
                      acceptance_rate=stats["acceptance_rate"], alpha=alpha,
                      mean_accepted=stats["mean_accepted"], draft_cost=cost)
  return evaluate


def measured_objective(model, prompts: Sequence[Sequence[int]], *, gamma: int, max_new_tokens: int,
                       repeats: int = 2) -> Objective:
  """Measured speedup over autoregressive decoding, batch 1, greedy.

  Per candidate: one warm-up speculative call per prompt (compiles; its time is reported, not counted),
  then `repeats` rounds, each timing autoregressive and speculative decoding prompt by prompt, interleaved.
  A round's speedup is (spec tokens / spec seconds) / (AR tokens / AR seconds), summed over its prompts; the
  objective is the median over rounds. Prompts should share one shape (see `calibration_prompts`), so each
  candidate compiles once.
  """
  prompts = [list(p) for p in prompts]

  def timed(ids, drafter):
    stats = specjax.generate(model, [ids], max_new_tokens=max_new_tokens, drafter=drafter, gamma=gamma,
                             adaptive=False).stats
    return stats, stats["seconds"]

  for ids in prompts:  # compile the autoregressive program(s) once, outside every candidate's timing
    timed(ids, None)

  def evaluate(skip: SkipSet) -> Evaluation:
    drafter = specjax.make_drafter("layer_skip", model, skip_layers=list(skip))
    compile_seconds = sum(timed(ids, drafter)[0]["compile_seconds"] for ids in prompts)
    speedups, spec_rates, ar_rates, stats = [], [], [], []
    for _ in range(repeats):
      ar_tokens = ar_seconds = spec_tokens = spec_seconds = 0.0
      for ids in prompts:
        ar, seconds = timed(ids, None)
        ar_tokens, ar_seconds = ar_tokens + ar["new_tokens"], ar_seconds + seconds
        spec, seconds = timed(ids, drafter)
        spec_tokens, spec_seconds = spec_tokens + spec["new_tokens"], spec_seconds + seconds
        stats.append(spec)
      spec_rates.append(spec_tokens / spec_seconds)
      ar_rates.append(ar_tokens / ar_seconds)
      speedups.append(spec_rates[-1] / ar_rates[-1])
    merged = merge_stats(stats[:len(prompts)], gamma)  # greedy: every round decodes the same tokens
    return Evaluation(
        speedup=statistics.median(speedups), acceptance_rate=merged["acceptance_rate"],
        alpha=alpha_from_stats(merged, gamma), mean_accepted=merged["mean_accepted"],
        draft_cost=draft_cost(model.params, model.config, drafter.options.layers),
        tokens_per_second=statistics.median(spec_rates), baseline_tokens_per_second=statistics.median(ar_rates),
        compile_seconds=compile_seconds)
  return evaluate


def search(model, prompts: Sequence[Sequence[int]], *, gamma: int, max_new_tokens: int, budget: int,
           objective: str = "measured", repeats: int = 2, exit_layers: Sequence[int] = (),
           candidate_pool: int = 0, verify_cost: float = 1.0, calibration: dict | None = None,
           on_evaluation: Callable[[SkipSet, Evaluation], None] | None = None) -> dict:
  """Runs the exit-layer sweep, then the greedy search with what is left of `budget`; returns the record.

  Args:
    objective: "measured" (timed speedup) or "proxy" (Leviathan model from the measured acceptance).
    exit_layers: early-exit points to sweep first (each costs one evaluation of the budget).
    candidate_pool: try only this many least-influential layers in the greedy search (0: all).
    verify_cost: the proxy's cost of a verification in autoregressive steps (also used for
      `predicted_speedup` in the record).
    calibration: extra description of the prompts, stored in the record.
  """
  num_layers = model.config.num_layers
  if objective == "measured":
    score = memoize(measured_objective(model, prompts, gamma=gamma, max_new_tokens=max_new_tokens,
                                       repeats=repeats))
  elif objective == "proxy":
    score = memoize(proxy_objective(model, prompts, gamma=gamma, max_new_tokens=max_new_tokens,
                                    verify_cost=verify_cost))
  else:
    raise ValueError(f"objective must be 'measured' or 'proxy', got {objective!r}")
  exit_layers = list(exit_layers)
  if len(exit_layers) >= budget:
    raise ValueError(f"budget ({budget}) must exceed the number of exit layers swept ({len(exit_layers)})")
  influence = block_influence(model, prompts)
  candidates = least_influential(influence, range(len(influence)), candidate_pool)
  sweep = exit_layer_sweep(num_layers, score, exit_layers, on_evaluation)
  greedy = greedy_search(num_layers, score, budget=budget - len(sweep), candidate_layers=candidates,
                         on_evaluation=on_evaluation)
  best_skip, best = greedy.skip_layers, greedy.evaluation
  for k, evaluation in sweep:
    if evaluation.speedup > best.speedup:
      best_skip, best = exit_skip_set(num_layers, k), evaluation

  def row(skip, evaluation):
    return {"skip_layers": list(skip), **_finite(dataclasses.asdict(evaluation))}

  measured = objective == "measured"
  return {
      "drafter": "layer_skip",
      "options": drafter_options(num_layers, best_skip),
      "gamma": int(gamma),
      "objective": objective,
      "measured_speedup": best.speedup if measured else None,
      "proxy_speedup": None if measured else best.speedup,
      "predicted_speedup": predicted_speedup(best.alpha, gamma, best.draft_cost, verify_cost)
                           if math.isfinite(best.alpha) else None,
      "verify_cost": verify_cost,
      "acceptance_rate": best.acceptance_rate,
      "alpha": best.alpha,
      "mean_accepted": best.mean_accepted,
      "draft_cost": best.draft_cost,
      "tokens_per_second": _finite_or_none(best.tokens_per_second),
      "baseline_tokens_per_second": _finite_or_none(best.baseline_tokens_per_second),
      "model": model.name,
      "num_layers": num_layers,
      "calibration": {"num_prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                      "max_new_tokens": int(max_new_tokens), "repeats": int(repeats) if measured else None,
                      "batch_size": 1 if measured else len(prompts), **(calibration or {})},
      "search": {
          "budget": int(budget), "evaluations": len(sweep) + greedy.evaluations, "greedy_stopped": greedy.stopped,
          "candidate_order": candidates, "block_influence": [round(float(x), 5) for x in influence],
          "exit_layer_sweep": [{"exit_layer": k, **row(exit_skip_set(num_layers, k), e)} for k, e in sweep],
          "greedy_history": [row(skip, e) for skip, e in greedy.history],
      },
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "environment": {"jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                      "load_average": [round(x, 2) for x in os.getloadavg()]},
  }


def _finite_or_none(x):
  return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _finite(d: dict) -> dict:
  """JSON has no nan: not-applicable fields become null."""
  return {k: _finite_or_none(v) if isinstance(v, float) else v for k, v in d.items()}


# --- Deeper skip sets on training text (SWIFT, Draft & Verify) ---------------------------------------------
#
# Draft & Verify (Zhang et al. 2023) and SWIFT (Xia et al. 2024) skip about half of a model's layers (keeping
# the first and last ones, which change the residual stream most) to make drafting cheap. Scoring each of the
# hundreds of sets such a search meets by generating with it would compile a program per set; the teacher-
# forced proxy below scores any set with one compiled program, on training text.


@functools.partial(jax.jit, static_argnames=("config", "top_k"))
def _target_pass(params, tokens, *, config, top_k):
  """The target over tokens [B, T]: its K/V at every layer ([L, B, T, KV, hd] each) and top-K next tokens."""
  b, t = tokens.shape
  out = forward(params, tokens, init_cache(config, b, t), jnp.zeros(b, jnp.int32), config)
  top_logits, top_ids = jax.lax.top_k(out.logits, top_k)
  top_probs = jnp.exp(top_logits - jax.nn.logsumexp(out.logits, axis=-1, keepdims=True))
  return jnp.stack(out.cache.k), jnp.stack(out.cache.v), top_ids, top_probs


def teacher_forced_draft_logits(params, tokens, target_keys, target_values, keep, config: ModelConfig):
  """The layer-skip draft's logits [B, T, V] at every position of tokens [B, T], as it drafts a round's first token.

  At position t the draft runs the kept layers (keep [L], 1 = run, 0 = skip; traced, so every skip set shares one
  compilation) on its own residual stream and attends to the target's K/V at positions < t (what the shared
  cache holds for committed positions; target_keys/values [L, B, T, KV, hd]) and to its own K/V at t.
  """
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
  h = embed(params, tokens, config)
  for i, layer in enumerate(params["layers"]):
    window = config.window(i)
    q, k, v = qkv(layer, h, positions, config, sliding=window is not None)
    out = attend(q, target_keys[i], target_values[i], positions - 1, config, window=window, query_positions=positions,
                 extra_keys=k[:, :, None], extra_values=v[:, :, None])  # the target's K/V before t, its own at t
    x = h + attention_output(layer, out, config)
    x = x + mlp_block(layer, x, config)
    h = jnp.where(keep[i] > 0, x, h)
  return lm_head(params, h, config)


@functools.partial(jax.jit, static_argnames=("config",))
def _agreement(params, tokens, mask, target_keys, target_values, top_ids, top_probs, keep, *, config):
  """(greedy agreements, summed overlap sum_x min(p, q) over the target's top-K, positions) over masked positions."""
  logits = teacher_forced_draft_logits(params, tokens, target_keys, target_values, keep, config)
  weight = mask.astype(jnp.float32)
  greedy = (jnp.argmax(logits, axis=-1) == top_ids[..., 0]).astype(jnp.float32)
  q = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), top_ids, axis=-1)
  overlap = jnp.sum(jnp.minimum(top_probs, q), axis=-1)
  return jnp.sum(greedy * weight), jnp.sum(overlap * weight), jnp.sum(weight)


def teacher_forced_objective(model, tokens: np.ndarray, mask: np.ndarray, *, gamma: int, verify_cost: float = 1.0,
                             acceptance: str = "greedy", batch_size: int = 8, top_k: int = 32) -> Objective:
  """Leviathan-model speedup with α measured under teacher forcing on training sequences.

  tokens/mask [N, T]: sequences (right-padded) and the positions that count (answer tokens). The target runs
  once over them (its K/V and top-K next tokens are kept); each skip set S is then one draft pass:
    greedy:   α(S) = P[argmax q_S = argmax p]          (greedy decoding's acceptance of a draft)
    sampling: α(S) = E[sum_x min(p(x), q_S(x))]        (Leviathan et al.'s α; over p's top-K, a lower bound)
  with q_S the draft's next-token distribution as it drafts a round's first token (exact for that token; later
  drafts of a round read the draft's own K/V and are approximated by it, as Leviathan's i.i.d. model does), and
  speedup = E[tokens per round](α, γ) / (γ c(S) + v).
  """
  if acceptance not in ("greedy", "sampling"):
    raise ValueError(f"acceptance must be 'greedy' or 'sampling', got {acceptance!r}")
  config = model.config
  tokens, mask = np.asarray(tokens, np.int32), np.asarray(mask, bool)
  batches = []
  for first in range(0, len(tokens), batch_size):
    rows = np.zeros((batch_size, tokens.shape[1]), np.int32)  # one compiled shape: the last batch is padded
    rows_mask = np.zeros((batch_size, tokens.shape[1]), bool)
    n = min(batch_size, len(tokens) - first)
    rows[:n], rows_mask[:n] = tokens[first:first + n], mask[first:first + n]
    batch = (jnp.asarray(rows), jnp.asarray(rows_mask))
    batches.append(batch + _target_pass(model.params, batch[0], config=config, top_k=top_k))

  def evaluate(skip: SkipSet) -> Evaluation:
    keep = np.ones(config.num_layers, np.float32)
    keep[list(skip)] = 0
    greedy = overlap = count = 0.0
    for batch in batches:
      g, o, c = _agreement(model.params, *batch, jnp.asarray(keep), config=config)
      greedy, overlap, count = greedy + float(g), overlap + float(o), count + float(c)
    alpha = (greedy if acceptance == "greedy" else overlap) / max(count, 1.0)
    cost = draft_cost(model.params, config, [i for i in range(config.num_layers) if keep[i]])
    return Evaluation(speedup=predicted_speedup(alpha, gamma, cost, verify_cost), alpha=alpha,
                      mean_accepted=expected_tokens_per_round(alpha, gamma), draft_cost=cost)
  return evaluate


def greedy_path_search(num_layers: int, objective: Objective, *, candidates: Sequence[int], max_skip: int,
                       budget: int | None = None,
                       on_evaluation: Callable[[SkipSet, Evaluation], None] | None = None) -> SearchResult:
  """Greedy forward selection carried on to `max_skip` skipped layers, then the best set met on the way.

  Each step adds the candidate whose set scores best, even when that score is below the previous step's: a
  larger set's cheaper drafts can pay for a lower acceptance only once several layers are gone, which
  `greedy_search`'s stop at the first step without improvement never reaches. `path` holds every step's set.
  """
  candidates = list(dict.fromkeys(int(l) for l in candidates))
  if not candidates or min(candidates) < 0 or max(candidates) >= num_layers:
    raise ValueError(f"candidate layers must be a non-empty subset of 0..{num_layers - 1}, got {candidates}")
  if not 1 <= max_skip <= min(len(candidates), num_layers - 1):
    raise ValueError(f"max_skip must be in [1, {min(len(candidates), num_layers - 1)}], got {max_skip}")
  if budget is not None and budget < 1:
    raise ValueError(f"budget must be at least 1, got {budget}")
  current: SkipSet = ()
  history, path, stopped = [], [], "max_skip"
  while len(current) < max_skip:
    step = None
    for layer in [l for l in candidates if l not in current]:
      if budget is not None and len(history) >= budget:
        break
      skip = tuple(sorted(current + (layer,)))
      evaluation = _evaluate(objective, skip, history, on_evaluation)
      if step is None or evaluation.speedup > step[1].speedup:
        step = (skip, evaluation)
    if step is None:  # the budget ran out at a step's start
      stopped = "budget"
      break
    path.append(step)  # a step cut short by the budget still offers the best set it tried
    current = step[0]
    if budget is not None and len(history) >= budget and len(current) < max_skip:
      stopped = "budget"
      break
  best = max(path, key=lambda s: s[1].speedup)
  return SearchResult(skip_layers=best[0], evaluation=best[1], history=history, evaluations=len(history),
                      stopped=stopped, path=path)


def training_sequences(model, num_conversations: int, *, seq_len: int, held_out_fraction: float = 0.05,
                       split_seed: int = 0) -> tuple[np.ndarray, np.ndarray, dict]:
  """(tokens [N, seq_len] right-padded, mask [N, seq_len], provenance) from the first `num_conversations` of
  ShareGPT's train side (the split `configs/train_data.py` uses): calibration text the drafters' training data
  also comes from, never Spec-Bench. mask marks positions whose next token is an answer token."""
  conversations, stats = sharegpt.read_conversations()
  train, _ = sharegpt.split(conversations, held_out_fraction, split_seed)
  made = sequences.make_sequences(model, train[:num_conversations], seq_len=seq_len)
  if not made:
    raise ValueError(f"no training sequences from {num_conversations} conversations")
  tokens = np.zeros((len(made), seq_len), np.int32)
  mask = np.zeros((len(made), seq_len), bool)
  for i, s in enumerate(made):
    tokens[i, :len(s.tokens)], mask[i, :len(s.loss_mask)] = s.tokens, s.loss_mask
  source = {"source": "ShareGPT, train side of the split, the target's chat template",
            "dataset": os.path.basename(stats.path),
            "dataset_package": f"{sharegpt.DISTRIBUTION} {importlib.metadata.version(sharegpt.DISTRIBUTION)}",
            "held_out_fraction": held_out_fraction, "split_seed": split_seed, "conversations": num_conversations,
            "sequences": len(made), "seq_len": seq_len, "positions": int(mask.sum())}
  return tokens, mask, source


def deep_search(model, tokens: np.ndarray, mask: np.ndarray, *, gamma: int, max_skip_fraction: float = 0.5,
                keep_layers: Sequence[int] | None = None, acceptance: str = "greedy", verify_cost: float = 1.0,
                budget: int | None = None, candidate_pool: int = 0, batch_size: int = 8,
                calibration: dict | None = None,
                on_evaluation: Callable[[SkipSet, Evaluation], None] | None = None) -> dict:
  """A multi-layer skip set by `greedy_path_search` on the teacher-forced proxy; returns the record to save.

  Args:
    tokens, mask: calibration sequences (`training_sequences`).
    max_skip_fraction: the path goes on to this fraction of the layers skipped (SWIFT and Draft & Verify: ~0.5).
    keep_layers: never skipped (default: the first and the last).
    acceptance, verify_cost: see `teacher_forced_objective`.
    budget: most evaluations (None: the whole path, about candidates x max_skip - max_skip^2 / 2).
    candidate_pool: search only this many layers, those of least Block Influence (ShortGPT) on the calibration
      answers (0: every layer not kept); a path over a pool of n costs about n^2 / 2 evaluations.
  """
  num_layers = model.config.num_layers
  keep = {0, num_layers - 1} if keep_layers is None else {int(l) for l in keep_layers}
  candidates = [l for l in range(num_layers) if l not in keep]
  influence = None
  if candidate_pool:
    influence = block_influence(model, [row[:int(np.max(np.nonzero(m)[0])) + 2] for row, m in zip(tokens, mask)
                                        if m.any()])
    candidates = least_influential(influence, candidates, candidate_pool)
  max_skip = min(len(candidates), max(1, int(max_skip_fraction * num_layers)))
  score = memoize(teacher_forced_objective(model, tokens, mask, gamma=gamma, verify_cost=verify_cost,
                                           acceptance=acceptance, batch_size=batch_size))
  result = greedy_path_search(num_layers, score, candidates=candidates, max_skip=max_skip, budget=budget,
                              on_evaluation=on_evaluation)
  best = result.evaluation

  def row(skip, evaluation):
    return {"skip_layers": list(skip), **_finite(dataclasses.asdict(evaluation))}

  return {
      "drafter": "layer_skip",
      "options": drafter_options(num_layers, result.skip_layers),
      "gamma": int(gamma),
      "objective": f"teacher_forced_{acceptance}",
      "measured_speedup": None,
      "proxy_speedup": best.speedup,
      "predicted_speedup": best.speedup,
      "verify_cost": verify_cost,
      "alpha": best.alpha,
      "mean_accepted": best.mean_accepted,
      "draft_cost": best.draft_cost,
      "model": model.name,
      "num_layers": num_layers,
      "calibration": {"positions": int(np.sum(mask)), "sequences": len(tokens), **(calibration or {})},
      "search": {
          "method": "greedy_path", "kept_layers": sorted(keep), "candidates": candidates,
          "block_influence": None if influence is None else [round(float(x), 5) for x in influence],
          "max_skip": max_skip, "budget": budget,
          "evaluations": result.evaluations, "stopped": result.stopped,
          "path": [row(skip, e) for skip, e in result.path],
          "history": [row(skip, e) for skip, e in result.history],
      },
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "environment": {"jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                      "load_average": [round(x, 2) for x in os.getloadavg()]},
  }


# --- Saved skip sets ---------------------------------------------------------------------------------------

def save_skip_set(path: str, record: dict) -> None:
  """Writes `record` as JSON atomically (`experiments.cli.write_atomic`): a reader never sees a half-written file,
  and a failed write leaves any previous file untouched."""
  if record.get("drafter") != "layer_skip" or not isinstance(record.get("options"), dict):
    raise ValueError("a skip-set record needs drafter='layer_skip' and an options dict")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  cli.write_atomic(path, json.dumps(_finite(record), indent=2, allow_nan=False) + "\n")
