r"""Runs an experiment config: decoding methods on Spec-Bench prompts, timed against autoregressive decoding.

  python -m experiments.run --config=configs/quickstart.py [--workdir=DIR] [--config.max_new_tokens=16]

Writes to the workdir (default workdirs/<config>-<time>/): results.json (config, environment, every timed
call, every prompt's output per method, costs, summary), results.md (the tables) and plots (speedup.png,
speedup_by_category.png, acceptance_per_position.png, and when the run has them mean_accepted_vs_gamma.png,
acceptance_vs_depth.png, alpha_by_temperature.png); prints the table.

Timing, so that the comparison is fair on a noisy shared machine:
  * warmup: every method runs once on the first prompt batch, untimed; the compilation it needed
    (`compile_seconds` from specjax.generate) is reported as "compile s";
  * methods are interleaved: for each prompt batch, every method runs in turn (`repeats` times, each repeat
    starting one method later), so slow drifts of the machine hit all methods alike;
  * a timed call that compiled (a new prompt-length bucket; specjax logs "compiling ... for a new shape
    bucket" while it does) is run again and only the rerun counts;
  * tokens/s is the median over batches, speedup is relative to the autoregressive baseline of this run;
    the paired speedups (per prompt batch, the method's tokens/s over the baseline's, repeats averaged before
    pairing) get a distribution-free interval for their median (experiments/report.py), overall and per category,
    with several prompts a category the only way to resolve a few percent on a shared machine;
  * the control (`config.control`): autoregressive decoding again, timed as one more method: its speedup, 1.00x
    but for the machine, shows the measurement floor beside every other method's.
Resuming: each prompt batch's calls (and each warmup) are appended to the workdir's progress.jsonl as they finish.
The same command started again with the same workdir, after a kill or a stop, skips what the log holds and goes on
where it stopped, provided the config, the code (experiments/cli.code_digest: the specjax package with its shipped
checkpoints, and the experiments modules the run imports), the checkpoint files the methods name and the machine are
the same (`fingerprint`); otherwise the old log is moved aside (progress.jsonl.<time>.stale) and the run starts
afresh. Calls are paired within a batch, so a resumed run pairs as an unbroken one does; results.json says how many
batches came from before the restart (`resumed_batches`) and when each start was (`starts`: its time, commit and
the batches done before it), and the log is removed once results.json is written.
With temperature 0 every method's tokens are compared with the baseline's, token for token (`lossless`); a
mismatch is logged as an error, heads results.md and results.json (`summary.lossless_failures`), and the command
exits with status 1.
A quantized target (`config.quantized`: the GGUF's own quantized blocks, `specjax.load(..., quantized=True)`) is
the target of every method, the baseline's too: the drafters draft for it and are checked against its own
autoregressive tokens, and the costs' bytes are its weights as stored.

A method names a specjax drafter (`"drafter"`; none: autoregressive) or a peer (`"peer"`: another
implementation on the same weights, e.g. HF transformers or llama.cpp, see experiments/peers.py), timed
interleaved with the rest. A peer is not specjax, so it is not checked for losslessness: its greedy tokens'
agreement with the baseline is reported instead (`agreement`: tokens until the first divergence over the row's
length, averaged over rows; `equal_rows`: the fraction of rows equal token for token). A peer whose library is
not installed is left out with a printed reason.

Adaptive drafting (`config.adaptive`, or a method's own `"adaptive"` key; default True as in
`specjax.generate`): `gamma` is then the most drafts per round, and the summary adds `gamma_histogram` (rounds by
the draft length used, index 0 a plain target step); with False every round drafts `gamma` tokens. A dict of
`specjax.AdaptiveDrafting` options instead of True, e.g. `"adaptive": {"optimism": 0.25}`, drafts adaptively with
those options (results.json keeps them under the method's `adaptive`); an unknown option is an error. Each call
records the forward costs f(n) adaptive drafting planned with and where they came from (`forward_costs`,
`forward_costs_source`: specjax/calibration.py measures them at a method's first call, its warmup, and caches them),
and results.md's "Forward costs" table gives them per method beside its rounds by draft length; a method named
`X_calibrated` is paired call by call with `X_typed` (configs/calibrated_costs.py).

Costs (`config.costs`, experiments/costs.py): after decoding, every drafter's draft cost c and verification cost
r are measured in compiled loops, interleaved, on a cache of the prompts' typical size, with the bytes each step
moves (specjax/roofline.py, experiments/cost_model.py); the report adds Leviathan's prediction from alpha, c and r,
the efficiency (measured / predicted) and an accelerator projection (a round's costs on a TPU by the analytic cost
model, experiments/projection.py).

Temperatures: `config.temperatures` (a tuple; empty: just `config.temperature`) runs the whole comparison once
per temperature, the first one being the main summary (`summary.methods`); every temperature's per-method
summary is in `summary.by_temperature["<t>"]`, and alpha per temperature is plotted (alpha_by_temperature.png).
Batch sizes: `config.batch_sizes` (a tuple; empty: just `config.batch_size`) runs the whole comparison once per
batch size, each against autoregressive decoding at that batch size (a batch holds consecutive prompts of one
category, so a category with fewer prompts than the batch size gives a smaller batch); the first is the main
summary, every batch size's per-method summary is in `summary.by_batch_size["<b>"]`, and speedup per batch size is
plotted (speedup_vs_batch_size.png). Costs are measured at the first batch size.
Gamma sweeps: `config.gammas` (a tuple; empty: each method's own gamma) runs every drafter at each gamma, named
`<method>_g<gamma>` (`family` and `gamma` in its summary).
Draft trees: a method's `"tree_nodes": N` drafts a tree of N nodes, `gamma` deep (`specjax.generate(...,
tree_nodes=N)`; a drafter that drafts trees): every round with `"adaptive": False`, where a tree pays with adaptive
drafting (each call records its `tree_rounds`); `tree_nodes` is in its summary. Costs are measured for chain methods
only (experiments/costs.py times chain rounds).
Methods that need a shipped checkpoint name it (`"needs": ("exit_adapter",)`: specjax/checkpoints/<model>/
exit_adapter.safetensors); a method may instead draft with a checkpoint file of its own (`"checkpoint":
"workdirs/budget/parallel/mtp_parallel.safetensors"`, a path from the repository root, passed as the drafter's
checkpoint option). While a checkpoint is missing, the method is left out with a warning in the log, and the
results list it under `summary.skipped_methods`; a peer whose library is not installed is left out likewise, under
`summary.unavailable_peers` with the reason. A layer-skip method may name a searched skip set instead of its
options (`"skip_set": "configs/layer_skip_sets/<model>.json"`, a path from the repository root, written by
experiments/search_layer_skip.py): it drafts with the set's options, at the gamma the set was searched for unless
it sets its own. Configs only declare these (configs/common.py); the runner looks them up.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags
from tqdm import tqdm

import specjax
from specjax import compilation, distributed, drafters, sharding
from specjax.decoding import prepare_batch
from specjax.drafters import draft_head, layer_skip
from specjax.sampling import SamplingParams
from experiments import cli, costs, peers, projection, report, spec_bench
from experiments.cli import code_commit, environment, parse_flags

_CONFIG = cli.define_config_flag("Experiment config: configs/<name>.py[:arg].")
_WORKDIR = cli.define_workdir_flag("Output folder (default: workdirs/<config>-<time>).")
distributed.define_flags()  # --coordinator_address, --num_processes, --process_id (multi-process runs)

METHOD_KEYS = {"name", "drafter", "peer", "options", "gamma", "adaptive", "needs", "skip_set", "tree_nodes",
               "checkpoint"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # skip sets' paths start here
CONTROL = report.CONTROL
PROGRESS = "progress.jsonl"  # a workdir's log of the prompt batches a run finished (see `run`)


@dataclasses.dataclass(frozen=True)
class Method:
  name: str
  drafter: Any  # from specjax.make_drafter; None decodes autoregressively
  gamma: int
  family: str = ""  # the config's method name (a gamma sweep runs one family at several gammas)
  options: dict = dataclasses.field(default_factory=dict)  # make_drafter options, for the report
  peer: Any = None  # from peers.make: another implementation, which decodes instead of specjax
  # adaptive drafting (specjax/adaptive.py): True (the defaults) or its options; False: every round drafts `gamma`
  adaptive: bool | specjax.AdaptiveDrafting = False
  tree_nodes: int | None = None  # N: every round drafts a tree of N nodes, gamma deep (None: a chain)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  index: int
  category: str
  questions: tuple[spec_bench.Question, ...]
  prompts: tuple[tuple[int, ...], ...]  # token ids


def check_methods(config: ml_collections.ConfigDict) -> list[dict]:
  """The method specs `make_methods` builds, the autoregressive baseline (the first method without a drafter) first
  and `config.only` applied, each checked as far as it can be without the model: its keys, a known drafter or peer
  (not both), a unique name, its adaptive drafting options, its skip set, its tree size."""
  specs = [dict(m) for m in config.methods]
  for spec in specs:
    if "name" not in spec or set(spec) - METHOD_KEYS:
      raise ValueError(f"a method is a dict with 'name' and optionally {sorted(METHOD_KEYS - {'name'})}, "
                       f"got {spec}")
    if spec.get("drafter") and spec.get("peer"):
      raise ValueError(f"a method names a drafter or a peer, not both: {spec}")
    if spec.get("peer") and spec["peer"] not in peers.PEERS:
      raise ValueError(f"unknown peer {spec['peer']!r} in {spec}; peers: {', '.join(peers.PEERS)}")
    if spec.get("drafter") and spec["drafter"] not in drafters.available():
      raise ValueError(f"unknown drafter {spec['drafter']!r} in {spec}; drafters: {', '.join(drafters.available())}")
    if spec.get("skip_set") is not None:
      if spec.get("drafter") != "layer_skip":
        raise ValueError(f"method {spec['name']!r}: a skip set is a layer_skip drafter's, got {spec}")
      method_options(spec)
    if spec.get("tree_nodes") is not None:
      nodes = spec["tree_nodes"]
      if not spec.get("drafter") or not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise ValueError(f"method {spec['name']!r}: tree_nodes is a positive integer of a drafting method, got {spec}")
  names = [s["name"] for s in specs]
  if len(set(names)) != len(names):
    raise ValueError(f"method names must be unique, got {names}")
  baselines = [s for s in specs if not s.get("drafter") and not s.get("peer")]
  if not baselines:
    raise ValueError("config.methods needs an autoregressive baseline (a method without a drafter or peer)")
  only = [n.strip() for n in config.only.split(",") if n.strip()]
  unknown = sorted(set(only) - set(names))
  if unknown:
    raise ValueError(f"config.only names unknown methods {unknown}; methods: {names}")
  chosen = [baselines[0]] + [s for s in specs if s is not baselines[0] and (not only or s["name"] in only)]
  if config.get("control", False):
    if CONTROL in names:
      raise ValueError(f"config.control adds a method named {CONTROL!r}; a method of config.methods has that name")
    chosen.insert(1, {"name": CONTROL})  # the baseline's decoding, timed as a method (the measurement floor)
  for spec in chosen:
    if not spec.get("peer"):
      adaptive_drafting(spec.get("adaptive", config.get("adaptive", True)), spec["name"])
  return chosen


def make_methods(config: ml_collections.ConfigDict, model: specjax.Model,
                 unavailable: dict[str, str] | None = None, failed: dict[str, str] | None = None) -> list[Method]:
  """The methods to run (`check_methods`' specs), the autoregressive baseline first. A peer whose library is not
  installed is left out; `unavailable`, when given, receives its name and the reason. So is a peer whose process
  failed to start (`peers.PeerFailed`), into `failed`."""
  chosen = check_methods(config)
  unshipped = missing_checkpoints(chosen, model)
  for method, missing in unshipped.items():
    logging.warning("leaving out method %s: its checkpoint(s) %s are not there yet", method, ", ".join(missing))
  gammas = [int(g) for g in config.get("gammas", ())]
  methods = []
  for spec in chosen:
    if spec["name"] in unshipped:
      continue
    options, own_gamma = method_options(spec, model)
    gamma = int(config.gamma) if own_gamma is None else own_gamma
    if spec.get("peer"):
      temperature = ([*config.get("temperatures", ())] or [config.temperature])[0]
      try:
        peer = peers.make(spec["peer"], model, config.model, gamma=gamma, temperature=temperature, **options)
      except (peers.Unavailable, peers.PeerFailed) as e:
        print(f"leaving out {spec['name']}: {e}")
        logging.warning("leaving out %s: %s", spec["name"], e)
        into = unavailable if isinstance(e, peers.Unavailable) else failed
        if into is not None:
          into[spec["name"]] = str(e)
        continue
      methods.append(Method(spec["name"], None, gamma, spec["name"], options, peer=peer))
      continue
    adaptive = adaptive_drafting(spec.get("adaptive", config.get("adaptive", True)), spec["name"])  # default: True
    drafter = specjax.make_drafter(spec["drafter"], model, **options) if spec.get("drafter") else None
    tree_nodes = spec.get("tree_nodes")
    if drafter is None or not gammas:
      methods.append(Method(spec["name"], drafter, gamma, spec["name"], options, adaptive=adaptive,
                            tree_nodes=tree_nodes))
      continue
    for gamma in gammas:
      if drafter.max_gamma is not None and gamma > drafter.max_gamma:
        logging.warning("%s proposes at most %d tokens a round: no run at gamma %d", spec["name"], drafter.max_gamma,
                        gamma)
        continue
      methods.append(Method(f"{spec['name']}_g{gamma}", drafter, gamma, spec["name"], options, adaptive=adaptive,
                            tree_nodes=tree_nodes))
  return methods


def method_options(spec: dict, model: specjax.Model | None = None) -> tuple[dict, int | None]:
  """A method's `make_drafter` (or peer) options and its own gamma (None: the config's). A `"checkpoint"` is its
  drafter's checkpoint option (`path`, or layer skip's `adapter`, the draft model's `draft`). A `"skip_set"` gives the
  options of its record, under the method's own, and the gamma it was searched for unless the method sets one;
  with `model`, the set is checked against it (`layer_skip.load_skip_set`)."""
  options, gamma = dict(spec.get("options", {})), spec.get("gamma")
  if spec.get("checkpoint"):
    argument = drafters.checkpoint_option(spec.get("drafter"))
    if argument in options:
      raise ValueError(f"method {spec['name']!r}: a 'checkpoint' and the option {argument!r} name the same thing")
    options[argument] = os.path.join(REPO, spec["checkpoint"])
  if spec.get("skip_set") is not None:
    path = os.path.join(REPO, spec["skip_set"])
    if not os.path.isfile(path):
      raise ValueError(f"method {spec['name']!r}: no skip set at {path} (experiments/search_layer_skip.py writes one)")
    options = {**layer_skip.load_skip_set(path, model), **options}
    if gamma is None:
      gamma = layer_skip.read_skip_set(path).get("gamma")
  return options, None if gamma is None else int(gamma)


def adaptive_drafting(value: Any, method: str) -> bool | specjax.AdaptiveDrafting:
  """A method's `"adaptive"` (or `config.adaptive`): True or False, or a dict of `specjax.AdaptiveDrafting` options,
  which it returns built (their values checked there)."""
  if isinstance(value, bool):
    return value
  if isinstance(value, ml_collections.ConfigDict):
    value = value.to_dict()
  if not isinstance(value, dict):
    raise ValueError(f"method {method!r}: 'adaptive' is True, False or a dict of specjax.AdaptiveDrafting options, "
                     f"got {value!r}")
  known = [field.name for field in dataclasses.fields(specjax.AdaptiveDrafting) if field.name != "costs"]
  unknown = sorted(set(value) - set(known))
  if unknown:
    raise ValueError(f"method {method!r}: unknown adaptive drafting option(s) {unknown}; options: {known}")
  return specjax.AdaptiveDrafting(**value)


def missing_checkpoints(specs: Sequence[dict], model: specjax.Model) -> dict[str, list[str]]:
  """{method name: the checkpoints it drafts with that are not there}: the shipped ones it `needs` that
  specjax/checkpoints does not hold, and its own `checkpoint` file (from the repository root) (none: absent)."""
  missing = {}
  for spec in specs:
    needs = spec.get("needs", ())
    if isinstance(needs, str) or not all(isinstance(n, str) for n in needs):
      raise ValueError(f"method {spec['name']!r}: 'needs' is a tuple of shipped checkpoint names, got {needs!r}")
    absent = []
    for checkpoint in needs:
      try:
        draft_head.shipped_checkpoint(model, checkpoint)
      except specjax.CheckpointError:
        absent.append(f"{checkpoint}.safetensors")
    if spec.get("checkpoint") and not os.path.isfile(os.path.join(REPO, spec["checkpoint"])):
      absent.append(spec["checkpoint"])
    if absent:
      missing[spec["name"]] = absent
  return missing


def make_batches(questions: Sequence[spec_bench.Question], prompts: Sequence[Sequence[int]],
                 batch_size: int) -> list[PromptBatch]:
  """Consecutive prompts of one category per batch, so per-category speedups are clean."""
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  batches: list[PromptBatch] = []
  for category in dict.fromkeys(q.category for q in questions):
    rows = [(q, tuple(p)) for q, p in zip(questions, prompts) if q.category == category]
    for start in range(0, len(rows), batch_size):
      chunk = rows[start:start + batch_size]
      batches.append(PromptBatch(len(batches), category, tuple(q for q, _ in chunk), tuple(p for _, p in chunk)))
  return batches


def run(config: ml_collections.ConfigDict, workdir: str, *, model: specjax.Model | None = None,
        name: str = "experiment") -> dict[str, Any]:
  """Runs `config`, writes the results into `workdir` and returns them. `model`: reuse an already loaded one."""
  if model is None:
    quantized = bool(config.get("quantized", False))
    logging.info("loading %s (%s)", config.model, report.weights(config.to_dict()))
    model = specjax.load(config.model, dtype=config.dtype, quantized=quantized)
  if model.tokenizer is None:
    raise ValueError(f"{config.model} has no tokenizer; Spec-Bench prompts are text")
  every_question = spec_bench.load_questions()
  questions = spec_bench.select(every_question, **config.prompts.to_dict())
  if not questions:
    raise ValueError("the prompt selection is empty")
  prompts = [spec_bench.prompt_ids(q, model.tokenizer, config.chat, min_tokens=config.get("min_prompt_tokens", 0),
                                   questions=every_question) for q in questions]
  batch_sizes = [int(b) for b in config.get("batch_sizes", ())] or [int(config.batch_size)]
  mesh = None
  if config.mesh_shape:
    mesh = sharding.make_mesh(*config.mesh_shape)
    model = sharding.shard_model(model, mesh)  # place the parameters once, not in every timed call
  unavailable_peers: dict[str, str] = {}
  failed_peers: dict[str, str] = {}  # peers whose process died or failed: not timed from then on
  methods = make_methods(config, model, unavailable_peers, failed_peers)
  baseline = methods[0].name
  temperatures = [float(t) for t in config.get("temperatures", ())] or [float(config.temperature)]

  def call(method: Method, batch: PromptBatch, temperature: float) -> tuple[specjax.Output, float, int] | None:
    """One generate call: (output, wall seconds, compilations it triggered); None for a peer that failed, now (it
    is reported under `summary.failed_peers` and not called again) or before."""
    compiled_before = compilation.count()
    start = time.perf_counter()
    if method.peer is not None:
      if method.name in failed_peers:
        return None
      try:
        out = method.peer.generate(batch.prompts, max_new_tokens=config.max_new_tokens)
      except peers.PeerFailed as e:
        failed_peers[method.name] = str(e)
        logging.error("%s failed on batch %d and is not timed from here on: %s", method.name, batch.index, e)
        return None
      return out, time.perf_counter() - start, 0
    out = specjax.generate(model, list(batch.prompts), max_new_tokens=config.max_new_tokens,
                           temperature=temperature, top_k=config.top_k, top_p=config.top_p,
                           seed=config.seed, drafter=method.drafter, gamma=method.gamma, adaptive=method.adaptive,
                           tree_nodes=method.tree_nodes, mesh=mesh)
    return out, time.perf_counter() - start, compilation.count() - compiled_before

  def decode_batch(batch: PromptBatch, temperature: float, batch_size: int) -> dict[str, list[dict]]:
    """Every method's calls on one prompt batch, interleaved: {"records": their records, "outputs": each prompt's
    output per method (repeat 0)}, as results.json holds them."""
    greedy = temperature == 0
    reference = None  # the baseline's tokens for this batch
    batch_records, batch_outputs = [], []
    for repeat in range(config.repeats):
      # Repeat k starts at the k-th method (the baseline first in repeat 0, so every call has its reference):
      # each method's time is taken at several places in the order, and a load that drifts over a batch's
      # calls does not always favour the methods run first.
      shift = repeat % len(methods)
      for method in methods[shift:] + methods[:shift]:
        called = call(method, batch, temperature)
        if called is None:
          continue
        out, seconds, new_programs = called
        compile_call_seconds = None
        if new_programs:  # this call compiled a new shape: time a second, compiled call instead
          compile_call_seconds = out.stats["compile_seconds"]
          out, seconds, _ = call(method, batch, temperature)
        if reference is None:
          reference = out.tokens
        checked = greedy and method.peer is None  # a peer runs other kernels: its agreement is reported instead
        matches = out.tokens == reference if checked else None
        agreement = report.agreement(out.tokens, reference) if greedy else None
        if method.peer is not None:
          if repeat == 0 and agreement is not None:
            logging.info("%s agrees with %s on batch %d: %s of the tokens until the first divergence",
                         method.name, baseline, batch.index, [round(a, 2) for a in agreement])
        elif greedy and not matches:
          logging.error("NOT LOSSLESS: %s differs from %s on batch %d (questions %s)", method.name, baseline,
                        batch.index, [q.question_id for q in batch.questions])
        batch_records.append(_record(method, batch, repeat, temperature, out, seconds, compile_call_seconds, matches,
                                     agreement))
        if repeat == 0:
          for row, q in enumerate(batch.questions):
            batch_outputs.append({
                "method": method.name, "temperature": temperature, "batch_size": batch_size,
                "question_id": q.question_id,
                "category": q.category, "prompt_tokens": len(batch.prompts[row]), "new_tokens": len(out.tokens[row]),
                "matches_baseline": out.tokens[row] == reference[row] if checked else None,
                "agreement": agreement[row] if greedy else None, "tokens": out.tokens[row], "text": out.texts[row]})
    # as results.json and the progress log hold them (NaN as None), whether decoded now or before a restart
    return json.loads(json.dumps(report.json_safe({"records": batch_records, "outputs": batch_outputs})))

  # Each warmup and finished prompt batch goes into the workdir's progress log as it ends: a run stopped and started
  # again with the same workdir, config, code, checkpoints and machine (`fingerprint`) takes them from there.
  log = None
  run_fingerprint = fingerprint(config)
  if jax.process_count() == 1:  # the processes of a multi-process run would have to agree on what to skip
    os.makedirs(workdir, exist_ok=True)
    log = cli.ResumableLog(os.path.join(workdir, PROGRESS), {"run": run_fingerprint})
  done = {tuple(e["key"]): e for e in (log.entries if log else [])}
  resumed = sum(1 for key in done if key[0] == "batch")
  if resumed:
    logging.info("resuming from %s: %d prompt batches were done", log.path, resumed)
  starts = [e for key, e in done.items() if key[0] == "start"]
  start = {"key": ["start", len(starts)], "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "commit": code_commit(), "batches_done": resumed}
  starts.append(start)
  if log is not None:
    log.append(start)

  records, outputs, summaries = [], [], {}
  for batch_size, temperature in [(b, t) for b in batch_sizes for t in temperatures]:
    if batch_size != batch_sizes[0] and temperature == temperatures[0]:
      # No program of a finished batch size runs again: free them (each holds ~1,400 memory mappings on XLA:CPU,
      # of 65,530 a process may have; see specjax/compilation.py).
      compilation.clear_all()
    batches = make_batches(questions, prompts, batch_size)
    compile_seconds: dict[str, float | None] = {m.name: None for m in methods}
    if ("warmup", batch_size, temperature) in done:  # each method's first call compiles again, and is timed again
      compile_seconds = done["warmup", batch_size, temperature]["compile_seconds"]
    elif config.warmup:
      for method in methods:
        called = call(method, batches[0], temperature)
        if called is None:
          continue
        out, seconds, _ = called
        compile_seconds[method.name] = out.stats["compile_seconds"]
        logging.info("warmup %s (batch %d, temperature %g): %.1f s, of which compiling %.1f s", method.name,
                     batch_size, temperature, seconds, compile_seconds[method.name])
      if log is not None:
        log.append({"key": ["warmup", batch_size, temperature], "compile_seconds": compile_seconds})

    run_records = []
    lossless: dict[str, bool | None] = {m.name: (True if temperature == 0 and m.peer is None else None)
                                        for m in methods}
    progress = f"prompt batches (batch size {batch_size}, temperature {temperature:g})"
    for batch in tqdm(batches, desc=progress, unit="batch",
                      disable=not distributed.is_main_process()):
      key = ("batch", batch_size, temperature, batch.index)
      if key not in done:
        done[key] = decode_batch(batch, temperature, batch_size)
        if log is not None:
          log.append({"key": list(key), **done[key]})
      run_records += done[key]["records"]
      outputs += done[key]["outputs"]
      for r in done[key]["records"]:
        if r["matches_baseline"] is False:
          lossless[r["method"]] = False
    records += run_records
    summaries[batch_size, temperature] = report.summarize(run_records, [m.name for m in methods], baseline,
                                                          compile_seconds, lossless, methods_info=_method_info(methods))

  first_batch, first_temperature = batch_sizes[0], temperatures[0]
  summary = summaries[first_batch, first_temperature]
  measured = _measure_costs(config, model, methods, questions, prompts, outputs, first_temperature, first_batch)
  if measured is not None:  # measured at the first batch size: c and r change with the number of rows
    accelerator = _accelerator_costs()
    for t in temperatures:
      report.add_costs(summaries[first_batch, t], measured, accelerator)
  summary["by_temperature"] = {f"{t:g}": summaries[first_batch, t]["methods"] for t in temperatures}
  summary["by_batch_size"] = {str(b): summaries[b, first_temperature]["methods"] for b in batch_sizes}
  summary["lossless_failures"] = [{**failure, "batch_size": b} for (b, _), s in summaries.items()
                                  for failure in s["lossless_failures"]]
  if summary["lossless_failures"]:
    summary["all_lossless"] = False
  summary["skipped_methods"] = missing_checkpoints([dict(m) for m in config.methods], model)
  summary["unavailable_peers"] = unavailable_peers  # peers left out, with why (a library not installed)
  summary["failed_peers"] = failed_peers  # peers whose process died or failed, with how: timed until then
  summary["peers"] = {m.name: m.peer.info for m in methods if getattr(m.peer, "info", None)}  # their builds
  results = {
      "name": name,
      "config": config.to_dict(),
      "environment": environment(),
      "fingerprint": run_fingerprint,
      "prompts": [{"question_id": q.question_id, "category": q.category, "prompt_tokens": len(p)}
                  for q, p in zip(questions, prompts)],
      "summary": summary,
      "costs": measured,
      "resumed_batches": resumed,  # prompt batches decoded before a restart (their calls' times are in `records`)
      "starts": [{k: v for k, v in e.items() if k != "key"} for e in starts],  # UTC; one for a run never stopped
      "records": records,
      "outputs": outputs,
  }
  if summary["lossless_failures"]:
    logging.error("NOT LOSSLESS: %s", report.lossless_banner(summary))
  if distributed.is_main_process():  # every process computed the same results; one writes them
    table = report.write(workdir, results)
    if log is not None:
      os.remove(log.path)  # results.json holds all it held
    print(f"\n{table}\n\nresults in {workdir}")
  return results


def checkpoint_digests(config: ml_collections.ConfigDict) -> dict[str, str | None]:
  """sha256 of every checkpoint file the run's methods may decode with, by its path from the repository's root: the
  files its methods name and the drafters' checkpoints shipped for its model (specjax/checkpoints/<model>/); None for
  a file that is not there."""
  paths = [spec["checkpoint"] for spec in config.methods if spec.get("checkpoint")]
  shipped = os.path.join("specjax", "checkpoints", str(config.model))
  if os.path.isdir(os.path.join(REPO, shipped)):
    paths += [os.path.join(shipped, f) for f in sorted(os.listdir(os.path.join(REPO, shipped)))
              if f.endswith(".safetensors")]
  return {path: cli.file_digest(os.path.join(REPO, path)) for path in paths}


def fingerprint(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """What a run's timed calls depend on besides its prompts' order: the config, the code (cli.code_digest), the
  checkpoint files it may decode with (`checkpoint_digests`), and the machine. A stopped run resumes only where all of
  these are the same; results.json keeps it, so the publication can tell a run whose checkpoints changed since."""
  env = environment()
  checkpoints = checkpoint_digests(config)
  return {"config": config.to_dict(), "code": cli.code_digest(), "checkpoints": checkpoints,
          "machine": {key: env[key] for key in ("jax", "backend", "devices", "cpu_count", "platform")}}


def _record(method: Method, batch: PromptBatch, repeat: int, temperature: float, out: specjax.Output, seconds: float,
            compile_call_seconds: float | None, matches: bool | None,
            agreement: list[float] | None = None) -> dict[str, Any]:
  """One timed call: its time, and the engine's per-row counts (so that the report can pool them exactly)."""
  stats = out.stats
  return {
      "method": method.name, "batch": batch.index, "rows": len(batch.prompts), "repeat": repeat,
      "temperature": temperature,
      "category": batch.category, "question_ids": [q.question_id for q in batch.questions], "seconds": seconds,
      "new_tokens": stats["new_tokens"], "tokens_per_second": stats["new_tokens"] / seconds,
      "target_calls": stats["target_calls"], "mean_accepted": stats["mean_accepted"],
      "acceptance_rate": stats.get("acceptance_rate"), "alpha": stats.get("alpha"),
      "acceptance_per_position": stats.get("acceptance_per_position"),
      "new_tokens_per_row": stats.get("new_tokens_per_row"), "rounds_per_row": stats.get("rounds_per_row"),
      "accepted_per_row": stats.get("accepted_per_row"), "rejections_per_row": stats.get("rejections_per_row"),
      "proposed_per_row": stats.get("proposed_per_row"), "proposed_per_position": stats.get("proposed_per_position"),
      "gamma_histogram": stats.get("gamma_histogram"), "plain_steps": stats.get("plain_steps"),
      "tree_rounds": stats.get("tree_rounds"),
      "forward_costs": stats.get("forward_costs"), "forward_costs_source": stats.get("forward_costs_source"),
      "compile_call_seconds": compile_call_seconds,
      "matches_baseline": matches, "agreement": agreement}


def _method_info(methods: Sequence[Method]) -> dict[str, dict[str, Any]]:
  return {m.name: {"drafter": m.drafter.name if m.drafter is not None else None, "family": m.family or m.name,
                   "options": m.options, "gamma": m.gamma if m.drafter is not None else None,
                   "adaptive": _adaptive_info(m.adaptive) if m.drafter is not None else None,
                   "tree_nodes": m.tree_nodes} for m in methods}


def _adaptive_info(adaptive: bool | specjax.AdaptiveDrafting) -> bool | dict[str, Any]:
  """For results.json: True or False, or the options of adaptive drafting (a dict, which reads as true)."""
  if isinstance(adaptive, specjax.AdaptiveDrafting):
    return {k: v for k, v in dataclasses.asdict(adaptive).items() if k != "costs"}  # `costs`: set per program
  return adaptive


def _measure_costs(config: ml_collections.ConfigDict, model: specjax.Model, methods: Sequence[Method],
                   questions: Sequence[spec_bench.Question], prompts: Sequence[Sequence[int]], outputs: Sequence[dict],
                   temperature: float, rows: int) -> dict | None:
  """experiments/costs.py on the run's typical context: the prompt of median length with the first half of its
  baseline answer, in a cache of the prompts' median size, `rows` rows."""
  options = config.get("costs")
  drafted = [(m.name, m.drafter, m.gamma) for m in methods if m.drafter is not None and m.tree_nodes is None]
  if options is None or not options.enabled or not drafted:
    return None
  if jax.process_count() > 1:
    logging.warning("costs are measured in single-process runs only; this run has %d processes", jax.process_count())
    return None
  lengths = [len(p) for p in prompts]
  median = int(np.argsort(lengths)[len(lengths) // 2])
  answer = next(o["tokens"] for o in outputs if o["method"] == methods[0].name and o["temperature"] == temperature
                and o["batch_size"] == rows and o["question_id"] == questions[median].question_id)
  context = list(prompts[median]) + list(answer[:config.max_new_tokens // 2])
  max_gamma = max(g for _, _, g in drafted)
  cache_len = int(np.median([prepare_batch(model, [p], config.max_new_tokens, extra_positions=max_gamma + 1).cache_len
                             for p in prompts]))
  sampling = SamplingParams(temperature=temperature, top_k=config.top_k, top_p=config.top_p)
  start = time.perf_counter()
  measured = costs.measure(model, drafted, context, max(cache_len, len(context) + max_gamma + 2),
                           rows=rows, repeats=options.repeats, sampling=sampling,
                           count_bytes=options.count_bytes)
  measured["seconds"] = time.perf_counter() - start
  logging.info("costs measured in %.1f s (context %d tokens, cache %d)", measured["seconds"], len(context),
               measured["cache_len"])
  return measured


def _accelerator_costs() -> dict | None:
  """The round costs on a TPU that the accelerator projection reads (experiments/projection.py: the analytic cost
  model's), or None (with a warning) where the checkout has no such file."""
  try:
    return projection.read()
  except (OSError, ValueError) as e:
    logging.warning("no accelerator projection: %s", e)
    return None


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  code_commit()  # the code this run starts with, reported in results.json
  distributed.initialize_from_flags()  # before any JAX computation; a no-op for a single process
  config_file = config_flags.get_config_filename(flags.FLAGS["config"])
  name = os.path.basename(config_file).replace(".py", "").replace(":", "-")
  workdir = _WORKDIR.value or os.path.join("workdirs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
  results = run(_CONFIG.value, workdir, name=name)
  if results["summary"]["lossless_failures"]:  # the results are written; the exit status says they are wrong
    sys.exit(f"NOT LOSSLESS: {report.lossless_banner(results['summary'])} Results in {workdir}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=parse_flags)
