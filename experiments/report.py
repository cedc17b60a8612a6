"""Summary, Markdown table and plots of a run's timing records.

Per method and prompt batch, the batch's time is the median over repeats; tokens/s of a method is the median over
batches of (new tokens / batch time). There is one speedup: the median over prompt batches (one prompt at batch size
1) of the paired speedups, each the method's tokens/s over the baseline's on the same prompts, the calls interleaved
and averaged over repeats before pairing (`paired_speedups`: the repeats of a prompt are not independent), with a
distribution-free 90% interval from their order statistics (`median_interval`: a binomial bound, no resampling). On
a shared machine one call's time moves by 10-20%, so a single prompt cannot tell 0.95x from 1.0x; the interval says
how many prompts do, and a run's never-drafting `control` (autoregressive decoding timed as a method) shows the
measurement floor.
`category_intervals` gives the same per category. A method whose drafts made fewer than `FEW_DRAFTS` of its
tokens (adaptive drafting that chose plain target steps) is labelled with its draft share instead of a speedup
bar: its speed is autoregressive decoding's, whatever the drafter.

Acceptance is pooled over every call of a method from the engine's per-row counts (not a median of ratios):
alpha = accepted / (accepted + rejections) (Leviathan's α), mean accepted = tokens committed by verification
rounds / rounds (bonus included), acceptance per position k = rounds whose drafts 1..k were all accepted / rounds
that drafted k tokens or more (every round at a fixed γ; adaptive drafting drafts later positions only in the
rounds confident enough to reach them, so its figures need not fall with k).
With costs (experiments/costs.py), `add_costs` puts Leviathan's prediction, the efficiency and the accelerator
projection (experiments/projection.py) beside them (formulas in its docstring and in results.md).

Greedy agreement with the baseline (for peers, other implementations, whose tokens may differ): per row, the
tokens before the first divergence over the longer row's length; `agreement` is its mean over rows and
`equal_rows` the fraction of rows equal token for token.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402

from experiments import projection  # noqa: E402
from specjax import leviathan  # noqa: E402
from specjax.stats import merge_stats  # noqa: E402

CONTROL = "control"  # the never-drafting control method a run's `config.control` adds (experiments/run.py)
FEW_DRAFTS = 0.1  # below this share of a method's tokens from accepted drafts, tables and plots say so


QUANTIZED = "quantized (GGUF blocks)"  # how a run's weights read where its dtype would be shown


def weights(config: dict[str, Any]) -> str:
  """How a run's target holds its weights, where its dtype is shown: the dtype, or `QUANTIZED` for a target loaded
  with its GGUF's quantized blocks (`config.quantized`: `specjax.load(..., quantized=True)`)."""
  return QUANTIZED if config.get("quantized") else str(config.get("dtype", "float32"))


def _median(values) -> float | None:
  values = [v for v in values if v is not None and not math.isnan(v)]
  return float(np.median(values)) if values else None


def agreement(rows: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> list[float]:
  """Per row: the length of the prefix shared with the reference row over the longer row's length (1.0: equal)."""
  fractions = []
  for row, ref in zip(rows, reference, strict=True):
    same = next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), min(len(row), len(ref)))
    fractions.append(same / max(len(row), len(ref)) if row or ref else 1.0)
  return fractions


def batch_throughput(records: Sequence[dict], method: str) -> dict[int, dict[str, Any]]:
  """Per batch of `method`: median seconds over repeats, new tokens and tokens/s, and the batch's category."""
  by_batch: dict[int, list[dict]] = {}
  for r in records:
    if r["method"] == method:
      by_batch.setdefault(r["batch"], []).append(r)
  out = {}
  for batch, rs in by_batch.items():
    seconds = _median(r["seconds"] for r in rs)
    tokens = _median(r["new_tokens"] for r in rs)
    out[batch] = {"category": rs[0]["category"], "seconds": seconds, "new_tokens": tokens,
                  "tokens_per_second": tokens / seconds}
  return out


def _pooled(records: Sequence[dict], gamma: int) -> dict[str, Any]:
  """The engine's acceptance figures pooled over every timed call (per-row counts summed, not medians of ratios)."""
  pooled = merge_stats(records, gamma)
  return {"mean_accepted": pooled["mean_accepted"], "acceptance_rate": pooled["acceptance_rate"],
          "alpha": leviathan.alpha_from_stats(pooled, gamma),
          "acceptance_per_position": pooled["acceptance_per_position"],
          # Adaptive drafting: rounds by the draft length used (index 0: a plain target step).
          "gamma_histogram": [int(sum(c)) for c in zip(*(r["gamma_histogram"] for r in records))]
          if all(r.get("gamma_histogram") for r in records) else None,
          "plain_share": plain_share(records), "draft_share": draft_share(records), "tree_share": tree_share(records)}


def draft_share(records: Sequence[dict]) -> float | None:
  """The share of the new tokens that were accepted drafts (the rest came from the target: bonus, corrections,
  plain steps, the prefill's first token); None when a call did not count them."""
  if not records or any(r.get("accepted_per_row") is None for r in records):
    return None
  tokens = sum(sum(r["new_tokens_per_row"]) for r in records)
  return sum(sum(r["accepted_per_row"]) for r in records) / tokens if tokens else None


def plain_share(records: Sequence[dict]) -> float | None:
  """Adaptive drafting's plain steps (rounds that did not draft) over all rounds (None: a call did not count them)."""
  rounds = sum(r["target_calls"] - 1 for r in records)
  plain = [r.get("plain_steps") for r in records]
  return sum(plain) / rounds if rounds and None not in plain else None


def tree_share(records: Sequence[dict]) -> float | None:
  """Rounds that drafted a tree over all rounds (None: a call did not count them)."""
  rounds = sum(r["target_calls"] - 1 for r in records)
  trees = [r.get("tree_rounds") for r in records]
  return sum(trees) / rounds if rounds and None not in trees else None


def forward_costs_used(records: Sequence[dict]) -> list[dict[str, Any]] | None:
  """The forward costs f(n) adaptive drafting's plans read in a method's calls (`specjax.generate`'s
  stats["forward_costs"]: a table's points at the n a plan prices; one per rows of a forward): each with the calls
  that used it by where it came from ("calibrated", "cached", "typed table"), the most used first; None when no call
  reports one."""
  tables: dict[str, dict[str, Any]] = {}
  for r in records:
    if r.get("forward_costs") is None:
      continue
    table = tables.setdefault(json.dumps(r["forward_costs"]), {"points": r["forward_costs"], "calls": 0,
                                                                 "sources": {}})
    table["calls"] += 1
    source = r.get("forward_costs_source")
    table["sources"][source] = table["sources"].get(source, 0) + 1
  return sorted(tables.values(), key=lambda t: -t["calls"]) or None


def paired_speedups(records: Sequence[dict], method: str, baseline: str) -> list[float]:
  """One ratio per prompt batch (the unit of the statistics: one prompt at batch size 1): the method's tokens/s
  over the baseline's on the same prompts, each averaged over the repeats both ran (their new tokens over their
  seconds) before pairing. Repeats of one prompt are correlated, so they are not counted as independent pairs."""
  totals: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
  for r in records:
    if r["method"] in (method, baseline):
      totals.setdefault((r["method"], r["batch"]), {})[r["repeat"]] = (r["new_tokens"], r["seconds"])
  ratios = []
  for batch in dict.fromkeys(r["batch"] for r in records if r["method"] == method):
    own, base = totals[(method, batch)], totals.get((baseline, batch), {})
    repeats = sorted(set(own) & set(base))
    if not repeats:
      continue
    rate = [sum(calls[k][0] for k in repeats) / sum(calls[k][1] for k in repeats) for calls in (own, base)]
    ratios.append(rate[0] / rate[1])
  return ratios


def median_interval(values: Sequence[float], confidence: float = 0.9) -> tuple[float, float] | None:
  """A distribution-free confidence interval for the median of `values`: the order statistics x_(k) and
  x_(n+1-k) for the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is at least `confidence`; None when
  there are too few values for any (n < 5 at 0.9)."""
  xs = sorted(values)
  n = len(xs)
  below, best = 0.0, None  # below: P(Binomial(n, 1/2) <= k - 1)
  for k in range(1, n // 2 + 1):
    below += math.comb(n, k - 1) / 2 ** n
    if 1 - 2 * below < confidence:
      break
    best = k
  return None if best is None else (float(xs[best - 1]), float(xs[n - best]))


def category_intervals(records: Sequence[dict], method: str, baseline: str,
                       confidence: float = 0.9) -> dict[str, dict[str, Any]]:
  """Per category: the median of the method's paired speedups (`paired_speedups`: one per prompt batch), their
  number ("pairs"), and `median_interval`'s interval (None below 5)."""
  out = {}
  for category in dict.fromkeys(r["category"] for r in records if r["method"] == method):
    ratios = paired_speedups([r for r in records if r["category"] == category], method, baseline)
    if not ratios:
      continue
    interval = median_interval(ratios, confidence)
    out[category] = {"median": float(np.median(ratios)), "pairs": len(ratios), "confidence": confidence,
                     "low": interval[0] if interval else None, "high": interval[1] if interval else None}
  return out


def summarize(records: Sequence[dict], methods: Sequence[str], baseline: str,
              compile_seconds: dict[str, float | None], lossless: dict[str, bool | None],
              methods_info: dict[str, dict] | None = None) -> dict[str, Any]:
  """Per-method summary and per-category speedups (see the module docstring for the statistics).

  `methods_info`: {name: {"drafter", "family", "options", "gamma", "adaptive", "tree_nodes"}}; a method with a gamma
  gets the engine's acceptance figures pooled over its calls (alpha, mean_accepted, acceptance_per_position).
  """
  info = methods_info or {}
  summary, per_category, intervals = {}, {}, {}
  timed = {r["method"] for r in records}
  for method in [m for m in methods if m in timed]:  # a peer that failed before its first call has none
    batches = batch_throughput(records, method)
    rs = [r for r in records if r["method"] == method]
    tps = _median(b["tokens_per_second"] for b in batches.values())
    spread = paired_speedups(records, method, baseline)
    interval = median_interval(spread)
    row_agreement = [a for r in rs for a in (r.get("agreement") or ())]
    meta = info.get(method, {})
    gamma = meta.get("gamma")
    drafted = gamma is not None and all(r.get("rounds_per_row") is not None for r in rs)
    acceptance = _pooled(rs, gamma) if drafted else {
        "mean_accepted": _median(r["mean_accepted"] for r in rs), "acceptance_rate": None, "alpha": None,
        "acceptance_per_position": None, "gamma_histogram": None, "plain_share": None, "draft_share": None,
        "tree_share": None}
    summary[method] = {
        "drafter": meta.get("drafter"), "family": meta.get("family", method), "options": meta.get("options", {}),
        "gamma": gamma, "adaptive": meta.get("adaptive"), "tree_nodes": meta.get("tree_nodes"),
        "tokens_per_second": tps,
        "speedup": _median(spread),  # the median paired speedup (module docstring)
        "speedup_low": interval[0] if interval else None,  # its 90% interval (None below 5 prompt batches)
        "speedup_high": interval[1] if interval else None,
        "pairs": len(spread),
        **acceptance,
        "forward_costs": forward_costs_used(rs),
        "target_calls_per_batch": _median(r["target_calls"] for r in rs),
        "compile_seconds": compile_seconds.get(method),
        "recompiles": sum(r["compile_call_seconds"] is not None for r in rs),
        "recompile_seconds": sum(r["compile_call_seconds"] or 0.0 for r in rs),
        "lossless": lossless.get(method),
        "agreement": float(np.mean(row_agreement)) if row_agreement else None,
        "equal_rows": float(np.mean([a == 1.0 for a in row_agreement])) if row_agreement else None,
        "batches": len(batches),
        "new_tokens": int(sum(b["new_tokens"] for b in batches.values())),
    }
    typed = calibrated_pair(method, methods)
    if typed is not None:  # `X_calibrated` against `X_typed`, call by call (`calibrated_pair`)
      ratios = paired_speedups(records, method, typed)
      pair_interval = median_interval(ratios)
      summary[method]["over_typed"] = {"method": typed, "speedup": _median(ratios), "pairs": len(ratios),
                                       "low": pair_interval[0] if pair_interval else None,
                                       "high": pair_interval[1] if pair_interval else None}
    by_category = category_intervals(records, method, baseline)
    per_category[method] = {c: i["median"] for c, i in by_category.items()}
    if method != baseline:
      intervals[method] = by_category
  failures = [{"method": r["method"], "temperature": r.get("temperature"), "batch": r["batch"],
               "repeat": r["repeat"], "question_ids": r["question_ids"]}
              for r in records if r.get("matches_baseline") is False]
  return {"baseline": baseline, "methods": summary, "speedup_by_category": per_category,
          "category_intervals": intervals,
          "lossless_failures": failures,
          "all_lossless": None if all(v is None for v in lossless.values()) else not failures}


def calibrated_pair(method: str, methods: Sequence[str]) -> str | None:
  """For a method named `X_calibrated` (adaptive drafting with forward costs calibrated for the model it runs,
  configs/calibrated_costs.py), `X_typed` (the same with the typed table) when the run has it, else None."""
  if not method.endswith("_calibrated"):
    return None
  typed = method[:-len("_calibrated")] + "_typed"
  return typed if typed in methods else None


def add_costs(summary: dict[str, Any], costs: dict[str, Any],
              accelerator: dict[str, dict[str, Any]] | None = None) -> None:
  """Adds c, r, Leviathan's prediction and the efficiency to each drafted method, the accelerator projection where
  `accelerator` (`projection.read`: a round's costs on a TPU by the analytic cost model) has the method at its gamma
  and tree size (a tree method's whether or not its costs on this CPU are measured), and
  `roofline_fraction` (the 1-token target step's bytes / its time / the read bandwidth, both measured in the run)
  to the summary.

    predicted = E(alpha, gamma) / (gamma c + r),  E = (1 - alpha^(gamma+1)) / (1 - alpha),
    efficiency = measured speedup / predicted,
    projected (accelerator) = tau / (gamma c_tpu + r_tpu + u_tpu), tau the measured mean accepted
                              (experiments/projection.py).
  """
  if "roofline_fraction" in costs:
    summary["roofline_fraction"] = costs["roofline_fraction"]
  for name, s in summary["methods"].items():
    # The round's costs on a TPU, for a tree method too (its costs on this CPU are not measured).
    projected = projection.project(s, accelerator or {}, name)
    if projected is not None:
      s["projected_speedup"] = projected
      s["projection_costs"] = accelerator[name]
    cost = costs["methods"].get(name)
    if cost is None or s["alpha"] is None:
      continue
    alpha, gamma = s["alpha"], s["gamma"]
    s["draft_cost"], s["verify_cost"] = cost["draft_cost"], cost["verify_cost"]
    s["expected_tokens_per_round"] = leviathan.expected_tokens_per_round(alpha, gamma)
    s["predicted_speedup"] = leviathan.predicted_speedup(alpha, gamma, cost["draft_cost"], cost["verify_cost"])
    s["efficiency"] = s["speedup"] / s["predicted_speedup"] if s["speedup"] is not None else None
    if "draft_cost_bytes" in cost:
      s["draft_cost_bytes"], s["verify_cost_bytes"] = cost["draft_cost_bytes"], cost["verify_cost_bytes"]


def lossless_banner(summary: dict[str, Any]) -> str:
  """One line naming every method and prompt whose greedy tokens differ from the baseline's ('' if none)."""
  failures = summary.get("lossless_failures") or []
  if not failures:
    return ""
  by_method: dict[str, set] = {}
  for f in failures:
    by_method.setdefault(f["method"], set()).update(f["question_ids"])
  listed = "; ".join(f"{m} on questions {sorted(q)}" for m, q in by_method.items())
  return (f"greedy output differs from {summary['baseline']} ({len(failures)} timed calls): {listed}. "
          "Speculative decoding must be lossless: this is a bug.")


def _fmt(x, spec: str) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  if isinstance(x, bool):
    return "yes" if x else "NO"
  return format(x, spec)


def agreement_table(summary: dict[str, Any]) -> str:
  rows = ["| method | equal rows | tokens until first divergence |", "|---|---:|---:|"]
  for method, s in summary["methods"].items():
    if s.get("agreement") is not None:
      rows.append(f"| {method} | {_fmt(s['equal_rows'], '.0%')} | {_fmt(s['agreement'], '.0%')} |")
  return "\n".join(rows) if len(rows) > 2 else ""


def few_drafts(s: dict[str, Any]) -> bool:
  """Whether a drafted method's accepted drafts made fewer than FEW_DRAFTS of its tokens."""
  return s.get("draft_share") is not None and s["draft_share"] < FEW_DRAFTS


def speedup_text(s: dict[str, Any]) -> str:
  """"1.23x (1.20–1.25)": the median paired speedup and its 90% interval; a method that (almost) never drafted
  says so beside it."""
  if s.get("speedup") is None:
    return "–"
  bounds = f" ({s['speedup_low']:.2f}–{s['speedup_high']:.2f})" if s.get("speedup_low") is not None else ""
  text = f"{s['speedup']:.2f}x{bounds}"
  if few_drafts(s):
    text += " never drafted" if s["draft_share"] == 0 else f" drafted {s['draft_share']:.0%} of tokens"
  return text


def markdown_table(summary: dict[str, Any]) -> str:
  rows = ["| method | γ | tokens/s | speedup (paired median, 90% interval) | tokens per forward | alpha | "
          "from drafts | c | r | predicted | efficiency | accelerator projection | compile s | lossless |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
  for method, s in summary["methods"].items():
    rows.append(f"| {method} | {_fmt(s.get('gamma'), 'd')} | {_fmt(s['tokens_per_second'], '.1f')} | "
                f"{speedup_text(s)} | {_fmt(s['mean_accepted'], '.2f')} | "
                f"{_fmt(s['alpha'], '.2f')} | {_fmt(s.get('draft_share'), '.0%')} | {_fmt(s.get('draft_cost'), '.3f')} | "
                f"{_fmt(s.get('verify_cost'), '.2f')} | "
                f"{_fmt(s.get('predicted_speedup'), '.2f')} | {_fmt(s.get('efficiency'), '.2f')} | "
                f"{_fmt(s.get('projected_speedup'), '.2f')} | {_fmt(s['compile_seconds'], '.1f')} | "
                f"{_fmt(s['lossless'], '')} |")
  return "\n".join(rows)


def acceptance_table(summary: dict[str, Any]) -> str:
  """Acceptance per draft position: of the rounds that drafted k tokens or more, the share whose first k drafts were
  all accepted ("–" where no round drafted k)."""
  drafted = {m: s for m, s in summary["methods"].items() if s.get("acceptance_per_position")}
  if not drafted:
    return ""
  width = max(len(s["acceptance_per_position"]) for s in drafted.values())
  # (header, cell of a method's summary) per column; the c and r (bytes) columns only where the run measured them
  columns = [(f"k={k + 1}", lambda s, k=k: (s["acceptance_per_position"] + [None] * width)[k]) for k in range(width)]
  if _has_bytes_costs(summary):
    columns += [("c (bytes)", lambda s: s.get("draft_cost_bytes")), ("r (bytes)", lambda s: s.get("verify_cost_bytes"))]
  rows = ["| method | " + " | ".join(header for header, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
  rows += [f"| {method} | " + " | ".join(_fmt(cell(s), ".3f") for _, cell in columns) + " |"
           for method, s in drafted.items()]
  return "\n".join(rows)


def adaptive_rounds_table(summary: dict[str, Any]) -> str:
  """Per adaptive drafter: the share of rounds that were plain target steps, and the acceptance of the drafts it
  made."""
  rows = ["| method | plain steps | alpha (drafted) |", "|---|---:|---:|"]
  for method, s in summary["methods"].items():
    if not s.get("adaptive") or s.get("plain_share") is None:
      continue
    rows.append(f"| {method} | {s['plain_share']:.0%} | {_fmt(s.get('alpha'), '.3f')} |")
  return "\n".join(rows) if len(rows) > 2 else ""


def _points_text(points: Sequence[Sequence[float]]) -> str:
  return ", ".join(f"f({int(n)}) {f:.2f}" for n, f in points[1:])


def forward_costs_table(summary: dict[str, Any]) -> str:
  """Per adaptive method: the points of the forward costs f(n) its plans read and where they came from, the rounds
  by draft length (index 0: no draft verified), the share of tree rounds, its speedup, and for `X_calibrated` beside
  `X_typed` the paired speedup of the one over the other."""
  rows = ["| method | f(n) (source: calls) | rounds by draft length | tree rounds | speedup | over typed |",
          "|---|---|---|---:|---:|---:|"]
  for method, s in summary["methods"].items():
    tables = s.get("forward_costs")
    if not s.get("adaptive") or not tables:
      continue
    costs = "; ".join(f"{_points_text(t['points'])} ({', '.join(f'{k}: {v}' for k, v in t['sources'].items())})"
                      for t in tables)
    over = s.get("over_typed")
    versus = "–" if not over or over["speedup"] is None else (
        f"{over['speedup']:.3f}x" + (f" ({over['low']:.3f}–{over['high']:.3f})" if over["low"] is not None else ""))
    histogram = " / ".join(map(str, s["gamma_histogram"])) if s.get("gamma_histogram") else "–"
    rows.append(f"| {method} | {costs} | {histogram} | {_fmt(s.get('tree_share'), '.0%')} | {speedup_text(s)} | "
                f"{versus} |")
  return "\n".join(rows) if len(rows) > 2 else ""


def _has_bytes_costs(summary: dict[str, Any]) -> bool:
  return any(s.get("draft_cost_bytes") is not None for s in summary["methods"].values())


def adaptive_table(summary: dict[str, Any]) -> str:
  """Each adaptive drafter `X` beside its fixed draft lengths run as `X_g<gamma>` (configs/adaptive_vs_fixed.py):
  speedup over the baseline, and the lowest per-category speedup, for adaptive, the best and the worst fixed gamma."""
  methods, by_category = summary["methods"], summary["speedup_by_category"]
  rows = ["| drafter | adaptive | best fixed γ | worst fixed γ | lowest category: adaptive | best fixed |",
          "|---|---:|---:|---:|---:|---:|"]
  for name, s in methods.items():
    fixed = {n: f for n, f in methods.items()
             if f.get("adaptive") is False and re.fullmatch(rf"{re.escape(name)}_g\d+", n)}
    if not s.get("adaptive") or not fixed:
      continue
    best = max(fixed, key=lambda n: fixed[n]["speedup"] or 0.0)
    worst = min(fixed, key=lambda n: fixed[n]["speedup"] or 0.0)
    lowest = {n: min(by_category[n].values()) for n in (name, best)}
    rows.append(f"| {name} | {s['speedup']:.2f}x | {fixed[best]['speedup']:.2f}x (γ {fixed[best]['gamma']}) | "
                f"{fixed[worst]['speedup']:.2f}x (γ {fixed[worst]['gamma']}) | {lowest[name]:.2f}x | "
                f"{lowest[best]:.2f}x |")
  return "\n".join(rows) if len(rows) > 2 else ""


def category_table(summary: dict[str, Any], floor: float = 0.95) -> str:
  """Per category (rows) and method (columns): the median paired speedup and its interval (`category_intervals`),
  then per method how many categories' intervals lie wholly above `floor`, contain it, or lie wholly below it.
  Empty when no category has an interval (fewer than 5 prompt batches each)."""
  intervals = summary.get("category_intervals") or {}
  if not any(i["low"] is not None for per in intervals.values() for i in per.values()):
    return ""
  methods = list(intervals)
  categories = list(dict.fromkeys(c for per in intervals.values() for c in per))

  def cell(i: dict | None) -> str:
    if i is None:
      return "–"
    bounds = f" ({i['low']:.2f}–{i['high']:.2f})" if i["low"] is not None else ""
    return f"{i['median']:.2f}{bounds}"

  rows = ["| category (prompts) | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
  for c in categories:
    pairs = max(intervals[m][c]["pairs"] for m in methods if c in intervals[m])
    rows.append(f"| {c} ({pairs}) | " + " | ".join(cell(intervals[m].get(c)) for m in methods) + " |")
  verdicts = []
  for m in methods:
    known = [i for i in intervals[m].values() if i["low"] is not None]
    verdicts.append(f"{sum(i['low'] >= floor for i in known)} / {sum(i['low'] < floor <= i['high'] for i in known)}"
                    f" / {sum(i['high'] < floor for i in known)}")
  rows.append(f"| above / containing / below {floor:g}x | " + " | ".join(verdicts) + " |")
  return "\n".join(rows)


def batch_size_table(summary: dict[str, Any]) -> str:
  """Per method and batch size (config.batch_sizes): speedup over the baseline at that batch size, and tokens/s."""
  by_b = summary.get("by_batch_size") or {}
  if len(by_b) < 2:
    return ""
  methods = list(next(iter(by_b.values())))
  rows = ["| method | " + " | ".join(f"batch {b}: speedup (tokens/s)" for b in by_b) + " |",
          "|---|" + "---:|" * len(by_b)]
  for method in methods:
    cells = []
    for per_method in by_b.values():
      s = per_method.get(method)
      cells.append("–" if s is None else f"{_fmt(s['speedup'], '.2f')}x ({_fmt(s['tokens_per_second'], '.1f')})")
    rows.append(f"| {method} | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def plot_speedup_vs_batch_size(summary: dict[str, Any], path: str) -> bool:
  """Speedup over the baseline at the same batch size, one line per method (config.batch_sizes)."""
  by_b = summary.get("by_batch_size") or {}
  if len(by_b) < 2:
    return False
  sizes = [int(b) for b in by_b]
  methods = [m for m in next(iter(by_b.values())) if m != summary["baseline"]]
  fig, ax = plt.subplots(figsize=(5.5, 3.8))
  for method in methods:
    values = [by_b[str(b)].get(method, {}).get("speedup", np.nan) for b in sizes]
    ax.plot(sizes, values, marker="o", label=method)
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_xticks(sizes)
  ax.set(xlabel="batch size (rows per call)", ylabel=f"speedup over {summary['baseline']} at that batch size")
  ax.legend(fontsize="small")
  _save(fig, path)
  return True


def plot_speedup(summary: dict[str, Any], path: str) -> None:
  """One bar per method: the median paired speedup with its 90% interval. A method whose drafts made fewer than
  FEW_DRAFTS of its tokens gets no bar, only its draft share, so it does not read as a drafter's speedup."""
  methods = list(summary["methods"])
  fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(methods), 3.5))
  top = 1.0
  for i, m in enumerate(methods):
    s = summary["methods"][m]
    if s.get("speedup") is None:
      continue
    if few_drafts(s):
      label = "never drafted" if s["draft_share"] == 0 else f"drafted {s['draft_share']:.0%}\nof tokens"
      ax.text(i, 0.5, label, ha="center", va="center", fontsize="small", color="0.3")
      continue
    bar = ax.bar([i], [s["speedup"]], color="0.6" if m == summary["baseline"] else "C0")
    if s.get("speedup_low") is not None:
      ax.errorbar([i], [s["speedup"]], yerr=[[s["speedup"] - s["speedup_low"]], [s["speedup_high"] - s["speedup"]]],
                  color="k", lw=0.8, capsize=3)
    ax.bar_label(bar, labels=[f"{s['speedup']:.2f}x"], padding=4)
    top = max(top, s.get("speedup_high") or s["speedup"])
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_xticks(range(len(methods)), methods)
  ax.set_ylim(0, 1.2 * top)  # room for the labels
  ax.set_ylabel(f"speedup over {summary['baseline']}\n(paired median, 90% interval)")
  ax.tick_params(axis="x", labelrotation=20)
  _save(fig, path)


def plot_speedup_by_category(summary: dict[str, Any], path: str) -> None:
  methods = [m for m in summary["speedup_by_category"] if m != summary["baseline"]] or [summary["baseline"]]
  categories = list(dict.fromkeys(c for m in methods for c in summary["speedup_by_category"][m]))
  width = 0.8 / len(methods)
  x = np.arange(len(categories))
  fig, ax = plt.subplots(figsize=(2 + 0.7 * len(categories) * max(1, len(methods) / 2), 3.8))
  intervals = summary.get("category_intervals") or {}
  for i, m in enumerate(methods):
    values = [summary["speedup_by_category"][m].get(c, np.nan) for c in categories]
    at = x + (i - (len(methods) - 1) / 2) * width
    ax.bar(at, values, width, label=m)
    bounds = [intervals.get(m, {}).get(c) for c in categories]
    shown = [(a, b["low"], b["high"]) for a, b in zip(at, bounds) if b is not None and b["low"] is not None]
    if shown:  # the paired speedups' median interval (category_intervals), a line over each bar
      ax.vlines(*zip(*shown), color="k", lw=0.8)
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_xticks(x, categories, rotation=30, ha="right")
  ax.set_ylabel(f"speedup over {summary['baseline']}")
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _save(fig, path: str) -> None:
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_acceptance_per_position(summary: dict[str, Any], path: str) -> bool:
  """Per drafted method (layer skip beside MTP): of the rounds that drafted k tokens or more, the share whose
  first k drafts were all accepted."""
  drafted = {m: s["acceptance_per_position"] for m, s in summary["methods"].items() if s.get("acceptance_per_position")}
  if not drafted:
    return False
  fig, ax = plt.subplots(figsize=(6, 3.8))
  for method, per in drafted.items():
    ax.plot(np.arange(1, len(per) + 1), per, marker="o", label=method)
  ax.set_xlabel("draft position k")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_ylabel("drafts 1..k accepted / rounds drafting k")
  ax.set_ylim(0, 1)
  ax.legend(fontsize="small")
  _save(fig, path)
  return True


def plot_mean_accepted_vs_gamma(summary: dict[str, Any], path: str) -> bool:
  """Tokens per target forward (bonus included) and speedup against gamma, one line per method family."""
  families: dict[str, list] = {}
  for s in summary["methods"].values():
    if s.get("gamma") is not None:
      families.setdefault(s["family"], []).append(s)
  families = {f: sorted(v, key=lambda s: s["gamma"]) for f, v in families.items() if len(v) > 1}
  if not families:
    return False
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
  for family, runs in families.items():
    gammas = [s["gamma"] for s in runs]
    left.plot(gammas, [s["mean_accepted"] for s in runs], marker="o", label=family)
    right.plot(gammas, [s["speedup"] for s in runs], marker="o", label=family)
  left.set(xlabel="gamma", ylabel="mean accepted (tokens per target forward)")
  for ax in (left, right):
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  right.set(xlabel="gamma", ylabel=f"speedup over {summary['baseline']}")
  right.axhline(1.0, color="k", lw=0.8, ls="--")
  left.legend(fontsize="small")
  _save(fig, path)
  return True


def plot_acceptance_vs_depth(summary: dict[str, Any], path: str) -> bool:
  """Left: layer skip's alpha against its exit layer. Right: MTP's acceptance per head depth k, i.e. the share of
  rounds whose drafts 1..k were accepted over those whose drafts 1..k-1 were (head k given heads < k right), for
  the MTP methods drafting a fixed γ (under adaptive drafting the per-position figures have different
  denominators, so their ratio is not this conditional)."""
  exits = sorted((s["options"]["exit_layer"], s["alpha"]) for s in summary["methods"].values()
                 if s.get("drafter") == "layer_skip" and "exit_layer" in (s.get("options") or {})
                 and s.get("alpha") is not None and not (s.get("options") or {}).get("adapter"))
  heads = {m: s["acceptance_per_position"] for m, s in summary["methods"].items()
           if (s.get("drafter") or "").startswith("mtp") and s.get("acceptance_per_position")
           and not s.get("adaptive")}
  if len(exits) < 2 and not heads:
    return False
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
  if exits:
    left.plot([e for e, _ in exits], [a for _, a in exits], marker="o", label="layer skip (untrained exit)")
    left.legend(fontsize="small")
  left.set(xlabel="exit layer", ylabel="acceptance (alpha)", ylim=(0, 1))
  for method, per in heads.items():
    conditional = [p / prev if prev else np.nan for p, prev in zip(per, [1.0] + per[:-1])]
    right.plot(np.arange(1, len(per) + 1), conditional, marker="o", label=method)
  right.set(xlabel="MTP head depth k", ylabel="acceptance of draft k given drafts < k accepted")
  right.xaxis.set_major_locator(MaxNLocator(integer=True))
  if heads:
    right.legend(fontsize="small")
  _save(fig, path)
  return True


def plot_alpha_by_temperature(summary: dict[str, Any], path: str) -> bool:
  """alpha of every drafted method at each temperature of the run (config.temperatures)."""
  by_t = summary.get("by_temperature") or {}
  if len(by_t) < 2:
    return False
  methods = [m for m, s in next(iter(by_t.values())).items() if s.get("alpha") is not None]
  if not methods:
    return False
  width = 0.8 / len(by_t)
  x = np.arange(len(methods))
  fig, ax = plt.subplots(figsize=(2 + 1.1 * len(methods), 3.8))
  for i, (t, per_method) in enumerate(by_t.items()):
    values = [per_method.get(m, {}).get("alpha") for m in methods]
    ax.bar(x + (i - (len(by_t) - 1) / 2) * width, [np.nan if v is None else v for v in values], width,
           label=f"temperature {t}")
  ax.set_xticks(x, methods, rotation=30, ha="right")
  ax.set_ylabel("alpha (accepted / tested drafts)")
  ax.set_ylim(0, 1)
  ax.legend(fontsize="small")
  _save(fig, path)
  return True


def json_safe(x):
  """NaN -> None (JSON has no NaN); numpy scalars -> Python."""
  if isinstance(x, dict):
    return {k: json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_safe(v) for v in x]
  if isinstance(x, np.generic):
    x = x.item()
  if isinstance(x, float) and math.isnan(x):
    return None
  return x


PROJECTION = ("**Accelerator projection** (not measured), for the methods drafting a fixed γ that the costs file "
              "projects: the measured mean accepted τ over a round's costs on a TPU, projected = τ / (γ·c + r + u) in "
              "decode steps of the target, each program's time the analytic cost model's max((weights + cache) / "
              "bandwidth, FLOPs / peak) + collectives / interconnect, counted from the model's config and the mesh "
              "(experiments/cost_model.py, experiments/projection.py; costs from {source}).")


def write(workdir: str, results: dict[str, Any]) -> str:
  """Writes results.json, results.md and the plots; returns the table (headed by any lossless failure)."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(json_safe(results), f, indent=1)
  summary = results["summary"]
  table = markdown_table(summary)
  banner = lossless_banner(summary)
  if banner:
    table = f"**LOSSLESS CHECK FAILED**: {banner}\n\n{table}"
  env, config = results["environment"], results["config"]
  costs = results.get("costs")
  plots = {"speedup.png": plot_speedup, "speedup_by_category.png": plot_speedup_by_category,
           "acceptance_per_position.png": plot_acceptance_per_position,
           "mean_accepted_vs_gamma.png": plot_mean_accepted_vs_gamma,
           "acceptance_vs_depth.png": plot_acceptance_vs_depth, "alpha_by_temperature.png": plot_alpha_by_temperature,
           "speedup_vs_batch_size.png": plot_speedup_vs_batch_size}
  written = [name for name, plot in plots.items() if plot(summary, os.path.join(workdir, name)) is not False]
  temperatures = list(summary.get("by_temperature") or [config["temperature"]])
  batch_sizes = list(summary.get("by_batch_size") or [str(config["batch_size"])])
  lines = [f"# {results['name']}\n", table, "",
           f"{config['model']} ({weights(config)}), prompts: {len(results['prompts'])}"
           f"{' (' + config['prompts']['split'] + ' side of the dev/test split)' if config['prompts'].get('split') else ''}"
           f", max_new_tokens "
           f"{config['max_new_tokens']}, temperature {', '.join(map(str, temperatures))} (this table: the first; "
           f"top-p {config['top_p']} when sampling), batch {', '.join(batch_sizes)} (this table: the first); "
           f"jax {env['jax']} on "
           f"{env['devices']}, {env['cpu_count']} CPUs. tokens/s: median over prompt batches; speedup: the median over "
           f"prompt batches of the method's tokens/s over {summary['baseline']}'s on the same prompts (interleaved "
           f"calls, repeats averaged before pairing), with a distribution-free 90% interval (none below 5 batches); "
           f"tokens per forward: tokens committed "
           f"per target forward (bonus included); alpha: accepted / tested drafts (Leviathan's α); from drafts: the "
           f"share of new tokens that were accepted drafts (below {FEW_DRAFTS:.0%} the speedup says so: such a "
           f"method decodes as {summary['baseline']} does); compile s: compiling the program for the first (warmup) "
           f"call; "
           f"{sum(s['recompiles'] for s in summary['methods'].values())} timed calls compiled a new shape and were "
           "rerun. Greedy outputs are compared token for token with the baseline (lossless)."]
  if costs:
    lines += ["", f"c: one draft step / one 1-token target step; r: a (γ+1)-token verification / a 1-token step; both "
              f"timed inside compiled loops in this run (median of {costs['repeats']} interleaved rounds, context "
              f"{costs['context_tokens']} tokens, cache {costs['cache_len']}). predicted = (1 − α^(γ+1)) / (1 − α) / "
              "(γ·c + r) (Leviathan et al. 2023); efficiency = measured speedup / predicted."]
    sources = {s["projection_costs"]["source"] for s in summary["methods"].values() if s.get("projection_costs")}
    if sources:
      lines += ["", PROJECTION.format(source=", ".join(sorted(sources)))]
    if "roofline_fraction" in costs:
      lines += ["", f"**Roofline** of {summary['baseline']} decoding: a 1-token target step (batch {costs['rows']}) "
                f"takes {1e3 * costs['target_seconds'][1]:.2f} ms for {costs['target_step_bytes'] / 1e6:.0f} MB of "
                f"weights{' as stored (the GGUF blocks and their scales)' if config.get('quantized') else ''} and KV "
                f"cache, {summary['roofline_fraction']:.0%} of the read bandwidth measured in this "
                f"run ({costs['read_bandwidth'] / 1e9:.1f} GB/s, a jitted sum over {costs['read_megabytes']} MB)."]
  skipped = summary.get("skipped_methods") or {}
  if skipped:
    lines += ["", "Left out (shipped checkpoint missing): " +
              "; ".join(f"{m} ({', '.join(c)})" for m, c in skipped.items()) + "."]
  unavailable = summary.get("unavailable_peers") or {}
  if unavailable:
    lines += ["", "Peers left out: " + "; ".join(f"{m} ({reason})" for m, reason in unavailable.items()) + "."]
  failed = summary.get("failed_peers") or {}
  if failed:
    lines += ["", "Peers that failed (timed until then, left out from then on): " +
              "; ".join(f"{m} ({reason})" for m, reason in failed.items()) + "."]
  for m, info in (summary.get("peers") or {}).items():
    lines += ["", f"{m} ran {', '.join(f'{k} {v}' for k, v in info.items())}."]
  agreement = agreement_table(summary)
  if agreement:
    lines += ["", f"Greedy agreement with {summary['baseline']} (lossless methods agree fully; peers run other "
              "kernels, so near ties can flip a token):", "", agreement]
  adaptive = adaptive_table(summary)
  if adaptive:
    lines += ["", "## Adaptive against fixed draft lengths", "",
              "Each drafter with adaptive drafting beside the same drafter drafting a fixed γ every round "
              "(speedups over the baseline in this run):", "", adaptive]
  rounds = adaptive_rounds_table(summary)
  if rounds:
    lines += ["", "## Adaptive rounds", "",
              "Rounds that did not draft (plain target steps: drafting could not pay) and the acceptance of the "
              "drafts made (pooled over every call):", "", rounds]
  forward_costs = forward_costs_table(summary)
  if forward_costs:
    lines += ["", "## Forward costs", "",
              "The points of the forward costs f(n) adaptive drafting's plan read (a target forward over n rows, "
              "batch rows x tokens, over a 1-row one; specjax/calibration.py), where they came from (calibrated: "
              "measured in that call; cached: measured before, in the run's warmup or an earlier run; typed table: "
              "`specjax.adaptive.CPU_FORWARD_COSTS` or a method's own), the rounds by the longest draft a row made "
              "(pooled over every call; the first: rounds that verified no draft, a 1-token target step), the share "
              "of rounds that drafted a tree, the speedup over the baseline, and for a method `X_calibrated` the "
              "median of its paired speedups over `X_typed` (the same drafter planning with the typed table, called "
              "interleaved on the same prompts and repeat) with its 90% interval:", "",
              forward_costs]
  by_category = category_table(summary)
  if by_category:
    confidence = next(i["confidence"] for per in summary["category_intervals"].values() for i in per.values())
    lines += ["", "## Speedup by category", "",
              f"Per category: the median of the paired speedups (each call against the baseline's interleaved call "
              f"on the same prompts and repeat) and a distribution-free {confidence:.0%} interval for it from their "
              "order statistics; the last row counts the categories whose interval lies above 0.95x, contains it, "
              "or lies below it:", "", by_category]
  by_batch = batch_size_table(summary)
  if by_batch:
    lines += ["", "## Speedup by batch size", "",
              "Every method against autoregressive decoding at the same batch size (rows with ragged acceptance "
              "advance together; costs and the table above are at the first batch size):", "", by_batch]
  per_position = acceptance_table(summary)
  if per_position:
    lines += ["", "## Acceptance per draft position", "",
              "Of the rounds that drafted k tokens or more, the share whose drafts 1..k were all accepted (pooled "
              "over every call; every round at a fixed γ, only the rounds confident enough to reach k under adaptive "
              "drafting)" + ("; c and r (bytes): a draft step's and a verification's bytes read over a 1-token "
                             "target step's (XLA's count on this CPU)" if _has_bytes_costs(summary) else "") +
              ":", "", per_position]
  lines += [""] + [f"![{name[:-4]}]({name})" for name in written]
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  return table
