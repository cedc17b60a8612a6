r"""Renders the publication from the runs in results/: `results/INDEX.md`, the tables of docs/ and README's Results
paragraph, so that every number they show is the one in its results.json, at the precision shown.

  python -m experiments.publish            # rewrites results/INDEX.md and every generated block
  python -m experiments.publish --check    # exits 1 when any of them differs from what the files hold

A generated block sits between `<!-- publish:begin NAME -->` and `<!-- publish:end NAME -->` in a Markdown file;
everything outside the markers is written by hand. `BLOCKS` says which file holds each block and what renders it.

A run is a folder of results/ with a RUN.md (command, commit, machine) and, for runs of `experiments.run`, a
results.json; its date is RUN.md's, its commit results.json's (`environment.specjax_commit`). Which runs are
current: runs of the same config (results.json's `name`: the config file and its variant) measure the same thing,
so a newer one replaces an older one where it measured the same method on the same prompts. A run is superseded
once newer runs of its config cover every (method, prompt) it measured, and current in part while they cover
some; a superseded run's folder moves to results/archive/ (`git mv`; the check fails until it has). Code changes
after a run (`CODE_CHANGES`: the ones that change what the runs measure) are listed beside it.

Speedups are the median over prompts of paired speedups (each prompt's tokens/s against autoregressive decoding's
on it, the calls interleaved, repeats averaged before pairing) with a distribution-free 90% interval
(`report.paired_speedups`, `report.median_interval`).
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import json
import pathlib
import re
import sys
import textwrap
from typing import Any, Callable, Sequence

import numpy as np
from absl import app, flags

from experiments import cli, cost_model, curves, projection, report
from specjax.config import shaped_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARCHIVE = "archive"
INDEX = "results/INDEX.md"
FLOOR = 0.95  # the speedup per-category intervals are read against (report.category_table's floor)

_CHECK = flags.DEFINE_bool("check", False, "only compare: exit 1 when a generated block or INDEX.md differs")


@dataclasses.dataclass(frozen=True)
class CodeChange:
  """A change to the code after which earlier runs no longer measure what the code does. `concerns`: which runs it
  touches: "adaptive" (runs with adaptive drafting), "cpu" (runs timed on a CPU), or a shipped checkpoint (runs with
  a method that drafts with it, `drafts_with_shipped`)."""
  commit: str
  committed: datetime.datetime  # UTC
  change: str
  concerns: str


def _utc(text: str) -> datetime.datetime:
  return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M")


CODE_CHANGES = (
    CodeChange("38c672e", _utc("2026-11-30 22:47"), "the shipped sequential MTP module retrained (3000 steps on "
               "5,980 sequences)", "mtp_sequential"),
    CodeChange("0b98980", _utc("2026-12-01 19:33"), "CPU kernels on weights packed once as column panels", "cpu"),
    CodeChange("8d62d4e", _utc("2026-12-01 23:16"), "adaptive drafting: drafters with their own cache follow plain "
               "steps W at a time (catch-up)", "adaptive"),
    CodeChange("cd5be77", _utc("2026-12-02 00:03"), "adaptive drafting: plain steps age the acceptance evidence by "
               "plain_memory", "adaptive"),
    CodeChange("9ab7f1e", _utc("2026-12-02 06:36"), "adaptive drafting: a keep bar and a go bar per slot", "adaptive"),
    CodeChange("3e947e9", _utc("2026-12-02 10:06"), "adaptive drafting: optimism under uncertainty", "adaptive"),
    CodeChange("4545c71", _utc("2026-12-02 13:10"), "decode attention: 16 queries per pass, one per vector lane",
               "cpu"),
    CodeChange("7b05172", _utc("2026-12-02 13:20"), "adaptive drafting plans with forward costs measured with the "
               "lane attention", "adaptive"),
    CodeChange("dde1614", _utc("2026-12-03 08:12"), "adaptive drafting scores the plain steps a drafter follows",
               "adaptive"),
    CodeChange("b24eb40", _utc("2026-12-03 12:12"), "adaptive drafting: a round that would draft first scores the "
               "pending plain steps and chooses again", "adaptive"),
    CodeChange("d5d14cb", _utc("2026-12-03 12:42"), "adaptive drafting chooses again only after the pending plain "
               "steps were scored", "adaptive"),
    CodeChange("40d18d8", _utc("2026-12-04 10:14"), "adaptive drafting: scored plain steps and choosing again "
               "removed", "adaptive"),
    CodeChange("4a70e46", _utc("2026-12-04 10:20"), "adaptive drafting: drafters follow every plain step (no "
               "catch-up window)", "adaptive"),
    CodeChange("91454a4", _utc("2026-12-05 00:47"), "the shipped parallel MTP heads replaced by the ones trained on "
               "one budget (1.5M positions of the target's own answers)", "mtp_parallel"),
    CodeChange("926984a", _utc("2026-12-05 04:37"), "the shipped parallel MTP heads trained on 2M more positions of "
               "the target's own answers", "mtp_parallel"),
    CodeChange("e8e7cfe", _utc("2026-12-05 05:12"), "the shipped exit adapter replaced by the one trained on one budget "
               "(after 3 layers, 1.5M positions of the target's own answers)", "exit_adapter"),
    CodeChange("5602652", _utc("2026-12-05 08:10"), "the shipped distilled draft replaced by the one trained on one "
               "budget (4 layers, 1.5M positions of the target's own answers)", "draft_model"),
)


@dataclasses.dataclass
class Run:
  """One folder of results/: what its RUN.md and results.json say about it."""
  folder: str  # relative to results/, e.g. "compare_drafters" or "archive/adaptive_by_category-trained"
  path: pathlib.Path  # the folder itself
  heading: str  # RUN.md's first line, without the "# "
  started: datetime.datetime  # RUN.md's date, and its start time where it gives one (else midnight)
  commit: str | None
  results: dict[str, Any] | None  # results.json, for runs of experiments.run and experiments.compile_for
  backend: str | None  # "cpu", "gpu", ...: where it was timed (None: not timed)

  @property
  def name(self) -> str:
    return self.folder.rsplit("/", 1)[-1]

  @property
  def config(self) -> str:
    """results.json's `name` (config file and variant), with the weights where a timed run overrode float32 (a
    bfloat16 run, or one of the GGUF's quantized blocks, times other programs, and supersedes none of float32's); a
    folder without one is a config of its own."""
    if not self.results:
      return self.name
    config, name = self.results.get("config", {}), self.results["name"]
    if self.timed and config.get("quantized"):  # a variant that loads quantized names it (bench_peers-quantized)
      return name if "quantized" in name else f"{name} (quantized)"
    dtype = config.get("dtype", "float32") if self.timed else "float32"
    return name + ("" if dtype == "float32" else f" ({dtype})")

  @property
  def timed(self) -> bool:
    """A run of experiments.run: methods timed against a baseline on prompts."""
    return bool(self.results) and "summary" in self.results

  @property
  def compiled(self) -> bool:
    """A run of experiments.compile_for: programs compiled for TPU topologies, no method timed."""
    return bool(self.results) and "projections" in self.results and "records" in self.results

  @property
  def modeled(self) -> bool:
    """A run of experiments.cost_model: the analytic cost model against measured costs, and its projections."""
    return bool(self.results) and "validation" in self.results

  @property
  def trained(self) -> bool:
    """The curves of training runs (experiments.curves): no method timed."""
    return bool(self.results) and "runs" in self.results and not self.timed

  @property
  def records(self) -> list[dict]:
    return self.results["records"] if self.timed else []

  @property
  def baseline(self) -> str:
    return self.results["summary"]["baseline"]

  def methods(self) -> list[str]:
    """The methods compared with the baseline, in the run's order."""
    if not self.timed:
      return []
    return [m for m in self.results["summary"]["methods"] if m != self.baseline]

  def method_spec(self, method: str) -> dict:
    if method == report.CONTROL and self.results["config"].get("control"):
      return {"name": method}  # added by the runner (experiments/run.py check_methods)
    return next(m for m in self.results["config"]["methods"] if m["name"] == method)

  def training_run(self, method: str, runs: Runs) -> dict:
    """The results/train_budget entry whose export `method` drafted with: the run whose workdir holds the checkpoint
    the method's config names (configs/common.budget_method)."""
    checkpoint = self.method_spec(method).get("checkpoint")
    found = [r for r in runs["train_budget"].results["runs"]
             if checkpoint and pathlib.PurePath(checkpoint).parent.name == pathlib.PurePath(r["workdir"]).name]
    if len(found) != 1:
      raise ValueError(f"{self.folder}: {method} drafts with {checkpoint!r}, which {len(found)} runs of "
                       "results/train_budget trained")
    return found[0]

  def adaptive(self, method: str) -> bool:
    """Whether the method drafted adaptively: its own `adaptive`, else the config's (experiments.run's rule)."""
    spec = self.method_spec(method)
    own = spec.get("adaptive")
    value = self.results["config"]["adaptive"] if own is None else own
    return bool(spec.get("drafter")) and (isinstance(value, dict) or bool(value))  # a dict: its options

  def cells(self) -> set[tuple[str, int]]:
    """(method, question id) of every timed call but the baseline's."""
    return {(r["method"], q) for r in self.records if r["method"] != self.baseline for q in r["question_ids"]}

  def categories(self) -> list[str]:
    return list(dict.fromkeys(p["category"] for p in self.results["prompts"]))

  def category_of(self, question_id: int) -> str:
    return next(p["category"] for p in self.results["prompts"] if p["question_id"] == question_id)

  def categories_of(self, method: str) -> set[str]:
    """The categories on which the run timed `method`."""
    return {r["category"] for r in self.records if r["method"] == method}

  def concerned_by(self, change: CodeChange) -> bool:
    if self.commit and self.commit.startswith(change.commit):
      return False
    if change.committed <= self.started:
      return False
    if change.concerns == "adaptive":
      return bool(self.results) and any(self.adaptive(m) for m in self.methods())
    if change.concerns == "cpu":
      return self.backend == "cpu"
    return bool(self.results) and any(drafts_with_shipped(self.method_spec(m), change.concerns)
                                      for m in self.methods())

  def date(self) -> str:
    return self.started.strftime("%Y-%m-%d %H:%M" if self.started.time() != datetime.time() else "%Y-%m-%d")

  def checkpoints_used(self) -> list[str]:
    """The checkpoint files the run's methods decoded with, by path from the repository's root: those they name and
    the shipped ones they draft with (`drafts_with_shipped`)."""
    if not self.timed:
      return []
    model = self.results["config"].get("model")
    paths = set()
    for m in self.methods():
      spec = self.method_spec(m)
      if spec.get("checkpoint"):
        paths.add(spec["checkpoint"])
      paths.update(f"specjax/checkpoints/{model}/{c}.safetensors" for c in SHIPPED if drafts_with_shipped(spec, c))
    return sorted(paths)

  def checkpoints_text(self, root: pathlib.Path) -> str:
    """Whether the checkpoints the run decoded with are the files in the checkout: "as decoded", "changed since: ..."
    (the sha256 its results.json recorded differs), "not in the checkout: ...", "not recorded" (a run from before
    results.json kept them), or "–" (none)."""
    used = self.checkpoints_used()
    if not used:
      return "–"
    recorded = (self.results.get("fingerprint") or {}).get("checkpoints")
    if recorded is None:
      return "not recorded"
    now = {path: _file_digest(root / path) for path in used}
    changed = [p for p in used if now[p] is not None and recorded.get(p) != now[p]]
    absent = [p for p in used if now[p] is None]
    parts = ([f"changed since: {', '.join(changed)}"] if changed else []) + (
        [f"not in the checkout: {', '.join(absent)}"] if absent else [])
    return "; ".join(parts) or "as decoded"


@functools.cache
def _file_digest(path: pathlib.Path) -> str | None:
  return cli.file_digest(str(path))


# Drafters that draft with their shipped checkpoint unless a method gives them another (configs/common.py's methods
# declare no `needs` for them); the other shipped checkpoints are a method's `needs`.
SHIPPED_BY_DEFAULT = ("mtp_parallel", "mtp_sequential")
SHIPPED = ("exit_adapter", "draft_model", "mtp_parallel", "mtp_sequential")  # specjax/checkpoints/<model>/<name>


def drafts_with_shipped(spec: dict, checkpoint: str) -> bool:
  """Whether a run's method (its spec in results.json) drafts with the shipped checkpoint `checkpoint` ("exit_adapter",
  "draft_model", "mtp_parallel", "mtp_sequential"): it `needs` it, or it is an MTP drafter given no checkpoint of its
  own (a budget run's `checkpoint`, an options `path`)."""
  if checkpoint in (spec.get("needs") or ()):
    return True
  return (checkpoint in SHIPPED_BY_DEFAULT and spec.get("drafter") == checkpoint and "checkpoint" not in spec
          and spec.get("options", {}).get("path") in (None, "default"))


def _started(run_md: str) -> datetime.datetime:
  """RUN.md's date (its first line) and start time: "HH:MM UTC" in its first line, or the "(HH:MM to ..." of
  its first section's wall time."""
  heading, _, rest = run_md.partition("\n")
  date = re.search(r"\d{4}-\d{2}-\d{2}", heading)
  if date is None:
    raise ValueError(f"RUN.md's first line has no date (YYYY-MM-DD): {heading!r}")
  first_section = rest.split("\n## ", 1)[0]
  clock = (re.search(r"(\d{2}:\d{2}) UTC", heading) or re.search(r"\((\d{2}:\d{2}) to", first_section))
  return _utc(f"{date.group()} {clock.group(1) if clock else '00:00'}")


def _backend(folder: pathlib.Path, results: dict | None) -> str | None:
  if results:
    return results["environment"]["backend"] if "summary" in results else None  # compiled, not timed
  for path in sorted(folder.glob("*.json")):
    backend = json.loads(path.read_text()).get("backend")
    if backend:
      return backend
  if any("CpuDevice" in path.read_text() for path in folder.glob("*.txt")):
    return "cpu"
  return None


class Runs(dict):
  """Runs by folder name, and the checkout they belong to."""

  def __init__(self, root: pathlib.Path):
    super().__init__()
    self.root = root


def load_runs(root: pathlib.Path = ROOT) -> Runs:
  """Every folder of results/ and results/archive/ with a RUN.md, by folder name."""
  results_dir = root / "results"
  runs = Runs(root)
  for run_md in sorted([*results_dir.glob("*/RUN.md"), *results_dir.glob(f"{ARCHIVE}/*/RUN.md")]):
    folder = run_md.parent
    text = run_md.read_text()
    results_json = folder / "results.json"
    results = json.loads(results_json.read_text()) if results_json.exists() else None
    commit = results["environment"]["specjax_commit"] if results else None
    if commit is None:
      found = re.search(r"commit ([0-9a-f]{7,40})", text)
      commit = found.group(1) if found else None
    run = Run(folder=folder.relative_to(results_dir).as_posix(), path=folder,
              heading=text.partition("\n")[0].lstrip("# "), started=_started(text), commit=commit, results=results,
              backend=_backend(folder, results))
    if run.name in runs:
      raise ValueError(f"two results folders named {run.name}: {runs[run.name].folder} and {run.folder}")
    runs[run.name] = run
  return runs


@dataclasses.dataclass
class Status:
  """Which newer runs of the same config replace which (method, prompt) cells of a run."""
  replaced_by: list[tuple[Run, set[tuple[str, int]]]]
  remaining: set[tuple[str, int]]

  @property
  def superseded(self) -> bool:
    return bool(self.replaced_by) and not self.remaining


# Methods renamed since: the results.json of an earlier run names them so (configs/common.py's METHODS today).
FORMER_NAMES = {"layer_skip_exit24": ("layer_skip_24",), "layer_skip_trained_exit": ("layer_skip_trained",)}


def current_name(method: str) -> str:
  """A method's name today, also for a variant named with a suffix ("layer_skip_24_g2": "layer_skip_exit24_g2")."""
  for current, former_names in FORMER_NAMES.items():
    for former in former_names:
      if method == former or (method.startswith(former + "_") and not method.startswith(current)):
        return current + method[len(former):]
  return method


def newest_first(runs: Runs, config: str) -> list[Run]:
  """The runs of `config`, newest first."""
  return sorted((r for r in runs.values() if r.config == config), key=lambda r: r.started, reverse=True)


def status(run: Run, runs: Runs) -> Status:
  """Newer runs of the run's config, newest first, each taking the cells it measured again (a renamed method's
  cells under either name)."""
  remaining = run.cells()
  newer = [r for r in newest_first(runs, run.config) if r.started > run.started]
  replaced_by = []
  for other in newer:
    measured = {(current_name(m), q) for m, q in other.cells()}
    taken = {(m, q) for m, q in remaining if (current_name(m), q) in measured}
    if taken:
      replaced_by.append((other, taken))
      remaining -= taken
  return Status(replaced_by, remaining)


# ---------------------------------------------------------------------------------------------------------------
# Formatting


def _link(run: Run, prefix: str) -> str:
  return f"[`{run.name}`]({prefix}{run.folder}/RUN.md)"


def speedup_cell(ratios: Sequence[float]) -> str:
  """The median of paired speedups and its 90% interval: "1.23x (1.20–1.25)"; the number of pairs where they are
  too few for an interval (each ratio is one prompt batch: `report.paired_speedups`)."""
  if not ratios:
    return "–"
  interval = report.median_interval(ratios)
  bounds = f"{interval[0]:.2f}–{interval[1]:.2f}" if interval else f"{len(ratios)} prompts"
  return f"{np.median(ratios):.2f}x ({bounds})"


def _num(x: float | None, spec: str) -> str:
  return "–" if x is None else format(x, spec)


def split_words(config: dict) -> str:
  """Which side of the dev/test split a run's prompts came from, as words after their description ("" for runs that
  took every question, as runs before the split did)."""
  split = config.get("prompts", {}).get("split", "")
  return f" ({split} side of the dev/test split)" if split else ""


def _describe_prompts(run: Run) -> str:
  prompts, categories = run.results["prompts"], run.categories()
  names = "Spec-Bench's 13 categories" if len(categories) == 13 else ", ".join(categories)
  min_tokens = run.results["config"].get("min_prompt_tokens", 0)
  longer = (f" (plain text, each after the questions before it until it holds >= {min_tokens:,} tokens)"
            if min_tokens else "") + split_words(run.results["config"])
  if len(prompts) % len(categories):
    return f"{len(prompts)} prompts of {names}{longer}"
  each = len(prompts) // len(categories)
  return f"{each} prompt{'s' if each != 1 else ''} of each of {names}{longer}"


def _describe_model(config: dict[str, Any]) -> str:
  """"gemma3-270m bfloat16: " for a run of another model or weights than SmolLM2-135M in float32 (most runs), else
  nothing ("smollm2-135m quantized (GGUF blocks): " for its GGUF's quantized blocks, `report.weights`)."""
  model, weights = config.get("model", "smollm2-135m"), report.weights(config)
  return "" if (model, weights) == ("smollm2-135m", "float32") else f"{model} {weights}: "


def describe(run: Run) -> str:
  """What a run measured, from its results.json (or RUN.md's title for a folder without one)."""
  if not run.results:
    outputs = sorted(p.name for p in run.path.glob("*") if p.suffix in (".txt", ".json"))
    title = re.sub(r",? \d{4}-\d{2}-\d{2}.*$", "", run.heading)
    return f"{title} ({', '.join(outputs)})" if outputs else title
  if run.compiled:
    return describe_compiled(run.results)
  if run.modeled:
    return describe_modeled(run.results)
  if run.trained:
    return describe_trained(run.results)
  config = run.results["config"]
  methods = run.methods()
  fixed_at: dict[str, list[int]] = {}
  for m in methods:
    found = re.fullmatch(r"(.+)_g(\d+)", m)
    if found and found.group(1) in methods:
      fixed_at.setdefault(found.group(1), []).append(int(found.group(2)))
  listed = [m for m in methods if not any(m == f"{base}_g{g}" for base, gs in fixed_at.items() for g in gs)]
  drafted = [m for m in methods if run.method_spec(m).get("drafter")]
  adaptive = [m for m in drafted if run.adaptive(m)]
  mode = ("adaptive drafting" if len(adaptive) == len(drafted) else "fixed γ" if not adaptive
          else "adaptive drafting and fixed γ")
  if fixed_at:
    gammas = sorted({g for gs in fixed_at.values() for g in gs})
    mode = f"adaptive drafting, and each at fixed γ {', '.join(map(str, gammas))}"
  temperatures = config.get("temperatures") or [config["temperature"]]
  sampling = "greedy" if list(temperatures) == [0] else f"temperature {', '.join(map(str, temperatures))}"
  batches = config.get("batch_sizes") or [config["batch_size"]]
  return (f"{_describe_model(config)}{', '.join(listed)} ({mode}); {_describe_prompts(run)}; "
          f"{config['max_new_tokens']} new tokens, "
          f"{sampling}, batch {', '.join(map(str, batches))}, {config['repeats']} repeat"
          f"{'s' if config['repeats'] != 1 else ''}")


def describe_compiled(results: dict[str, Any]) -> str:
  """What a compile_for run compiled: its programs' count and statuses, models and topologies (TPU or GPU)."""
  records = results["records"]
  counts = {s: sum(r["status"] == s for r in records) for s in ("compiled", "does_not_fit", "failed")}
  models = ", ".join(dict.fromkeys(r["model"] for r in records))
  topologies = ", ".join(dict.fromkeys(r["topology"] for r in records))
  return (f"{len(records)} programs of {models} for {topologies}, compiled without the devices: "
          f"{counts['compiled']} compiled, {counts['does_not_fit']} do not fit, {counts['failed']} failed")


def describe_modeled(results: dict[str, Any]) -> str:
  """What a cost_model run compared and projected."""
  rows = results["validation"]
  within = sum(r["within"] for r in rows)
  measurements = list(dict.fromkeys(r["source"].split(" ")[0] for r in rows))
  projected = {(p["model"], p["topology"], p["batch"]) for p in results["projections"]}
  return (f"the analytic cost model against {len(rows)} measured costs of {len(measurements)} measurements "
          f"({within} within max({results['tolerance']:.0%}, {results['floor']})), and {len(projected)} projected "
          "layouts (model, TPU topology, batch)")


def compile_run_line(run: Run, prefix: str) -> str:
  """A compile_for run: its commit, time and what it compiled. A run resumed from the records of stopped sittings
  (compile_for.compile_log) measured wall and CPU time in its last sitting only: its line gives the compile time
  summed over all its programs instead."""
  r = run.results
  cores = r["machine"]["cores"]
  took = (f"{r['compile_seconds'] / 60:.0f} min of compiling summed over its programs, in sittings resumed from its "
          f"records, on {cores} shared cores" if r.get("resumed_records") else
          f"{r['cpu_seconds'] / 60:.0f} min of CPU time and {r['wall_seconds'] / 60:.0f} min wall on {cores} shared "
          "cores")
  return (f"{_link(run, prefix)} (commit {run.commit}, {run.date()} UTC, {took}"
          + (f", libtpu {r['libtpu']}" if r.get("libtpu") else "") + f"): {describe_compiled(r)}.")


def largest_programs_table(results: dict[str, Any]) -> str | None:
  """Per model and topology, the compiled program a user runs (not the loop-free steps) that takes the most HBM per
  chip; None where a run built such programs for one model and topology or none."""
  user = [r for r in results["records"] if r["kind"] != "steps"]
  targets = list(dict.fromkeys((r["model"], r["topology"]) for r in user))
  if len(targets) < 2:
    return None
  rows = ["| model | topology | mesh (data, model) | programs compiled | largest per chip | GiB per chip | of HBM | "
          "not compiled |", "|---|---|---|---:|---|---:|---:|---|"]
  for model, topology in targets:
    here = [r for r in user if (r["model"], r["topology"]) == (model, topology)]
    compiled = [r for r in here if r["status"] == "compiled"]
    mesh = " x ".join(map(str, here[0]["mesh"]))
    missed = ", ".join(f"{_program_label(r)} ({r['status'].replace('_', ' ')})" for r in here
                       if r["status"] != "compiled") or "–"
    big = max(compiled, key=lambda r: r["bytes_per_device"], default=None)
    largest = ("– | – | –" if big is None else
               f"{_program_label(big)} | {big['bytes_per_device'] / 2**30:.2f} | {big['hbm_fraction']:.0%}")
    rows.append(f"| {model} | {topology} | {mesh} | {len(compiled)} of {len(here)} | {largest} | {missed} |")
  return "\n".join(rows)


def int8_table(results: dict[str, Any]) -> str | None:
  """A compile run's programs with int8 weights beside their twins of the run's dtype (compile_for.weights_rows), or
  None where it compiled none."""
  if not any(r.get("weights") == "int8" for r in results["records"]):
    return None
  from experiments import compile_for  # jax and the TPU compiler's settings: only where a run has such programs
  return "\n".join(compile_for.weights_rows(results["records"])) or None


def describe_trained(results: dict[str, Any]) -> str:
  """What a run of experiments.curves drew: its training runs, finished or not, and their budget."""
  runs = results["runs"]
  finished = sum(r["finished"] for r in runs)
  budgets = sorted({r["budget_positions"] for r in runs if r["budget_positions"]})
  return (f"acceptance-vs-training curves of {len(runs)} drafter training runs ({', '.join(r['name'] for r in runs)}; "
          f"{finished} finished)" + (f" on a budget of {', '.join(f'{b:,}' for b in budgets)} answer positions"
                                     if budgets else ""))


def run_line(run: Run, prefix: str) -> str:
  """One sentence naming a run: folder, commit, date, what it measured, the baseline's speed, losslessness."""
  summary = run.results["summary"]
  baseline = summary["methods"][run.baseline]["tokens_per_second"]
  lossless = {True: "; every output equal to autoregressive decoding's, token for token",
              False: "; **LOSSLESS CHECK FAILED** (results.md names the calls)", None: ""}[summary.get("all_lossless")]
  return (f"{_link(run, prefix)} (commit {run.commit}, {run.date()} UTC): {describe(run)}; autoregressive decoding "
          f"{baseline:.1f} tokens/s{lossless}.")


# ---------------------------------------------------------------------------------------------------------------
# results/INDEX.md


def _cells_text(run: Run, cells: set[tuple[str, int]]) -> str:
  """Cells as methods on categories ("draft_model, layer_skip_trained_exit on every category"); a category of which
  only some prompts are among the cells is marked so."""
  groups: dict[str, list[str]] = {}
  for method in run.methods():
    taken = {q for m, q in cells if m == method}
    if not taken:
      continue
    timed = {q for m, q in run.cells() if m == method}
    categories = [c for c in run.categories() if any(run.category_of(q) == c for q in taken)]
    where = ("every category" if set(categories) == run.categories_of(method) and len(categories) > 1
             else ", ".join(categories))
    if any(run.category_of(q) in categories for q in timed - taken):
      where += " (some prompts)"
    groups.setdefault(where, []).append(method)
  return "; ".join(f"{', '.join(methods)} on {where}" for where, methods in groups.items())


def index(runs: Runs) -> str:
  lines = ["# Results index", "",
           "Generated by `python -m experiments.publish` from each folder's results.json and RUN.md (do not edit by "
           "hand). A run is superseded once newer runs of the same config (results.json's `name`) have measured "
           "every method it measured on the same prompts, and current in part while they cover some; superseded "
           "folders live in `archive/`. *Code changed since*: the changes listed below that came after the run "
           "and touch what it measured. *Checkpoints*: whether the checkpoint files the run decoded with are the "
           "ones in the checkout, by the sha256 its results.json recorded (runs before that: not recorded). A "
           "commit ending in -dirty ran from a tree with uncommitted edits (its RUN.md says which).", "",
           "| folder | config | commit | date (UTC) | what it measured | status | code changed since | checkpoints |",
           "|---|---|---|---|---|---|---|---|"]
  for run in sorted(runs.values(), key=lambda r: (r.started, r.name)):
    state = status(run, runs)
    if state.superseded:
      text = "superseded by " + ", ".join(_link(other, "") for other, _ in state.replaced_by)
    elif state.replaced_by:
      text = "current in part; " + "; ".join(
          f"superseded by {_link(other, '')} for {_cells_text(run, cells)}" for other, cells in state.replaced_by)
    else:
      text = "current"
    changes = ", ".join(c.commit for c in CODE_CHANGES if run.concerned_by(c)) or "–"
    lines.append(f"| {_link(run, '')} | {run.config} | {run.commit or '–'} | {run.date()} | {describe(run)} | "
                 f"{text} | {changes} | {run.checkpoints_text(runs.root)} |")
  lines += ["", "## Code changes", "", "| commit | committed (UTC) | change | concerns |", "|---|---|---|---|"]
  lines += [f"| {c.commit} | {c.committed:%Y-%m-%d %H:%M} | {c.change} | {c.concerns} |" for c in CODE_CHANGES]
  return wrap("\n".join(lines)) + "\n"


def misplaced(runs: Runs) -> list[str]:
  """Folders whose place does not match their status: superseded ones belong in archive/, others not."""
  wrong = []
  for run in runs.values():
    archived = run.folder.startswith(f"{ARCHIVE}/")
    if status(run, runs).superseded != archived:
      where = f"results/{ARCHIVE}/{run.name}" if not archived else f"results/{run.name}"
      wrong.append(f"results/{run.folder} is {'superseded' if not archived else 'current'}: git mv it to {where}")
  return wrong


# ---------------------------------------------------------------------------------------------------------------
# Tables


def _paired(run: Run, method: str, records: Sequence[dict] | None = None) -> list[float]:
  return report.paired_speedups(run.records if records is None else records, method, run.baseline)


def category_block(run: Run, prefix: str, methods: Sequence[str] | None = None) -> str:
  """Per category (rows) and method (columns): the median paired speedup and its 90% interval, then every pair of
  the run, the share of rounds that were plain target steps, and how many categories' intervals lie above
  `FLOOR`, contain it, or lie below it, read at the precision shown. With three methods or fewer each cell also
  gives its plain rounds."""
  methods = list(methods or run.methods())
  per_cell = len(methods) <= 3
  intervals = {m: report.category_intervals(run.records, m, run.baseline) for m in methods}
  rows = ["| category (prompts) | " + " | ".join(f"`{m}`" for m in methods) + " |", "|---|" + "---:|" * len(methods)]

  def plain(records: Sequence[dict]) -> str:
    share = report.plain_share(records)
    return "" if share is None else f", {share:.0%} plain"

  for category in run.categories():
    pairs = max(intervals[m][category]["pairs"] for m in methods if category in intervals[m])
    cells = []
    for m in methods:
      records = [r for r in run.records if r["category"] == category]
      cell = speedup_cell(_paired(run, m, records))
      if per_cell:
        cell += plain([r for r in records if r["method"] == m])
      cells.append(cell)
    rows.append(f"| {category} ({pairs}) | " + " | ".join(cells) + " |")
  pairs = max(len(_paired(run, m)) for m in methods)
  rows.append(f"| all {pairs} prompts | " + " | ".join(speedup_cell(_paired(run, m)) for m in methods) + " |")
  shares = [report.plain_share([r for r in run.records if r["method"] == m]) for m in methods]
  rows.append("| plain rounds | " + " | ".join(
      "–" if s is None else "100% (never drafts)" if s == 1 else f"{s:.0%}" for s in shares) + " |")
  verdicts = []
  for m in methods:  # read at the precision shown, so that the counts agree with the cells above them
    shown = [(float(f"{i['low']:.2f}"), float(f"{i['high']:.2f}"))
             for i in intervals[m].values() if i["low"] is not None]
    verdicts.append(f"{sum(low > FLOOR for low, _ in shown)} / {sum(low <= FLOOR <= high for low, high in shown)} / "
                    f"{sum(high < FLOOR for _, high in shown)}")
  rows.append(f"| intervals above / containing / below {FLOOR:.2f}x | " + " | ".join(verdicts) + " |")
  return run_line(run, prefix) + "\n\n" + "\n".join(rows)


def compare_drafters_block(runs: Runs, prefix: str, folder: str = "compare_drafters") -> str:
  """A fixed-γ comparison (`folder`), each method with Leviathan's prediction from its costs on this CPU and its
  accelerator projection (experiments/projection.py: its round's costs by the analytic cost model), and the share of
  its tokens that came from drafts."""
  run = runs[folder]
  modeled = projection.read(str(runs.root / projection.COSTS_FILE))
  rows = ["| method | γ | speedup (paired median, 90% interval) | mean accepted | alpha | from drafts | "
          f"accepted at k = 1 / 2 / 3 / 4 | c | r | predicted | {_projected_header()} |",
          "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
  for m in run.methods():
    s = run.results["summary"]["methods"][m]
    per_position = " / ".join(f"{a:.2f}" for a in s["acceptance_per_position"] or [])
    projected = projection.project(dict(s, adaptive=run.adaptive(m)), modeled, m)
    from_drafts = report.draft_share([r for r in run.records if r["method"] == m])
    rows.append(f"| `{m}` | {s['gamma']} | {speedup_cell(_paired(run, m))} | {s['mean_accepted']:.2f} | "
                f"{_num(s['alpha'], '.2f')} | {_num(from_drafts, '.0%')} | {per_position} | "
                f"{_num(s.get('draft_cost'), '.3f')} | "
                f"{_num(s.get('verify_cost'), '.2f')} | {_num(s.get('predicted_speedup'), '.2f')} | "
                f"{_num(projected, '.2f')} |")
  efficiency = [s["efficiency"] for m, s in run.results["summary"]["methods"].items() if s.get("efficiency")]
  return (run_line(run, prefix) + "\n\n" + "\n".join(rows) + "\n\n" +
          f"Measured / predicted (the summary's ratio of median tokens/s over the prediction): "
          f"{min(efficiency):.2f}–{max(efficiency):.2f}.")


def data_block(runs: Runs, prefix: str, folder: str = "compare_drafters-data") -> str:
  """The data control (configs/compare_drafters.py:data): the fixed-γ table of `folder` and, paired in the same run,
  the module trained on the target's own answers over the one trained on ShareGPT's, with the held-out top-1 of
  both training runs (results/train_budget) at their equal positions."""
  run = runs[folder]
  modules = [(m, run.training_run(m, runs)) for m in run.methods() if run.method_spec(m).get("checkpoint")]
  trained = {r["answers"]: (m, r) for m, r in modules}
  if sorted(trained) != ["regenerated", "sharegpt"]:
    raise ValueError(f"{folder}: the data control pairs a module trained on each kind of answers, not {sorted(trained)}")
  (own, own_run), (other, other_run) = trained["regenerated"], trained["sharegpt"]
  top1 = {name: " / ".join(f"{r['final_top1'][d]:.3f}" for d in sorted(r["final_top1"], key=int))
          for name, r in (("own", own_run), ("other", other_run))}
  ratios = report.paired_speedups(run.records, own, other)
  return (compare_drafters_block(runs, prefix, folder) + "\n\n" +
          f"Paired in this run, `{own}` over `{other}` (median over {len(ratios)} prompts, 90% interval): "
          f"{speedup_cell(ratios)}. Held-out top-1 by depth on the target's own answers "
          f"({_link(runs['train_budget'], prefix)}), at {own_run['positions']:,} and {other_run['positions']:,} "
          f"training positions: {top1['own']} ({own_run['answers']} answers) against {top1['other']} "
          f"({other_run['answers']} answers).")


def _projected_header() -> str:
  """The column of the accelerator projection (experiments/projection.py)."""
  return f"projected on TPU {projection.TOPOLOGY}, batch {projection.BATCH}"


def trees_block(runs: Runs, prefix: str, folder: str = "trees") -> str:
  """A run of configs/trees.py (`folder`): each drafter's chain and its trees (`<method>_tree<N>`), fixed rounds:
  tokens per target forward, acceptance by depth, the paired speedup over autoregressive decoding and over the
  drafter's own chain (the same prompts and repeat), and the accelerator projection from the round's costs by the
  analytic cost model."""
  run = runs[folder]
  modeled = projection.read(str(runs.root / projection.COSTS_FILE))
  summary = run.results["summary"]["methods"]
  rows = ["| drafter | nodes | tokens per forward | accepted at depth 1 / 2 / 3 / 4 | speedup (paired median, 90% "
          f"interval) | over its chain | {_projected_header()} |",
          "|---|---:|---:|---|---:|---:|---:|"]
  chains = [m for m in run.methods() if summary[m].get("gamma") and not summary[m].get("tree_nodes")]
  for chain in chains:
    trees = sorted((m for m in run.methods() if m.startswith(f"{chain}_tree") and summary[m].get("tree_nodes")),
                   key=lambda m: summary[m]["tree_nodes"])
    for m in [chain, *trees]:
      s = summary[m]
      depths = " / ".join(_num(a, ".2f") for a in s["acceptance_per_position"] or [])  # –: no node that deep
      projected = projection.project(dict(s, adaptive=run.adaptive(m)), modeled, m)
      over_chain = speedup_cell(report.paired_speedups(run.records, m, chain)) if m != chain else "–"
      rows.append(f"| `{chain}` | {s.get('tree_nodes') or 'chain'} | {s['mean_accepted']:.2f} | {depths} | "
                  f"{speedup_cell(_paired(run, m))} | {over_chain} | {_num(projected, '.2f')} |")
  return (run_line(run, prefix) + " Every method drafts every round, its chain's γ deep (no adaptive drafting); a "
          "tree of N nodes is verified in one forward over N + 1 tokens; *over its chain*: paired with the drafter's "
          "chain on the same prompt.\n\n" + "\n".join(rows))


def compare_drafters_by_category_block(runs: Runs, prefix: str) -> str:
  return category_block(runs["compare_drafters"], prefix)


def adaptive_vs_fixed_block(runs: Runs, prefix: str) -> str:
  """Each drafter adaptive and at every fixed γ against autoregressive decoding, and adaptive against its fixed γ
  directly (paired per call: the same prompts and repeat)."""
  run = runs["adaptive_vs_fixed"]
  methods = run.methods()
  gammas = sorted({int(m.rsplit("_g", 1)[1]) for m in methods if re.fullmatch(r".+_g\d+", m)})
  header = (["drafter", "adaptive"] + [f"fixed γ {g}" for g in gammas] + [f"adaptive / fixed γ {g}" for g in gammas]
            + ["plain rounds, adaptive"])
  rows = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
  for m in methods:
    if not all(f"{m}_g{g}" in methods for g in gammas):
      continue
    against_fixed = [speedup_cell(report.paired_speedups(run.records, m, f"{m}_g{g}")) for g in gammas]
    share = report.plain_share([r for r in run.records if r["method"] == m])
    rows.append(f"| `{m}` | {speedup_cell(_paired(run, m))} | " +
                " | ".join(speedup_cell(_paired(run, f"{m}_g{g}")) for g in gammas) + " | " +
                " | ".join(against_fixed) + f" | {share:.0%} |")
  return run_line(run, prefix) + "\n\n" + "\n".join(rows)


def batch_sweep_block(runs: Runs, prefix: str) -> str:
  """Per batch size, every method against autoregressive decoding at that size. A call's batch size is its number
  of rows (each category's prompts fill whole batches in this config)."""
  run = runs["batch_sweep"]
  sizes = [int(b) for b in run.results["summary"]["by_batch_size"]]
  by_size = {b: [r for r in run.records if r["rows"] == b] for b in sizes}
  if sum(map(len, by_size.values())) != len(run.records):
    raise ValueError(f"{run.folder}: calls whose rows are not one of the batch sizes {sizes}")
  rows = ["| method | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
  tokens_per_second = [run.results["summary"]["by_batch_size"][str(b)][run.baseline]["tokens_per_second"]
                       for b in sizes]
  rows.append(f"| `{run.baseline}`, tokens/s | " + " | ".join(f"{t:.1f}" for t in tokens_per_second) + " |")
  for m in run.methods():
    cells = []
    for b in sizes:
      cell = speedup_cell(_paired(run, m, by_size[b]))
      share = report.plain_share([r for r in by_size[b] if r["method"] == m])
      cells.append(cell + (", never drafts" if share == 1 else ""))
    rows.append(f"| `{m}` | " + " | ".join(cells) + " |")
  return run_line(run, prefix) + "\n\n" + "\n".join(rows)


def bench_peers_block(runs: Runs, prefix: str, folder: str = "bench_peers") -> str:
  """configs/bench_peers.py's run in `folder`: every method's tokens/s and paired speedup, and specjax's 1-token step
  against the read bandwidth measured in the run."""
  run = runs[folder]
  summary = run.results["summary"]
  rows = ["| method | tokens/s | speedup (paired median, 90% interval) | lowest category | mean accepted | "
          "plain rounds | greedy agreement |", "|---|---:|---:|---:|---:|---:|---:|"]
  for m in [run.baseline] + run.methods():
    s = summary["methods"][m]
    by_category = {c: float(np.median(r)) for c in run.categories()
                   if (r := _paired(run, m, [x for x in run.records if x["category"] == c]))}
    lowest = min(by_category, key=by_category.get) if m != run.baseline else None
    drafts = run.method_spec(m).get("drafter")
    share = report.plain_share([r for r in run.records if r["method"] == m]) if drafts else None
    rows.append(f"| `{m}` | {s['tokens_per_second']:.1f} | "
                f"{speedup_cell(_paired(run, m)) if m != run.baseline else '1.00x'} | "
                f"{f'{by_category[lowest]:.2f}x ({lowest})' if lowest else '–'} | {s['mean_accepted']:.2f} | "
                f"{'–' if share is None else f'{share:.0%}'} | {_num(s.get('agreement'), '.0%')} |")
  text = run_line(run, prefix) + "\n\n" + "\n".join(rows)
  costs = run.results.get("costs") or {}
  if "roofline_fraction" in costs:
    text += (f"\n\nspecjax's 1-token step at a context of {costs['context_tokens']:,} tokens: "
             f"{1e3 * costs['target_seconds']['1']:.1f} ms for {costs['target_step_bytes'] / 1e6:.0f} MB read (the "
             f"weights and the KV cache its layers attend), {costs['roofline_fraction']:.0%} of the read bandwidth "
             f"measured in the run ({costs['read_bandwidth'] / 1e9:.1f} GB/s).")
  skipped = {**{m: f"checkpoint {', '.join(missing)} missing" for m, missing in
                (summary.get("skipped_methods") or {}).items()}, **(summary.get("unavailable_peers") or {})}
  if skipped:
    text += " Left out: " + "; ".join(f"`{m}` ({reason})" for m, reason in skipped.items()) + "."
  return text


def forward_costs_block(runs: Runs, prefix: str, folder: str) -> str:
  """configs/calibrated_costs.py's run in `folder`: each adaptive method's forward costs f(n) and where they came
  from, its rounds by draft length, its speedup, and calibrated against typed (`report.forward_costs_table`)."""
  run = runs[folder]
  return run_line(run, prefix) + "\n\n" + report.forward_costs_table(run.results["summary"])


def layer_skip_deep_block(runs: Runs, prefix: str) -> str:
  """The teacher-forced search's greedy path (configs/layer_skip_sets/smollm2-135m-deep.json)."""
  path = "configs/layer_skip_sets/smollm2-135m-deep.json"
  search = json.loads((runs.root / path).read_text())
  calibration = search["calibration"]
  rows = ["| layers skipped | skip set | draft cost c | agreement on ShareGPT (teacher-forced α) | "
          "predicted speedup |", "|---:|---|---:|---:|---:|"]
  for step in search["search"]["path"]:
    rows.append(f"| {len(step['skip_layers'])} | {{{', '.join(map(str, step['skip_layers']))}}} | "
                f"{step['draft_cost']:.2f} | {step['alpha']:.2f} | {step['speedup']:.2f} |")
  return (f"[`{path}`]({prefix.removesuffix('results/')}{path}) ({search['created'][:10]}): "
          f"{search['search']['evaluations']} sets scored on {calibration['conversations']} ShareGPT conversations "
          f"(train side), γ {search['gamma']}, r {search['verify_cost']:g}; chosen: skip "
          f"{{{', '.join(map(str, search['options']['skip_layers']))}}}.\n\n" + "\n".join(rows))


def tpu_compile_block(runs: Runs, prefix: str) -> str:
  """The runs of experiments.compile_for: what compiled and the 8B-shaped target's memory per chip (their projections
  from XLA's counts stay in each run's results.md)."""
  compiled = sorted((r for r in runs.values() if r.compiled and not r.folder.startswith(ARCHIVE)),
                    key=lambda r: r.started)
  lines = []
  for run in compiled:
    lines.append(compile_run_line(run, prefix))
    table = largest_programs_table(run.results)
    if table:
      lines.append(f"The programs a user runs in `{run.folder}`, the largest of each model and topology:\n\n{table}")
    int8 = int8_table(run.results)
    if int8:
      lines.append(f"int8 weights (specjax/int8.py: int8 codes and a {run.results['config']['dtype']} scale per output "
                   f"channel, (x @ codes) * scale) against {run.results['config']['dtype']} in `{run.folder}`, each "
                   "program beside its twin: GiB per chip XLA allocates, the arguments (weights and KV cache), XLA's "
                   "bytes accessed (a loop's body counted once), and the calls of specjax's CPU kernels in the int8 "
                   f"program:\n\n{int8}")
  default = runs.get("tpu_compile")
  if default is None:
    return "\n\n".join(lines)
  results = default.results
  config = results["config"]
  big = [r for r in results["records"] if r["model"] == "llama-3.1-8b" and r["kind"] in ("autoregressive",
                                                                                        "speculative")]
  if big:
    lines.append(f"The Llama-3.1-8B-shaped target in {config['dtype']}, batch {config['batch_size']}, a KV cache of "
                 f"{config['cache_len']} positions, with the default sharding rules on {big[0]['topology']} "
                 f"({big[0]['mesh'][0]} x {big[0]['mesh'][1]}), bytes per chip of its 16 GiB of HBM: " + "; ".join(
                     f"{_program_label(r)} {r['bytes_per_device'] / 2**30:.2f} GiB ({r['hbm_fraction']:.0%})"
                     for r in big) + ".")
  lines.append(f"XLA's counts project the drafters per topology in [`{default.folder}/results.md`]"
               f"({prefix}{default.folder}/results.md) (copies of the cache between memory spaces included); the "
               "accelerator projection of the experiments report, of [results](results.md) and of README reads the "
               "analytic cost model's counts instead (below; experiments/projection.py).")
  return "\n\n".join(lines)


def _error_cell(row: dict[str, Any], results: dict[str, Any]) -> str:
  """A predicted cost's error: relative, or where 20% of the measured value is less than the floor, the difference
  in target steps; bold where it misses the tolerance."""
  if abs(row["measured"]) * results["tolerance"] < results["floor"]:
    text = f"{row['predicted'] - row['measured']:+.3f}"
  else:
    text = f"{row['error']:+.0%}"
  return text if row["within"] else f"**{text}**"


def cost_model_block(runs: Runs, prefix: str, folder: str = "cost_model") -> str:
  """The analytic cost model's run: what each measurement was fitted with, its predicted c and r against the measured
  ones (and the H200's forwards of T tokens), and the projected speedups per model and layout with the ranking."""
  run = runs[folder]
  results = run.results
  rows, rates = results["validation"], results["rates"]
  missed = [r for r in rows if not r["within"]]
  lines = [f"{_link(run, prefix)} (commit {run.commit}, {run.date()} UTC): {describe_modeled(results)}. Fitted: one "
           "overhead per weight-matrix product for each measurement, to its own 1-token target step; every other "
           f"number is predicted. This CPU's FLOP rate: a float32 product {' x '.join(map(str, rates['flop_shape']))} "
           f"at {rates['flop_rate'] / 1e9:.0f} GFLOP/s ({rates['date']}, {rates['cpu']}, load average "
           f"{rates['load_average'][0]:.1f} on {rates['cpu_count']} cores); the H200's, its published peak for the "
           "run's dtype. The rate each CPU run's widest verification implies (its FLOPs beyond a 1-token step's over "
           "the time beyond it; not used): " + _join([f"{f['implied_flop_rate'] / 1e9:.0f} GFLOP/s in "
                                                      f"`{f['source'].removeprefix('results/')}`"
                                                      for f in results["fits"] if "implied_flop_rate" in f]) + ".",
           "", _fits_table(results["fits"]), "",
           f"Measured against predicted (error: relative, or in target steps where {results['tolerance']:.0%} of the "
           f"measured value is under {results['floor']}; bold: outside max({results['tolerance']:.0%}, "
           f"{results['floor']})), with the draft's bytes over its measured time (to hold against the read bandwidth "
           "above):", "", _validation_table(results)]
  groups: dict[tuple[str, str, str], list[str]] = {}
  for r in missed:
    groups.setdefault((r["device"], r["source"].removeprefix("results/"), r["quantity"]), []).append(r["method"])
  lines += ["", f"{len(missed)} of {len(rows)} outside the tolerance" + (": " + "; ".join(
      f"{quantity} of {_join([f'`{m}`' for m in methods])} ({device}, `{source}`)"
      for (device, source, quantity), methods in groups.items()) if missed else "") + "."]
  workload = results["workload"]
  sources = _join([f"`{f.removeprefix('results/')}`" for f in workload["acceptance"]])
  for model in dict.fromkeys(p["model"] for p in results["projections"]):
    stand_in = ("" if model == workload["acceptance_model"] else
                f", {workload['acceptance_model']}'s as a stand-in: {model}'s own is unmeasured")
    mine = [p for p in results["projections"] if p["model"] == model]
    lines += ["", f"Projected speedups of {model} ({workload['dtype']}, a cache of {workload['cache_len']} positions; "
              f"τ and γ of {sources}{stand_in}; mesh (data, model) 1 x 1 on one chip, 2 x 4 on eight; no overhead "
              "per product on a TPU):", "", _projection_table([p for p in mine if p["tree_nodes"] is None])]
    if model == workload["acceptance_model"] and any(p["tree_nodes"] for p in mine):
      lines += ["", "Its trees (τ and depth γ of "
                + (f"`{workload['tree_acceptance'].removeprefix('results/')}`" if workload["tree_acceptance"]
                   else "no run of configs/trees.py") + "; where it has none, the τ from which the tree pays):", "",
                _trees_table([p for p in mine if p["tree_nodes"]])]
  return "\n".join(lines)


def _fits_table(fits: Sequence[dict[str, Any]]) -> str:
  rows = ["| measurement | read GB/s | GFLOP/s | 1-token step ms | bytes / bandwidth ms | FLOPs / peak ms | "
          "products | overhead µs per product |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for f in fits:
    rows.append(f"| {f['device']} (`{f['source'].removeprefix('results/')}`) | "
                f"{f['read_bytes_per_second'] / 1e9:.1f} | {f['flops_per_second'] / 1e9:,.0f} | "
                f"{f['step_seconds'] * 1e3:.2f} | {f['memory_seconds'] * 1e3:.2f} | {f['compute_seconds'] * 1e3:.2f} | "
                f"{f['step_products']} | {f['overhead_seconds'] * 1e6:.1f} |")
  return "\n".join(rows)


def _validation_table(results: dict[str, Any]) -> str:
  """c and r per measured method, then the H200's forwards of T tokens against its 1-token forward."""
  costs = {(r["device"], r["source"], r["method"], r["quantity"]): r for r in results["validation"]}
  rows = ["| device | measured in | method | γ | c | predicted | error | r | predicted | error | draft GB/s |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for device, source, method, quantity in costs:
    if quantity != "c":
      continue
    c, r = costs[device, source, method, "c"], costs[device, source, method, "r"]
    weights = c.get("draft_bandwidth") is not None and c["draft_bytes"] >= 1e6  # not a few KB of token buffer
    bandwidth = c["draft_bandwidth"] / 1e9 if weights else None
    rows.append(f"| {device} | `{source.removeprefix('results/')}` | `{method}` | {c['gamma']} | {c['measured']:.3f} | "
                f"{c['predicted']:.3f} | {_error_cell(c, results)} | {r['measured']:.2f} | {r['predicted']:.2f} | "
                f"{_error_cell(r, results)} | {_num(bandwidth, '.1f')} |")
  widths = [r for r in results["validation"] if r["quantity"] == "forward"]
  if widths:
    rows += ["", "Forwards of T tokens (or rows) over the 1-token forward of the same measurement (`width_seconds`):",
             "", "| device | forward | measured | predicted | error |", "|---|---|---:|---:|---:|"]
    rows += [f"| {r['device']} | {r['method']} | {r['measured']:.2f} | {r['predicted']:.2f} | "
             f"{_error_cell(r, results)} |" for r in widths]
  return "\n".join(rows)


def _projection_table(projected: Sequence[dict[str, Any]]) -> str:
  """Speedups per method (rows) and layout (columns), then the ranking per layout and the pairs whose order differs
  between layouts, read at the precision shown."""
  layouts = list(dict.fromkeys((p["topology"], p["batch"]) for p in projected))
  methods = list(dict.fromkeys(p["acceptance_of"] for p in projected))
  shown = {(p["acceptance_of"], p["topology"], p["batch"]): round(p["projected_speedup"], 2) for p in projected}
  first = {m: next(p for p in projected if p["acceptance_of"] == m) for m in methods}
  names = [f"{t} batch {b}" for t, b in layouts]
  rows = ["| drafter (τ, γ) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(layouts)]
  for m in methods:
    p = first[m]
    rows.append(f"| `{m}` ({p['drafter']}; {p['tau']:.2f}, {p['gamma']}) | " +
                " | ".join(f"{shown[m, t, b]:.2f}x" if (m, t, b) in shown else "–" for t, b in layouts) + " |")
  orders: dict[str, list[str]] = {}
  for (t, b), name in zip(layouts, names):
    here = sorted((m for m in methods if (m, t, b) in shown), key=lambda m: -shown[m, t, b])
    text = f"`{here[0]}`" + "".join(f" {'=' if shown[a, t, b] == shown[m, t, b] else '>'} `{m}`"
                                    for a, m in zip(here, here[1:]))
    orders.setdefault(text, []).append(name)
  ranked = "; ".join(f"on {_join(where)}: {order}" for order, where in orders.items())

  def ahead(a: str, b: str) -> list[str]:
    return [name for (t, n), name in zip(layouts, names) if shown.get((a, t, n), 0) > shown.get((b, t, n), 0)]

  flips = [f"`{a}` ahead of `{b}` on {_join(ahead(a, b))}, behind on {_join(ahead(b, a))}"
           for i, a in enumerate(methods) for b in methods[i + 1:] if ahead(a, b) and ahead(b, a)]
  rows += ["", f"Ranked {ranked}. " + (f"Pairs whose order differs between layouts: {'; '.join(flips)}."
                                        if flips else "No pair changes order between layouts.")]
  return "\n".join(rows)


def _trees_table(projected: Sequence[dict[str, Any]]) -> str:
  """Trees' speedups (or, with τ unmeasured, the τ from which they pay) per tree (rows) and layout (columns)."""
  layouts = list(dict.fromkeys((p["topology"], p["batch"]) for p in projected))
  cell = {(p["acceptance_of"], p["topology"], p["batch"]): p for p in projected}
  rows = ["| tree (τ, γ) | " + " | ".join(f"{t} batch {b}" for t, b in layouts) + " |",
          "|---|" + "---:|" * len(layouts)]
  for m in dict.fromkeys(p["acceptance_of"] for p in projected):
    first = cell[next(key for key in cell if key[0] == m)]
    tau = "τ unmeasured" if first["tau"] is None else f"{first['tau']:.2f}"
    rows.append(f"| `{m}` ({tau}, {first['gamma']}) | " + " | ".join(
        "–" if (m, t, b) not in cell else f"{cell[m, t, b]['projected_speedup']:.2f}x"
        if cell[m, t, b]["projected_speedup"] is not None else f"pays at τ > {cell[m, t, b]['break_even_tau']:.2f}"
        for t, b in layouts) + " |")
  return "\n".join(rows)


def train_budget_block(runs: Runs, prefix: str) -> str:
  """The drafters trained on one budget: the curves' table and targets (experiments.curves renders both) and the
  plot."""
  run = runs["train_budget"]
  return (f"{_link(run, prefix)} (commit {run.commit}, {run.date()} UTC): {describe_trained(run.results)}.\n\n"
          f"{curves.table(run.results)}\n\n![curves]({prefix}{run.folder}/curves.png)")


def _program_label(record: dict) -> str:
  return (record["program"] + (f" with {record['drafter']}" if record["drafter"] else "")
          + (f" drafting trees of {record['tree_nodes']}" if record.get("tree_nodes") else ""))


def _verbatim(run_folder: str, file: str, title: str) -> Callable[[Runs, str], str]:
  def render(runs: Runs, prefix: str) -> str:
    run = runs[run_folder]
    text = (run.path / file).read_text().rstrip("\n")
    return (f"{title} ([`{file}`]({prefix}{run.folder}/{file}), {run.date()} UTC, commit {run.commit}):\n\n"
            f"```text\n{text}\n```")
  return render


def h200_costs_block(runs: Runs, prefix: str) -> str:
  run = runs["accelerator"]
  folder = run.path
  by_dtype = {}
  for path in sorted(folder.glob("*.json")):
    measured = json.loads(path.read_text())
    if "width_seconds" in measured and "decode" not in measured:
      by_dtype[measured["dtype"]] = measured
  dtypes = list(by_dtype)
  widths = [w for w in next(iter(by_dtype.values()))["width_seconds"] if w.startswith("T") and w != "T1"]
  methods = list(next(iter(by_dtype.values()))["costs"]["methods"])

  def row(label: str, cell: Callable[[dict], str]) -> str:
    return f"| {label} | " + " | ".join(cell(by_dtype[d]) for d in dtypes) + " |"

  rows = ["| | " + " | ".join(dtypes) + " |", "|---|" + "---:|" * len(dtypes),
          row("1-token decode step (ms)", lambda m: f"{1e3 * m['width_seconds']['T1']:.2f}"),
          row("XLA's bytes per step ÷ step time ÷ copy bandwidth measured in the run", lambda m: format(
              m["costs"]["target_step_bytes_xla"] / m["width_seconds"]["T1"] / 1e9 / m["bandwidth_gbs"], ".0%")),
          row(f"forward over {' / '.join(w[1:] for w in widths)} tokens ÷ 1-token step",
              lambda m: " / ".join(f"{m['width_seconds'][w] / m['width_seconds']['T1']:.2f}" for w in widths)),
          row("batch-8 step ÷ batch-1 step", lambda m: f"{m['width_seconds']['B8'] / m['width_seconds']['T1']:.2f}"),
          row(f"c: {' / '.join(methods)}",
              lambda m: " / ".join(f"{m['costs']['methods'][x]['draft_cost']:.3f}" for x in methods))]
  files = ", ".join(f"[`{p.name}`]({prefix}{run.folder}/{p.name})" for p in sorted(folder.glob("*.json"))
                    if p.name in {f"h200_{d}.json" for d in dtypes})
  device = next(iter(by_dtype.values()))
  return (f"{device['device_kind']}, jax {device['jax']}, {device['weights']}, {run.date()} ({files}):\n\n" +
          "\n".join(rows))


def h200_decode_block(runs: Runs, prefix: str) -> str:
  run = runs["accelerator"]
  measured = json.loads((run.path / "h200_decode.json").read_text())
  decode = measured["decode"]
  rows = ["| method | γ | α (random weights) | measured | predicted | output equal to autoregressive |",
          "|---|---:|---:|---:|---:|:---:|"]
  for m, s in decode["methods"].items():
    rows.append(f"| `{m}` | {s['gamma']} | {s['alpha']:.2f} | {s['speedup']:.2f}x | {s['predicted_speedup']:.2f}x | "
                f"{'yes' if s['identical'] else 'NO'} |")
  ratios = [s["speedup"] / s["predicted_speedup"] for s in decode["methods"].values()]
  return (f"[`h200_decode.json`]({prefix}{run.folder}/h200_decode.json) ({measured['dtype']}, {decode['prompts']} "
          f"prompts × {decode['new_tokens']} tokens, batch 1, fixed γ, {decode['repeats']} interleaved repeats; "
          f"autoregressive decoding {decode['autoregressive_tokens_per_second']:.0f} tokens/s):\n\n" + "\n".join(rows) +
          f"\n\nMeasured / predicted: {min(ratios):.2f}–{max(ratios):.2f}.")


# The README's Results paragraph: each drafter from the newest run that measured it on every category.
LABELS = {"prompt_lookup": "prompt lookup", "layer_skip_exit24": "the untrained exit after 24 layers",
          "mtp_parallel": "the parallel MTP heads", "mtp_sequential": "the sequential MTP module",
          "draft_model": "the distilled draft model", "layer_skip_trained_exit": "the trained exit adapter"}
HEADLINE_CONFIG = "adaptive_by_category-full"


def readme_results_block(runs: Runs, prefix: str) -> str:
  """One paragraph: every drafter of `LABELS` with adaptive drafting over all of Spec-Bench's categories, each from
  the newest run of `HEADLINE_CONFIG` that measured it on every category, with that run's pairs, commit and the
  code changes since."""
  candidates = newest_first(runs, HEADLINE_CONFIG)
  if not candidates:
    raise ValueError(f"no run of {HEADLINE_CONFIG} in results/")
  widest = max(len(r.categories()) for r in candidates)
  # run name -> {the run's name of a method in the paragraph: its label}, each from the newest run covering it
  chosen: dict[str, dict[str, str]] = {}
  for method, label in LABELS.items():
    found = next(((r, name) for r in candidates for name in (method, *FORMER_NAMES.get(method, ()))
                  if len(r.categories_of(name)) == widest), None)
    if found is not None:
      chosen.setdefault(found[0].name, {})[found[1]] = label
  groups = []
  for name, methods in sorted(chosen.items(), key=lambda item: runs[item[0]].started):
    run = runs[name]
    parts = []
    for m in sorted(methods, key=lambda m: -float(np.median(_paired(run, m)))):
      share = report.plain_share([r for r in run.records if r["method"] == m])
      parts.append(f"{speedup_cell(_paired(run, m))} for {methods[m]}" + (", which never drafts" if share == 1 else ""))
    pairs = {len(_paired(run, m)) for m in methods}
    changed = [c.commit for c in CODE_CHANGES if run.concerned_by(c)]
    note = f"; code changed since: {', '.join(changed)}" if changed else ""
    lossless = run.results["summary"].get("all_lossless")
    if lossless is not True:
      note += "; NOT every output equal to autoregressive decoding's"
    groups.append(f"{_join(parts)} ({'/'.join(map(str, sorted(pairs)))} prompts each, {_link(run, prefix)} at commit "
                  f"{run.commit}{note})")
  config = candidates[0].results["config"]
  cpu_counts = {runs[name].results["environment"]["cpu_count"] for name in chosen}
  setting = [f"{config['model']} {report.weights(config)}",
             "greedy" if config["temperature"] == 0 else f"temperature {config['temperature']}",
             f"batch {config['batch_size']}", f"{config['max_new_tokens']} new tokens",
             f"the first {config['prompts']['per_category']} prompts of each of Spec-Bench's {widest} categories"
             f"{split_words(config)}"]
  if all(runs[name].results["summary"].get("all_lossless") is True for name in chosen):
    setting.append("every output equal to autoregressive decoding's")
  return (f"With adaptive drafting on {'/'.join(map(str, sorted(cpu_counts)))} CPU cores ({', '.join(setting)}), "
          f"the median paired speedup over autoregressive decoding, with its 90% interval, is "
          + "; and ".join(groups) + ".")


# The answer at one training budget: the drafters of configs/compare_drafters.py:budget (methods budget_<run>, each
# from its run of configs/train_budget.py), adaptive on this CPU and at fixed gamma for the accelerator projection,
# beside the untrained drafters of the same run.
BUDGET_LABELS = {"budget_sequential": "the sequential MTP module", "budget_parallel": "the parallel MTP heads",
                 "budget_deepseek": "DeepSeek-style chained MTP modules",
                 "budget_exit": "the trained exit adapter (after 3 layers)",
                 "budget_exit16": "the trained exit adapter after 16 layers",
                 "budget_draft": "the distilled draft model",
                 "budget_sequential_sharegpt": "the sequential MTP module trained on ShareGPT's answers"}
UNTRAINED_LABELS = {"prompt_lookup": "prompt lookup", "layer_skip_best_set": "layer skip with its searched skip set",
                    "layer_skip_exit24": "layer skip's exit after 24 layers",
                    "layer_skip_exit12": "layer skip's exit after 12 layers"}
# Per target, the runs the answer reads: (CPU speedups with adaptive drafting, the fixed-γ run for the projection).
ANSWER_CONFIGS = {"smollm2-135m": ("compare_drafters-budget,adaptive", "compare_drafters-budget")}
ANSWER_TARGETS = {"smollm2-135m": "SmolLM2-135M", "gemma3-270m": "Gemma-3-270M"}


def _newest(runs: Runs, config: str) -> Run:
  found = [r for r in newest_first(runs, config) if not r.folder.startswith(ARCHIVE + "/")]
  if not found:
    raise ValueError(f"no run of {config} in results/")
  return found[0]


def _millions(values: Sequence[float]) -> str:
  low, high = f"{min(values) / 1e6:.2f}", f"{max(values) / 1e6:.2f}"
  return f"{low}M" if low == high else f"{low}–{high}M"


def readme_answer_block(runs: Runs, prefix: str) -> str:
  """Per target of `ANSWER_CONFIGS`, one paragraph from its adaptive run on this CPU: the fastest method overall,
  the fastest drafter trained on the budget (with the runner-up and their head-to-head ratio), the untrained drafters
  and the never-drafting control where the run has one, each with its median paired speedup over autoregressive
  decoding and its 90% interval; then the reason in that run's numbers (the LM head's share of a step, the draft cost
  per token c, the verification cost r, tokens per target forward), and the families ranked by the accelerator
  projection (experiments/projection.py: the analytic cost model's costs, v5e:2x4 at batch 8) at the tokens per
  forward of the fixed-γ run."""
  return "\n\n".join(_answer(runs, prefix, model, *(_newest(runs, c) for c in configs))
                      for model, configs in ANSWER_CONFIGS.items())


def _answer(runs: Runs, prefix: str, model: str, adaptive: Run, fixed: Run) -> str:
  families = [m for m in adaptive.methods() if m in BUDGET_LABELS]
  if len(families) < 2:
    raise ValueError(f"{adaptive.name} compares {families}: the answer needs two families trained on the budget")
  untrained = [m for m in adaptive.methods() if m in UNTRAINED_LABELS]
  labels = {**BUDGET_LABELS, **UNTRAINED_LABELS}
  median = {m: float(np.median(_paired(adaptive, m))) for m in families + untrained}
  ranked = sorted(families, key=lambda m: -median[m])
  first, second = ranked[:2]
  fastest = max(families + untrained, key=lambda m: median[m])
  positions = _millions([adaptive.training_run(m, runs)["positions"] for m in families])
  pairs = "/".join(map(str, sorted({len(_paired(adaptive, m)) for m in families + untrained})))
  config, summary = adaptive.results["config"], adaptive.results["summary"]["methods"]
  notes = [f"{pairs} prompts each", f"{_link(adaptive, prefix)} at commit {adaptive.commit}"]
  changed = [c.commit for c in CODE_CHANGES if adaptive.concerned_by(c)]
  if changed:
    notes.append(f"code changed since: {', '.join(changed)}")
  notes.append("every output equal to autoregressive decoding's" if adaptive.results["summary"].get("all_lossless")
               is True else "NOT every output equal to autoregressive decoding's")
  setting = (f"**{ANSWER_TARGETS.get(model, model)}** ({report.weights(config)}, adaptive drafting, "
             f"{adaptive.results['environment']['cpu_count']} CPU cores; {'; '.join(notes)})")

  def cell(m: str) -> str:
    return f"{labels[m]} at {speedup_cell(_paired(adaptive, m))}"

  if fastest == first:
    lead = (f"the fastest method is a trained drafter, {cell(first)} over autoregressive decoding, and "
            f"{speedup_cell(report.paired_speedups(adaptive.records, first, second))} over the runner-up of the "
            f"{len(families)} trained on one budget ({positions} training positions each), {cell(second)}")
  else:
    lead = (f"the fastest method is {cell(fastest)} over autoregressive decoding, untrained; the fastest of the "
            f"{len(families)} drafters trained on one budget ({positions} training positions each) is {cell(first)}, "
            f"{speedup_cell(report.paired_speedups(adaptive.records, first, fastest))} against {labels[fastest]} and "
            f"{speedup_cell(report.paired_speedups(adaptive.records, first, second))} over the runner-up, "
            f"{cell(second)}")
  others = [cell(m) for m in untrained if m != fastest]
  if others:
    lead += f"; untrained, {_join(others)}"
  if report.CONTROL in adaptive.methods():
    lead += f"; the never-drafting control, the measurement floor, at {speedup_cell(_paired(adaptive, report.CONTROL))}"
  shown = list(dict.fromkeys([fastest, first, *untrained]))
  def numbers(m: str) -> str:
    s = summary[m]
    costs = (f"c = {max(s['draft_cost'], 0.0):.3f}, r = {s['verify_cost']:.2f} at γ = {s['gamma']}, "
             if s.get("draft_cost") is not None else "")
    return f"{labels[m]} {costs}{s['mean_accepted']:.2f} tokens per forward"

  head = cost_model.head_share(shaped_config(config["model"]))
  reason = (f"Why, in this run's numbers: the LM head is {head:.0%} of the weights a target "
            f"step reads; per drafter, the cost of a draft token c and of verifying γ + 1 tokens r in target steps, "
            f"and the tokens per target forward: " + "; ".join(map(numbers, shown)) + ".")
  text = f"{setting}: {lead}. {reason}"
  costs = projection.read(str(runs.root / projection.COSTS_FILE), model)
  fixed_summary = fixed.results["summary"]["methods"]
  projected = {m: projection.project(fixed_summary[m], costs, m) for m in families if m in fixed_summary}
  projected = {m: p for m, p in projected.items() if p is not None}
  if not projected:
    return text
  order = sorted(projected, key=lambda m: -projected[m])
  shown = order[:2] if first in order[:2] else [order[0], first]
  missing = [BUDGET_LABELS[m] for m in families if m not in projected]
  source = next(iter(costs.values()))["source"]
  ordinals = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh")
  accelerator = (f"Projected for a TPU slice by the analytic cost model (experiments/cost_model.py, {source}, at the "
                 f"tokens per target forward of the fixed-γ run {_link(fixed, prefix)}), the ranking of the trained "
                 "drafters puts "
                 + _join([f"{BUDGET_LABELS[m]} {ordinals[order.index(m)]} at {projected[m]:.2f}x" for m in shown])
                 + (f" ({_join(missing)} not projected)" if missing else "") + ".")
  return f"{text} {accelerator}"


def _join(parts: Sequence[str]) -> str:
  return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _category_block(folder: str, methods: Sequence[str] | None = None):
  return lambda runs, prefix: category_block(runs[folder], prefix, methods)


# name -> (file, renderer(runs, link prefix from that file to results/))
BLOCKS: dict[str, tuple[str, Callable[[Runs, str], str]]] = {
    "readme-answer": ("README.md", readme_answer_block),
    "readme-results": ("README.md", readme_results_block),
    "compare-drafters": ("docs/results.md", compare_drafters_block),
    "compare-drafters-budget": ("docs/results.md",
                                lambda runs, prefix: compare_drafters_block(runs, prefix, "compare_drafters-budget")),
    "compare-drafters-budget-adaptive": ("docs/results.md", _category_block("compare_drafters-budget-adaptive")),
    "compare-drafters-data": ("docs/results.md", data_block),
    "compare-drafters-by-category": ("docs/results.md", compare_drafters_by_category_block),
    "trees": ("docs/results.md", trees_block),
    "trees-mtp": ("docs/results.md", lambda runs, prefix: trees_block(runs, prefix, "trees-mtp")),
    "trees-parallel": ("docs/results.md", lambda runs, prefix: trees_block(runs, prefix, "trees-parallel")),
    "train-budget": ("docs/results.md", train_budget_block),
    "adaptive-by-category-full": ("docs/results.md", _category_block("adaptive_by_category-full")),
    "adaptive-by-category-trained-all": ("docs/results.md", _category_block("adaptive_by_category-trained-all")),
    "adaptive-by-category-others": ("docs/results.md", _category_block("adaptive_by_category-others")),
    "adaptive-by-category-lowest": ("docs/results.md", _category_block("adaptive_by_category-lowest")),
    "adaptive-by-category-scored": ("docs/results.md", _category_block("adaptive_by_category-scored")),
    "adaptive-vs-fixed": ("docs/results.md", adaptive_vs_fixed_block),
    "adaptive-optimism": ("docs/results.md", _category_block("adaptive_optimism")),
    "adaptive-shadow": ("docs/results.md", _category_block("adaptive_shadow")),
    "batch-sweep": ("docs/results.md", batch_sweep_block),
    "bench-peers": ("docs/results.md", bench_peers_block),
    "bench-peers-gemma": ("docs/results.md",
                          lambda runs, prefix: bench_peers_block(runs, prefix, "bench_peers-gemma")),
    "bench-peers-gemma-bf16": ("docs/results.md",
                               lambda runs, prefix: bench_peers_block(runs, prefix, "bench_peers-gemma-bf16")),
    "layer-skip-deep": ("docs/results.md", layer_skip_deep_block),
    "calibrated-costs-smollm2": ("docs/results.md",
                                 lambda runs, prefix: forward_costs_block(runs, prefix, "calibrated_costs-smollm2")),
    "calibrated-costs-gemma3": ("docs/results.md",
                                lambda runs, prefix: forward_costs_block(runs, prefix, "calibrated_costs-gemma3")),
    "bench-autoregressive": ("docs/benchmarks.md", _verbatim("benchmarks", "bench_autoregressive.txt",
                                                             "`benchmarks/bench_autoregressive.py --repeats=3`")),
    "bench-verify": ("docs/benchmarks.md", _verbatim("bench_verify", "bench_verify.txt",
                                                     "`benchmarks/bench_verify.py --repeats=5`")),
    "tpu-compile": ("docs/scaling.md", tpu_compile_block),
    "cost-model": ("docs/scaling.md", cost_model_block),
    "h200-costs": ("docs/benchmarks.md", h200_costs_block),
    "h200-decode": ("docs/benchmarks.md", h200_decode_block),
}


def wrap(markdown: str, width: int = 116) -> str:
  """Prose lines of a generated block wrapped to `width` (tables and code blocks as they are)."""
  lines, fenced = [], False
  for line in markdown.split("\n"):
    if line.startswith("```"):
      fenced = not fenced
    lines.append(line if fenced or line.startswith(("|", "```")) else
                 textwrap.fill(line, width, break_long_words=False, break_on_hyphens=False))
  return "\n".join(lines)


_BLOCK = re.compile(r"(<!-- publish:begin (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- publish:end (?P=name) -->)", re.S)


def render(root: pathlib.Path = ROOT) -> dict[str, str]:
  """Every published file (path relative to root -> its text) as the runs in root/results/ make it."""
  runs = load_runs(root)
  files = {INDEX: index(runs)}
  for file in dict.fromkeys(file for file, _ in BLOCKS.values()):
    text = (root / file).read_text()
    prefix = "../" * file.count("/") + "results/"
    found = [m.group("name") for m in _BLOCK.finditer(text)]
    opened = re.findall(r"<!-- publish:begin ([\w-]+) -->", text)
    expected = [name for name, (f, _) in BLOCKS.items() if f == file]
    if sorted(found) != sorted(opened) or sorted(found) != sorted(expected):
      raise ValueError(f"{file}: generated blocks {sorted(opened)} (closed: {sorted(found)}); expected "
                       f"{sorted(expected)}, each once, between publish:begin and publish:end markers")
    files[file] = _BLOCK.sub(lambda m: m.group(1) + wrap(BLOCKS[m.group("name")][1](runs, prefix).rstrip("\n")) +
                             "\n" + m.group(4), text)
  return files


def check(root: pathlib.Path = ROOT) -> list[str]:
  """What differs between the files and what the runs render (a unified diff per file), and misplaced folders."""
  problems = misplaced(load_runs(root))
  for file, text in render(root).items():
    path = root / file
    current = path.read_text() if path.exists() else ""
    if current != text:
      problems.append("".join(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                   f"{file} (in the tree)", f"{file} (rendered from results/)")))
  return problems


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CHECK.value:
    problems = check()
    if problems:
      sys.exit("publication differs from results/ (run `python -m experiments.publish`):\n" + "\n".join(problems))
    print("publication matches results/")
    return
  wrong = misplaced(load_runs())
  for file, text in render().items():
    (ROOT / file).write_text(text)
  print(f"wrote {INDEX} and {len(BLOCKS)} generated blocks")
  if wrong:
    sys.exit("\n".join(wrong))


if __name__ == "__main__":
  app.run(main)
