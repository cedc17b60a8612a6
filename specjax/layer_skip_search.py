r"""Searching which layers a layer-skip drafter should skip, by measured speedup (Draft & Verify style).

  python -m specjax.layer_skip_search --model=smollm2-135m --out=configs/layer_skip_sets/smollm2-135m.json \
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

On SmolLM2-135M (fp32, 2 shared CPU cores, gamma 2, budget 10) no set is faster than autoregressive
decoding: the best found, skip {12}, measured 0.80x (α 0.93) and early exit at 28 0.54x
(configs/layer_skip_sets/smollm2-135m.json). A model not trained for skipping has few redundant layers, and a
draft step that runs 29 of 30 layers costs nearly a target step.

The result is a JSON record (`save_skip_set`, written atomically) that `load_skip_set` turns back into
`specjax.make_drafter("layer_skip", model, **options)` keyword arguments.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import tempfile
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.config import ModelConfig
from specjax.drafters.layer_skip import draft_layers
from specjax.generate import prepare_batch
from specjax.model import forward, init_cache

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
  stopped: str  # why the search ended: "no improvement", "budget", "exhausted"


# --- The speedup model -------------------------------------------------------------------------------------

def expected_tokens_per_round(alpha: float, gamma: int) -> float:
  """Leviathan et al. (2023), eq. 1: E = (1 - α^(γ+1)) / (1 - α), tokens committed per target forward."""
  if alpha >= 1.0:
    return float(gamma + 1)
  return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost: float = 1.0) -> float:
  """E[tokens per round] / (γ·c + v): c, v = a draft step's and a verification's cost over one AR step."""
  return expected_tokens_per_round(alpha, gamma) / (gamma * draft_cost + verify_cost)


def alpha_from_stats(stats: dict, gamma: int) -> float:
  """Maximum-likelihood per-token acceptance α from a speculative run's stats.

  Under Leviathan's i.i.d. model each round accepts drafts with probability α until the first rejection, so
  every accepted draft is a success and every round that stopped short of γ is one failure:
  α = accepted / (accepted + rounds with a rejection) -- the engine's `alpha`, here from per-row counts so
  that runs can be pooled. This is not `acceptance_rate` (accepted / proposed), which also counts the drafts
  after a rejection, never examined: at α = 0.5, γ = 4 it is 0.23.
  """
  accepted = float(np.sum(stats["accepted_per_row"]))
  rejections = float(np.sum(stats["rejections_per_row"]))
  return accepted / (accepted + rejections) if accepted + rejections else math.nan


def _weight_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def draft_cost(params, config: ModelConfig, layers: Sequence[int]) -> float:
  """Weights read by one draft step (the layers run + final norm + LM head) over those of a full step.

  A batch-1 decode step is memory-bound, so this is its relative time to first order. With a small model
  the LM head is a large share (SmolLM2: 28 M of 135 M weights), so it exceeds the fraction of layers run.
  """
  head = params["lm_head"] if "lm_head" in params else params["embed"]
  layer_bytes = [_weight_bytes(layer) for layer in params["layers"]]
  fixed = _weight_bytes(head) + _weight_bytes(params["final_norm"])
  return (fixed + sum(layer_bytes[i] for i in layers)) / (fixed + sum(layer_bytes))


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
      evaluation = objective(skip)
      history.append((skip, evaluation))
      if on_evaluation:
        on_evaluation(skip, evaluation)
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
                          gamma=gamma).stats


def proxy_objective(model, prompts: Sequence[Sequence[int]], *, gamma: int, max_new_tokens: int,
                    verify_cost: float = 1.0) -> Objective:
  """Leviathan-model speedup from the acceptance of one greedy speculative run over all prompts (one batch).

  verify_cost: a verification forward (gamma + 1 tokens) over one autoregressive step. 1 is the memory-bound
  ideal; benchmarks/bench_speculative.py measures it (on XLA:CPU 1.34-1.54 for 3-6 tokens: small matmuls
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
    stats = specjax.generate(model, [ids], max_new_tokens=max_new_tokens, drafter=drafter, gamma=gamma).stats
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


def merge_stats(stats: list[dict], gamma: int) -> dict:
  """Pools the stats of several single-prompt speculative runs."""
  live = sum(sum(s["rounds_per_row"]) for s in stats)
  accepted = sum(sum(s["accepted_per_row"]) for s in stats)
  from_rounds = sum(sum(s["new_tokens_per_row"]) - len(s["new_tokens_per_row"]) for s in stats)
  per_position = [sum(s["acceptance_per_position"][i] * sum(s["rounds_per_row"]) for s in stats) / max(live, 1)
                  for i in range(gamma)]
  rejections = sum(sum(s["rejections_per_row"]) for s in stats)
  return {"rounds_per_row": [live], "accepted_per_row": [accepted], "rejections_per_row": [rejections],
          "acceptance_per_position": per_position,
          "acceptance_rate": accepted / (live * gamma) if live else math.nan,
          "mean_accepted": from_rounds / live if live else math.nan}


def calibration_prompts(model, questions, num_prompts: int, *, max_new_tokens: int, gamma: int
                        ) -> tuple[list, list[list[int]]]:
  """Chat prompts from Spec-Bench questions that share one compiled shape, spread over categories.

  Takes questions round-robin over categories from the END of each category (the benchmarks use the first
  ones), keeping those whose padded width and cache lengths (autoregressive and speculative) equal the first
  one's, so each candidate compiles one program. Returns (questions, token ids).
  """
  by_category: dict[str, list] = {}
  for q in questions:
    by_category.setdefault(q.category, []).append(q)
  pools = [list(reversed(qs)) for qs in by_category.values()]
  order = [pool[i] for i in range(max(map(len, pools))) for pool in pools if i < len(pool)]

  def shape(ids):
    spec = prepare_batch(model, [ids], max_new_tokens, extra_positions=gamma + 1)
    return spec.tokens.shape, spec.cache_len, prepare_batch(model, [ids], max_new_tokens).cache_len

  chosen, key = [], None
  for q in order:
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": q.turns[0]}], add_generation_prompt=True)
    if key is None:
      key = shape(ids)
    if shape(ids) == key:
      chosen.append((q, ids))
    if len(chosen) == num_prompts:
      break
  return [q for q, _ in chosen], [ids for _, ids in chosen]


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
  order = [int(l) for l in np.argsort(influence, kind="stable")]
  candidates = order[:candidate_pool] if candidate_pool else order
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


# --- Saved skip sets ---------------------------------------------------------------------------------------

def save_skip_set(path: str, record: dict) -> None:
  """Writes `record` as JSON atomically: a temporary file in the same folder, then os.replace.

  A reader never sees a half-written file, and a failed write leaves any previous file untouched.
  """
  if record.get("drafter") != "layer_skip" or not isinstance(record.get("options"), dict):
    raise ValueError("a skip-set record needs drafter='layer_skip' and an options dict")
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
  umask = os.umask(0)
  os.umask(umask)
  try:
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would make the saved config private
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(_finite(record), f, indent=2, allow_nan=False)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def read_skip_set(path: str) -> dict:
  """The whole saved record."""
  with open(path, encoding="utf-8") as f:
    record = json.load(f)
  if record.get("drafter") != "layer_skip" or not isinstance(record.get("options"), dict):
    raise ValueError(f"{path} is not a layer-skip record (drafter={record.get('drafter')!r})")
  return record


def load_skip_set(path: str, model=None) -> dict:
  """`make_drafter("layer_skip", model, **load_skip_set(path))` keyword arguments from a saved record.

  With `model`, checks that the record was searched for a model with as many layers and that the set is
  valid for it.
  """
  record = read_skip_set(path)
  options = dict(record["options"])
  if set(options) - {"skip_layers", "exit_layer"} or len(options) != 1:
    raise ValueError(f"{path}: options must be exactly one of skip_layers / exit_layer, got {options}")
  if "skip_layers" in options:
    options["skip_layers"] = [int(i) for i in options["skip_layers"]]
  else:
    options["exit_layer"] = int(options["exit_layer"])
  if model is not None:
    if record.get("num_layers") not in (None, model.config.num_layers):
      raise ValueError(f"{path} was searched for a {record['num_layers']}-layer model ({record.get('model')}); "
                       f"{model.name} has {model.config.num_layers}")
    draft_layers(model.config.num_layers, **options)
  return options


# --- Command line ------------------------------------------------------------------------------------------

def main(argv):
  del argv
  from absl import flags
  from tqdm import tqdm
  from experiments import spec_bench
  f = flags.FLAGS
  model = specjax.load(f.model, dtype="float32")
  if model.tokenizer is None:
    raise ValueError(f"{f.model} has no tokenizer; calibration prompts are Spec-Bench text")
  questions, prompts = calibration_prompts(model, spec_bench.load_questions(), f.prompts,
                                           max_new_tokens=f.max_new_tokens, gamma=f.gamma)
  exit_layers = [int(k) for k in f.exit_layers]
  bar = tqdm(total=f.budget, desc=f"{f.objective} skip-set search", unit="candidate")

  def progress(skip, evaluation):
    bar.update(1)
    bar.set_postfix(skip=drafter_options(model.config.num_layers, skip), speedup=f"{evaluation.speedup:.3f}",
                    alpha=f"{evaluation.alpha:.2f}")
    bar.write(f"skip {list(skip)}: speedup {evaluation.speedup:.3f}, α {evaluation.alpha:.3f}, "
              f"tokens/round {evaluation.mean_accepted:.2f}, c {evaluation.draft_cost:.2f}, "
              f"compile {evaluation.compile_seconds:.0f} s")

  record = search(model, prompts, gamma=f.gamma, max_new_tokens=f.max_new_tokens, budget=f.budget,
                  objective=f.objective, repeats=f.repeats, exit_layers=exit_layers,
                  candidate_pool=f.candidate_pool, verify_cost=f.verify_cost, on_evaluation=progress,
                  calibration={"source": "Spec-Bench, last questions of each category, chat template",
                               "question_ids": [q.question_id for q in questions],
                               "categories": [q.category for q in questions]})
  bar.close()
  save_skip_set(f.out, record)
  speedup = record["measured_speedup"] if record["objective"] == "measured" else record["proxy_speedup"]
  print(f"best: {record['options']} gamma={record['gamma']}: {record['objective']} speedup {speedup:.3f} "
        f"(acceptance rate {record['acceptance_rate']:.3f}, α {record['alpha']:.3f}, tokens/round "
        f"{record['mean_accepted']:.2f}) after {record['search']['evaluations']} evaluations "
        f"({record['search']['greedy_stopped']}); saved to {f.out}")
  if speedup < 1:
    print("speedup < 1: on this model every skip set tried is slower than autoregressive decoding.")


def _define_flags():
  from absl import flags
  flags.DEFINE_string("model", "smollm2-135m", "Model name or path for specjax.load (fp32).")
  flags.DEFINE_string("out", None, "Where to save the JSON record.", required=True)
  flags.DEFINE_integer("prompts", 4, "Calibration prompts (Spec-Bench, one compiled shape).")
  flags.DEFINE_integer("max_new_tokens", 48, "Tokens generated per calibration prompt.")
  flags.DEFINE_integer("gamma", 2, "Draft tokens per round.")
  flags.DEFINE_integer("budget", 10, "Most candidate evaluations (each compiles a program), sweep included.")
  flags.DEFINE_enum("objective", "measured", ["measured", "proxy"], "Timed speedup or Leviathan-model proxy.")
  flags.DEFINE_integer("repeats", 2, "Interleaved timing rounds per candidate (measured objective).")
  flags.DEFINE_list("exit_layers", ["28"], "Early-exit points swept before the greedy search.")
  flags.DEFINE_integer("candidate_pool", 0, "Greedy: only the N least-influential layers (0: all).")
  flags.DEFINE_float("verify_cost", 1.0, "Proxy: verification cost in AR steps (see bench_speculative.py).")


if __name__ == "__main__":
  from absl import app
  _define_flags()
  app.run(main)
