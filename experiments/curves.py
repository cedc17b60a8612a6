r"""Acceptance-vs-training curves of drafters trained on one budget (configs/train_budget.py), on one log-x plot.

  python -m experiments.curves --workdirs=workdirs/budget [--out=workdirs/budget/curves]

`--workdirs` lists training workdirs, or folders of them (every sub-folder with a metrics.jsonl is a run). Each
run's evaluation points come from its metrics.jsonl (so a run still going is drawn as far as it got), its family,
data and cost from the run.json experiments.train writes when it ends. A publication keeps what it was drawn from:
each run's logs (LOG_FILES, a few hundred kB) are copied to `<out>/runs/<run>/`, and a later call with the same
`--out` reads them back, so the curves of runs whose workdirs are gone (another machine, a wiped disk) are drawn
again from the publication while new runs join them; a run's own workdir, where it exists, wins. Writes to `--out`:
  curves.png    held-out depth-1 top-1 and Spec-Bench tokens per target forward against answer positions seen (log x)
  results.json  per run: positions, wall and CPU time of training, FLOPs per position, the final held-out top-1 per
                depth, Spec-Bench tokens per forward and alpha, the curve, and where the project's target for its
                family would be reached
  results.md    the table of results.json, rendered from it at the precision shown (with each run's comparison
                with the shipped checkpoint, where its workdir holds one: SHIPPED_COMPARISON, and each run trained
                with an option against its family's default run at equal positions: `option_points`)
  RUN.md        the command, the code of the curves and of each run, the machine
  runs/<run>/   each run's LOG_FILES

Where the target of a family (TARGETS) is not reached, it is extrapolated: a line fitted by least squares to the
metric against log10(positions) over the last FIT_POINTS evaluation points, solved for the target. It is an
extrapolation of a curve that must bend eventually, so it says at least how many positions the target would take.
"""

from __future__ import annotations

import glob
import json
import math
import os
import pathlib
import sys
import time
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments.cli import code_commit, environment, write_atomic  # noqa: E402
from specjax.train_drafter import read_metrics  # noqa: E402


# The project's targets (Spec-Bench, greedy, gamma 4 chain): family -> (metric of the evaluation points, value).
TARGETS = {"sequential": ("spec_bench_mean_accepted", 2.2), "parallel": ("spec_bench_mean_accepted", 1.6),
           "exit": ("spec_bench_alpha", 0.4), "exit16": ("spec_bench_alpha", 0.4)}
FIT_POINTS = 3  # the last evaluation points the extrapolation is fitted to
PANELS = (("eval_top1_1", "held-out top-1, depth 1"), ("spec_bench_mean_accepted", "Spec-Bench tokens per forward"))


def run_dirs(paths: Sequence[str]) -> list[str]:
  """The training workdirs among `paths` and their sub-folders (those with a metrics.jsonl), sorted."""
  found = set()
  for path in paths:
    if os.path.isfile(os.path.join(path, "metrics.jsonl")):
      found.add(os.path.normpath(path))
    found.update(os.path.normpath(os.path.dirname(p)) for p in glob.glob(os.path.join(path, "*", "metrics.jsonl")))
  return sorted(found)


def extrapolate(points: list[dict[str, Any]], metric: str, target: float) -> dict[str, Any]:
  """Where `metric` reaches `target`: the first evaluation point that does, else the linear fit of the metric in
  log10(positions) over the last FIT_POINTS points solved for the target (None when the fit does not rise)."""
  measured = [(p["positions"], p[metric]) for p in points if p.get(metric) is not None]
  out: dict[str, Any] = {"metric": metric, "target": target}
  reached = [x for x, y in measured if y >= target]
  if reached:
    return {**out, "reached": True, "positions": reached[0], "method": "measured"}
  out.update(reached=False, method=f"linear in log10(positions) over the last {FIT_POINTS} evaluation points")
  if len(measured) < 2:
    return {**out, "positions": None, "slope_per_decade": None}
  x, y = np.log10([m[0] for m in measured[-FIT_POINTS:]]), np.array([m[1] for m in measured[-FIT_POINTS:]])
  slope, intercept = np.polyfit(x, y, 1)
  positions = 10 ** ((target - intercept) / slope) if slope > 1e-9 else None  # a flat fit reaches nothing
  return {**out, "slope_per_decade": float(slope), "positions": None if positions is None else float(positions)}


# A run's comparison with the shipped checkpoint of its drafter, where one was made:
#   python -m experiments.compare_checkpoints ... --out=<run workdir>/shipped_comparison.json
SHIPPED_COMPARISON = "shipped_comparison.json"
# What a run is read from (experiments.train writes the first three), kept with the publication under RUNS.
LOG_FILES = ("metrics.jsonl", "run.json", "starts.jsonl", SHIPPED_COMPARISON)
RUNS = "runs"
STALLED = 0.25  # an interval between logged steps whose CPU time per wall second is under this share of the run's median


def stalled_seconds(records: list[dict[str, Any]]) -> float:
  """Wall seconds of a run's training in which its process was stopped or starved: over the intervals between logged
  steps whose CPU seconds per wall second fell under STALLED of the run's median, the wall time beyond what the
  interval's CPU time takes at the median rate."""
  intervals = [(b["train_seconds"] - a["train_seconds"], b["train_cpu_seconds"] - a["train_cpu_seconds"])
               for a, b in zip(records, records[1:]) if "train_cpu_seconds" in a and "train_cpu_seconds" in b]
  intervals = [(wall, cpu) for wall, cpu in intervals if wall > 0]
  if not intervals:
    return 0.0
  rate = float(np.median([cpu / wall for wall, cpu in intervals]))
  return float(sum(wall - cpu / rate for wall, cpu in intervals if cpu / wall < STALLED * rate))


def _state(run: dict[str, Any]) -> tuple[str, str]:
  """Where a run stands: what the table says after its name (nothing when it finished), and RUN.md's sentence."""
  if run["finished"]:
    return "", f"finished at commit {run['commit']}"
  if run.get("carried_from"):
    return " (stopped)", "stopped before its budget, its workdir gone"
  if run.get("stopped_at"):
    return (f" (stopped at {run['stopped_at']:g})",
            f"stopped at {run['stopped_at']:g} of its budget (`stop_fraction`: the same command without it goes on)")
  return " (running)", "still training when the curves were drawn"


def read_run(workdir: str) -> dict[str, Any]:
  """One run's summary: its evaluation points from metrics.jsonl, its family, data and final figures."""
  records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
  card = {}
  if os.path.isfile(os.path.join(workdir, "run.json")):
    with open(os.path.join(workdir, "run.json")) as f:
      card = json.load(f)
  starts = read_metrics(os.path.join(workdir, "starts.jsonl"))  # JSON lines, [] where the run logged none
  name = os.path.basename(os.path.normpath(workdir))
  config = card.get("config") or (starts[-1]["config"] if starts else {})
  records = [r for r in records if "positions" in r]
  family = config.get("family") or name.split("-")[0]
  keep = ("step", "positions", "flops", "train_seconds", "train_cpu_seconds", "spec_bench_mean_accepted",
          "spec_bench_alpha")
  points = [{k: v for k, v in r.items() if k in keep or k.startswith("eval_top1_")}
            for r in records if "eval_top1_1" in r]
  last = records[-1] if records else {}
  final = points[-1] if points else {}
  run = {
      "name": name, "workdir": os.path.abspath(workdir), "family": family, "drafter": card.get("drafter"),
      "answers": config.get("data_answers") or None, "objective": config.get("objective") or "kl",
      "finished": bool(card),
      # a run ended at a point of its budget by its last start (`stop_fraction`), to go on later
      "stopped_at": None if card else (config.get("stop_fraction") or None),
      "commit": card.get("environment", {}).get("specjax_commit"), "started": card.get("date"),
      "starts": [{"date": st["date"], "commit": st["commit"], "uncommitted": st.get("uncommitted")} for st in starts],
      "budget_positions": config.get("positions"), "positions": last.get("positions"), "steps": last.get("step"),
      "train_seconds": last.get("train_seconds"), "train_cpu_seconds": last.get("train_cpu_seconds"),
      "stalled_seconds": stalled_seconds(records),
      "flops_per_position": last["flops"] / last["positions"] if last.get("positions") else None,
      "final_top1": {k.removeprefix("eval_top1_"): v for k, v in sorted(final.items()) if k.startswith("eval_top1_")},
      "final_mean_accepted": final.get("spec_bench_mean_accepted"), "final_alpha": final.get("spec_bench_alpha"),
      "curve": points,
  }
  compared = os.path.join(workdir, SHIPPED_COMPARISON)
  if os.path.isfile(compared):
    with open(compared) as f:
      c = json.load(f)
    run["shipped_comparison"] = {
        "prompts": c["prompts"], "gamma": c["gamma"], "max_new_tokens": c["max_new_tokens"],
        "candidate_mean_accepted": c["candidate"]["mean_accepted"], "shipped_mean_accepted": c["shipped"]["mean_accepted"],
        "candidate_score": c["candidate"]["score"], "shipped_score": c["shipped"]["score"],
        "prompts_candidate_better": c["prompts_candidate_better"], "prompts_shipped_better": c["prompts_shipped_better"],
        "replace": c["replace"], "against": c.get("against")}
  if family in TARGETS:
    run["target"] = extrapolate(points, *TARGETS[family])
    if run["target"]["positions"] and run["positions"] and run["train_cpu_seconds"]:
      run["target"]["cpu_hours"] = run["target"]["positions"] * run["train_cpu_seconds"] / run["positions"] / 3600
  return run


POSITIONS_MATCH = 0.01  # two evaluation points stand at equal positions within this share of them


def option_points(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each run trained with an option (another objective, or other answers) against its family's run with the
  defaults (the run named as the family), at the last evaluation point of the run that the default run also has at
  equal positions (within POSITIONS_MATCH: runs on the same data evaluate at the same positions, runs on other data
  at nearly the same), so an option that pays shows there whether or not either run finished."""
  by_name = {r["name"]: r for r in runs}
  found = []
  for r in runs:
    base = by_name.get(r["family"])
    if base is None or base is r or not r.get("curve") or not base.get("curve"):
      continue
    pairs = [(p, q) for p in r["curve"] for q in base["curve"]
             if abs(p["positions"] - q["positions"]) <= POSITIONS_MATCH * p["positions"]]
    if not pairs:
      continue
    ours, other = max(pairs, key=lambda pq: pq[0]["positions"])
    pick = lambda p: {k: v for k, v in p.items() if k.startswith("eval_top1_") or k.startswith("spec_bench_")}
    found.append({"run": r["name"], "against": base["name"], "objective": r.get("objective") or "kl",
                  "answers": r["answers"], "positions": ours["positions"], "against_positions": other["positions"],
                  "run_point": pick(ours), "against_point": pick(other)})
  return found


def _fmt(value, spec: str) -> str:
  return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


METRICS = {"spec_bench_mean_accepted": "tokens per target forward", "spec_bench_alpha": "alpha"}


def target_sentence(run: dict[str, Any]) -> str:
  t = run["target"]
  what = f"{run['name']}: {METRICS[t['metric']]} >= {t['target']}"
  if t["reached"]:
    return f"{what} reached at {t['positions']:,.0f} positions (measured)."
  if t["positions"] is None:
    return f"{what} not reached, and the curve does not rise over its last points: no extrapolation."
  shown = f"{t['cpu_hours']:.0f}" if t.get("cpu_hours") else ""
  hours = f", ~{shown} CPU-hour{'' if shown == '1' else 's'} of training at this run's rate" if shown else ""
  return (f"{what} not reached; extrapolated ({t['method']}, {t['slope_per_decade']:+.3f} per decade): "
          f"~{t['positions']:.2g} positions{hours}.")


def table(results: dict[str, Any]) -> str:
  """The runs' table and the families' target sentences (results.md's, and the publication's)."""
  runs = results["runs"]
  depths = sorted({d for r in runs for d in r["final_top1"]}, key=int)
  lines = ["| run | answers | objective | positions | wall (h) | CPU (h) | GFLOPs / position | "
           + " | ".join(f"top-1 depth {d}" for d in depths) + " | tokens / forward | alpha |",
           "|---|---|---|---:|---:|---:|---:|" + "---:|" * (len(depths) + 2)]
  for r in runs:
    lines.append(
        f"| {r['name']}{_state(r)[0]} "
        f"| {r['answers'] or '-'} | {r.get('objective') or 'kl'} | {_fmt(r['positions'], ',')} "
        f"| {_fmt(r['train_seconds'] and r['train_seconds'] / 3600, '.2f')} "
        f"| {_fmt(r['train_cpu_seconds'] and r['train_cpu_seconds'] / 3600, '.2f')} "
        f"| {_fmt(r['flops_per_position'] and r['flops_per_position'] / 1e9, '.2f')} | "
        + " | ".join(_fmt(r["final_top1"].get(d), ".3f") for d in depths)
        + f" | {_fmt(r['final_mean_accepted'], '.2f')} | {_fmt(r['final_alpha'], '.3f')} |")
  compared = [r for r in runs if "shipped_comparison" in r]
  if compared:
    c0 = compared[0]["shipped_comparison"]
    lines += ["", f"Against the shipped checkpoint of the same drafter, or of the family named where the run's has none "
              f"(`experiments.compare_checkpoints`: held-out prompts of the target's own answers, greedy, a chain of γ "
              f"{c0['gamma']}, {c0['max_new_tokens']} new tokens; the score is tokens per forward over the round's "
              "cost; the run replaces the shipped checkpoint only if it scores higher):", "",
              "| run | prompts | tokens / forward (run) | tokens / forward (shipped) | prompts better (run / shipped) "
              "| verdict |", "|---|---:|---:|---:|---|---|"]
    for r in compared:
      c = r["shipped_comparison"]
      name = r["name"] + (f" (against the shipped {c['against']})" if c.get("against") not in (None, r["drafter"])
                          else "")
      lines.append(f"| {name} | {c['prompts']} | {c['candidate_mean_accepted']:.2f} | "
                   f"{c['shipped_mean_accepted']:.2f} | {c['prompts_candidate_better']} / "
                   f"{c['prompts_shipped_better']} | {'replaces it' if c['replace'] else 'keeps the shipped one'} |")
  options = results.get("options") or []
  if options:
    depths = sorted({k.removeprefix("eval_top1_") for o in options for k in o["run_point"]
                     if k.startswith("eval_top1_")}, key=int)
    lines += ["", "Options at equal positions: each run trained with an option against its family's run with the "
              "defaults, at the last evaluation point both reached at equal positions (run / default):", "",
              "| run | against | positions | " + " | ".join(f"top-1 depth {d}" for d in depths)
              + " | tokens / forward | alpha |", "|---|---|---:|" + "---|" * (len(depths) + 2)]
    for o in options:
      pair = lambda key, spec: (f"{_fmt(o['run_point'].get(key), spec)} / "
                                f"{_fmt(o['against_point'].get(key), spec)}")
      positions = (f"{o['positions']:,}" if o["positions"] == o["against_positions"]
                   else f"{o['positions']:,} / {o['against_positions']:,}")
      lines.append(f"| {o['run']} | {o['against']} | {positions} | "
                   + " | ".join(pair(f"eval_top1_{d}", ".3f") for d in depths)
                   + f" | {pair('spec_bench_mean_accepted', '.2f')} | {pair('spec_bench_alpha', '.3f')} |")
  sentences = [target_sentence(r) for r in runs if "target" in r]
  if sentences:
    lines += ["", "Targets (Spec-Bench, greedy, gamma 4 chain):", ""] + [f"- {s}" for s in sentences]
  lines += ["", "Wall and CPU time are of training alone (evaluation and compilation apart), on a machine shared with "
            "other work: CPU time is the steadier of the two. A run's evaluation points lie along one learning-rate "
            "schedule over its whole budget, so an earlier point is not what a run of that smaller budget would "
            "reach (its rate would have decayed by then), and a line through the last points is a rough guide."]
  stalled = [r for r in runs if r.get("stalled_seconds", 0) >= 60]
  if stalled:
    lines[-1] += (" Wall time that includes stretches in which the run's process was stopped or starved (under "
                  f"{STALLED:.0%} of its median CPU rate): " + "; ".join(
                      f"{r['name']} {r['stalled_seconds'] / 3600:.2f} h" for r in stalled) + ".")
  return "\n".join(lines)


def results_markdown(results: dict[str, Any]) -> str:
  """results.md from results.json."""
  return f"# Drafters on one budget ({results['date']}, commit {results['commit']})\n\n{table(results)}\n"


def _start_code(start: dict[str, Any]) -> str:
  """A start's commit, and for a -dirty one the files it held uncommitted (or that they went unrecorded)."""
  commit = start["commit"] or "an unknown commit"
  if not commit.endswith("-dirty"):
    return commit
  if start.get("uncommitted"):
    return f"{commit} (uncommitted edits to {', '.join(start['uncommitted'])})"
  return f"{commit} (which files it held uncommitted went unrecorded: the run started before starts recorded them)"


def run_markdown(results: dict[str, Any]) -> str:
  """RUN.md: how the curves were made (the command, the code of the curves and of each run, the machine),
  rendered from results.json."""
  env = results["environment"]
  lines = [f"# {results['name']}, {results['date']} {results['time']} UTC", "", "```bash", results["command"], "```", "",
           f"- code: curves drawn at commit {results['commit']}; jax {env['jax']}, Python {env['python']}, "
           f"{env['platform']}, {env['cpu_count']} CPU cores.",
           "- runs (each trained by `python -m experiments.train --config=configs/train_budget.py:<run>`, killed runs "
           "resumed from their last checkpoint; each start's time and code where the run logged them):"]
  for r in results["runs"]:
    state = _state(r)[1]
    if r.get("carried_from"):
      state += (f"; its summary carried over from the publication of {r['carried_from']['date']} (commit "
                f"{r['carried_from']['commit']}), drawn before the publication kept its logs")
    if r.get("starts"):
      state += "; started " + ", ".join(f"{st['date']} at {_start_code(st)}" for st in r["starts"])
    lines.append(f"  - {r['name']}: {state}; {_fmt(r['steps'], ',')} steps, {_fmt(r['positions'], ',')} answer "
                 f"positions of a budget of {_fmt(r['budget_positions'], ',')}.")
  lines += ["", "Files: `results.md` (the table), `results.json` (every run's evaluation points, times and FLOPs, "
            "the targets and their extrapolation), `curves.png` (held-out top-1 and Spec-Bench tokens per forward "
            f"against positions seen, log x), `{RUNS}/<run>/` (the logs each run was read from; "
            "`python -m experiments.curves --workdirs= --out=<this folder>` draws the curves again from them).", ""]
  return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: str) -> None:
  fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.2))
  for ax, (metric, label) in zip(axes, PANELS):
    for r in runs:
      xy = [(p["positions"], p[metric]) for p in r["curve"] if p.get(metric) is not None]
      if xy:
        ax.plot(*zip(*xy), marker="o", label=r["name"])
    lines: dict[float, list[str]] = {}  # target value -> the families aiming at it on this panel
    for family, (target_metric, value) in TARGETS.items():
      if target_metric == metric:
        lines.setdefault(value, []).append(family)
    for value, families in lines.items():
      ax.axhline(value, color="gray", linestyle=":", linewidth=1)
      ax.annotate(f"{', '.join(families)} target", (1.0, value), xycoords=("axes fraction", "data"), ha="right",
                  va="bottom", fontsize=8, color="gray")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: minor labels overlap
    ax.set_xlabel("answer positions seen")
    ax.set_ylabel(label)
    ax.grid(True, which="both", alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def keep_logs(workdir: str, kept: str) -> None:
  """Copies a run's LOG_FILES from its workdir to `kept` (each written atomically, where it changed)."""
  if os.path.abspath(workdir) == os.path.abspath(kept):
    return
  os.makedirs(kept, exist_ok=True)
  for name in LOG_FILES:
    if os.path.isfile(os.path.join(workdir, name)):
      with open(os.path.join(workdir, name), "rb") as f:
        data = f.read()
      copy = pathlib.Path(kept, name)
      if not copy.is_file() or copy.read_bytes() != data:
        write_atomic(str(copy), data)


def curves(workdirs: Sequence[str], out: str, command: str = "python -m experiments.curves") -> dict[str, Any]:
  """Reads the runs of `workdirs` and those kept with an earlier publication in `out` (a workdir wins over the kept
  copy of its run), keeps every run's logs in `<out>/runs/`, and writes results.json, results.md, RUN.md and
  curves.png to `out`. A run the earlier results.json has but no log does is carried over as published."""
  sources = {os.path.basename(d): d for d in run_dirs([os.path.join(out, RUNS)])}
  sources.update((os.path.basename(d), d) for d in run_dirs([w for w in workdirs if w]))
  previous = None
  if os.path.isfile(os.path.join(out, "results.json")):
    with open(os.path.join(out, "results.json")) as f:
      previous = json.load(f)
  carried = [{**r, "carried_from": r.get("carried_from") or {"date": previous["date"], "commit": previous["commit"]}}
             for r in (previous or {}).get("runs", []) if r["name"] not in sources]
  if not sources and not carried:
    raise FileNotFoundError(f"no training run (a folder with metrics.jsonl) in {list(workdirs)} or {out}/{RUNS}")
  for name, workdir in sources.items():
    keep_logs(workdir, os.path.join(out, RUNS, name))
  runs = sorted([read_run(d) for d in sources.values()] + carried, key=lambda r: r["name"])
  now = time.gmtime()
  results = {"name": "train_budget", "command": command, "date": time.strftime("%Y-%m-%d", now),
             "time": time.strftime("%H:%M", now), "commit": code_commit(), "environment": environment(),
             "family_targets": TARGETS, "fit_points": FIT_POINTS, "runs": runs, "options": option_points(runs)}
  os.makedirs(out, exist_ok=True)
  for name, text in (("results.json", json.dumps(results, indent=1)), ("results.md", results_markdown(results)),
                     ("RUN.md", run_markdown(results))):
    write_atomic(os.path.join(out, name), text)
  plot(runs, os.path.join(out, "curves.png"))
  return results


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  results = curves(flags.FLAGS.workdirs, flags.FLAGS.out, "python -m experiments.curves " + " ".join(sys.argv[1:]))
  print(results_markdown(results))
  print(f"wrote {flags.FLAGS.out}/curves.png, results.json, results.md and RUN.md")


def _define_flags():
  """Defined when the command runs, not on import (--out is a benchmark's flag too)."""
  flags.DEFINE_list("workdirs", ["workdirs/budget"], "training workdirs, or folders holding them")
  flags.DEFINE_string("out", "workdirs/budget/curves", "where curves.png, results.json and results.md go")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
