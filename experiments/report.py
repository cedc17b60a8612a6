"""Summary, Markdown table and plots of a run's timing records.

Per method and prompt batch, the batch's time is the median over repeats; tokens/s of a method is the median
over batches of (new tokens / batch time), and its speedup is that divided by the autoregressive baseline's
tokens/s from the same run. Per-category speedups use the batches of that category only.

Greedy agreement with the baseline (for peers, other implementations, whose tokens may differ): per row, the
tokens before the first divergence over the longer row's length; `agreement` is its mean over rows and
`equal_rows` the fraction of rows equal token for token.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


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


def summarize(records: Sequence[dict], methods: Sequence[str], baseline: str,
              compile_seconds: dict[str, float | None], lossless: dict[str, bool | None]) -> dict[str, Any]:
  """Per-method summary and per-category speedups (see the module docstring for the statistics)."""
  base = batch_throughput(records, baseline)
  base_tps = _median(b["tokens_per_second"] for b in base.values())
  summary, per_category = {}, {}
  for method in methods:
    batches = batch_throughput(records, method)
    rs = [r for r in records if r["method"] == method]
    tps = _median(b["tokens_per_second"] for b in batches.values())
    row_agreement = [a for r in rs for a in (r.get("agreement") or ())]
    summary[method] = {
        "tokens_per_second": tps,
        "speedup": tps / base_tps,
        "median_batch_speedup": _median(b["tokens_per_second"] / base[i]["tokens_per_second"]
                                        for i, b in batches.items()),
        "mean_accepted": _median(r["mean_accepted"] for r in rs),
        "acceptance_rate": _median(r["acceptance_rate"] for r in rs),
        "alpha": _median(r.get("alpha") for r in rs),
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
    categories = dict.fromkeys(b["category"] for b in batches.values())
    per_category[method] = {
        c: _median(b["tokens_per_second"] for b in batches.values() if b["category"] == c)
        / _median(b["tokens_per_second"] for b in base.values() if b["category"] == c)
        for c in categories}
  return {"baseline": baseline, "methods": summary, "speedup_by_category": per_category}


def _fmt(x, spec: str) -> str:
  if x is None:
    return "–"
  if isinstance(x, bool):
    return "yes" if x else "NO"
  return format(x, spec)


def markdown_table(summary: dict[str, Any]) -> str:
  rows = ["| method | tokens/s | speedup | mean accepted | acceptance rate | alpha | compile s | lossless |",
          "|---|---:|---:|---:|---:|---:|---:|:---:|"]
  for method, s in summary["methods"].items():
    rows.append(f"| {method} | {_fmt(s['tokens_per_second'], '.1f')} | {_fmt(s['speedup'], '.2f')}x | "
                f"{_fmt(s['mean_accepted'], '.2f')} | {_fmt(s['acceptance_rate'], '.2f')} | "
                f"{_fmt(s['alpha'], '.2f')} | {_fmt(s['compile_seconds'], '.1f')} | {_fmt(s['lossless'], '')} |")
  return "\n".join(rows)


def agreement_table(summary: dict[str, Any]) -> str:
  rows = ["| method | equal rows | tokens until first divergence |", "|---|---:|---:|"]
  for method, s in summary["methods"].items():
    if s.get("agreement") is not None:
      rows.append(f"| {method} | {_fmt(s['equal_rows'], '.0%')} | {_fmt(s['agreement'], '.0%')} |")
  return "\n".join(rows) if len(rows) > 2 else ""


def plot_speedup(summary: dict[str, Any], path: str) -> None:
  methods = list(summary["methods"])
  speedups = [summary["methods"][m]["speedup"] for m in methods]
  fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(methods), 3.5))
  bars = ax.bar(methods, speedups, color=["0.6" if m == summary["baseline"] else "C0" for m in methods])
  ax.bar_label(bars, labels=[f"{s:.2f}x" for s in speedups])
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_ylim(0, 1.15 * max(speedups + [1.0]))  # room for the labels
  ax.set_ylabel(f"speedup over {summary['baseline']}")
  ax.tick_params(axis="x", labelrotation=20)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_speedup_by_category(summary: dict[str, Any], path: str) -> None:
  methods = [m for m in summary["speedup_by_category"] if m != summary["baseline"]] or [summary["baseline"]]
  categories = list(dict.fromkeys(c for m in methods for c in summary["speedup_by_category"][m]))
  width = 0.8 / len(methods)
  x = np.arange(len(categories))
  fig, ax = plt.subplots(figsize=(2 + 0.7 * len(categories) * max(1, len(methods) / 2), 3.8))
  for i, m in enumerate(methods):
    values = [summary["speedup_by_category"][m].get(c, np.nan) for c in categories]
    ax.bar(x + (i - (len(methods) - 1) / 2) * width, values, width, label=m)
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_xticks(x, categories, rotation=30, ha="right")
  ax.set_ylabel(f"speedup over {summary['baseline']}")
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _json_safe(x):
  """NaN -> None (JSON has no NaN); numpy scalars -> Python."""
  if isinstance(x, dict):
    return {k: _json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_safe(v) for v in x]
  if isinstance(x, np.generic):
    x = x.item()
  if isinstance(x, float) and math.isnan(x):
    return None
  return x


def write(workdir: str, results: dict[str, Any]) -> str:
  """Writes results.json, results.md, speedup.png and speedup_by_category.png; returns the table."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(_json_safe(results), f, indent=1)
  summary = results["summary"]
  table = markdown_table(summary)
  env = results["environment"]
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(f"# {results['name']}\n\n{table}\n\n"
            f"{results['config']['model']} ({results['config']['dtype']}), prompts: {len(results['prompts'])}, "
            f"max_new_tokens {results['config']['max_new_tokens']}, temperature {results['config']['temperature']}, "
            f"batch {results['config']['batch_size']}; jax {env['jax']} on {env['devices']}, "
            f"{env['cpu_count']} CPUs. tokens/s: median over prompt batches; speedup: over "
            f"{summary['baseline']} in the same run; compile s: compiling the program for the first (warmup) call; "
            f"{sum(s['recompiles'] for s in summary['methods'].values())} timed calls compiled a new shape "
            "and were rerun.\n\n")
    agreement = agreement_table(summary)
    if agreement:
      f.write(f"Greedy agreement with {summary['baseline']} (lossless methods agree fully; peers run other "
              "kernels, so near ties can flip a token):\n\n" + agreement + "\n\n")
    f.write("![speedup](speedup.png)\n\n![speedup by category](speedup_by_category.png)\n")
  plot_speedup(summary, os.path.join(workdir, "speedup.png"))
  plot_speedup_by_category(summary, os.path.join(workdir, "speedup_by_category.png"))
  return table
