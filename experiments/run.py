r"""Runs an experiment config: decoding methods on Spec-Bench prompts, timed against autoregressive decoding.

  python -m experiments.run --config=configs/quickstart.py [--workdir=DIR] [--config.max_new_tokens=16]

Writes to the workdir (default workdirs/<config>-<time>/): results.json (config, environment, every timed
call, every prompt's output per method, summary), results.md (the table), speedup.png and
speedup_by_category.png; prints the table.

Timing, so that the comparison is fair on a noisy shared machine:
  * warmup: every method runs once on the first prompt batch, untimed; the compilation it needed
    (`compile_seconds` from specjax.generate) is reported as "compile s";
  * methods are interleaved: for each prompt batch, every method runs in turn (`repeats` times), so slow
    drifts of the machine hit all methods alike;
  * a timed call that compiled (a new prompt-length bucket; specjax logs "compiling ... for a new shape
    bucket" while it does) is run again and only the rerun counts;
  * tokens/s is the median over batches, speedup is relative to the autoregressive baseline of this run.
With temperature 0 every method's tokens are compared with the baseline's, token for token (`lossless`).

A method names a specjax drafter (`"drafter"`; none: autoregressive) or a peer (`"peer"`: another
implementation on the same weights, e.g. HF transformers or llama.cpp, see experiments/peers.py), timed
interleaved with the rest. A peer is not specjax, so it is not checked for losslessness: its greedy tokens'
agreement with the baseline is reported instead (`agreement`: tokens until the first divergence over the row's
length, averaged over rows; `equal_rows`: the fraction of rows equal token for token). A peer whose library is
not installed is left out with a printed reason.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags
from tqdm import tqdm

import specjax
from specjax import compilation, distributed, sharding
from experiments import cli, peers, report, spec_bench
from experiments.cli import environment, parse_flags

_CONFIG = cli.define_config_flag("Experiment config: configs/<name>.py[:arg].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: workdirs/<config>-<time>).")
distributed.define_flags()  # --coordinator_address, --num_processes, --process_id (multi-process runs)

METHOD_KEYS = {"name", "drafter", "peer", "options", "gamma"}


@dataclasses.dataclass(frozen=True)
class Method:
  name: str
  drafter: Any  # from specjax.make_drafter; None decodes autoregressively
  gamma: int
  peer: Any = None  # from peers.make: another implementation, which decodes instead of specjax


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  index: int
  category: str
  questions: tuple[spec_bench.Question, ...]
  prompts: tuple[tuple[int, ...], ...]  # token ids


def make_methods(config: ml_collections.ConfigDict, model: specjax.Model) -> list[Method]:
  """The methods to run, the autoregressive baseline (the first method without a drafter) first."""
  specs = [dict(m) for m in config.methods]
  for spec in specs:
    if "name" not in spec or set(spec) - METHOD_KEYS:
      raise ValueError(f"a method is a dict with 'name' and optionally {sorted(METHOD_KEYS - {'name'})}, "
                       f"got {spec}")
    if spec.get("drafter") and spec.get("peer"):
      raise ValueError(f"a method names a drafter or a peer, not both: {spec}")
    if spec.get("peer") and spec["peer"] not in peers.PEERS:
      raise ValueError(f"unknown peer {spec['peer']!r} in {spec}; peers: {', '.join(peers.PEERS)}")
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
  methods = []
  for spec in chosen:
    gamma = int(spec.get("gamma", config.gamma))
    if spec.get("peer"):
      try:
        peer = peers.make(spec["peer"], model, config.model, gamma=gamma, temperature=config.temperature,
                          **dict(spec.get("options", {})))
      except peers.Unavailable as e:
        print(f"leaving out {spec['name']}: {e}")
        logging.warning("leaving out %s: %s", spec["name"], e)
        continue
      methods.append(Method(spec["name"], None, gamma, peer=peer))
      continue
    drafter = (specjax.make_drafter(spec["drafter"], model, **dict(spec.get("options", {})))
               if spec.get("drafter") else None)
    methods.append(Method(spec["name"], drafter, gamma))
  return methods


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
    logging.info("loading %s (%s)", config.model, config.dtype)
    model = specjax.load(config.model, dtype=config.dtype)
  if model.tokenizer is None:
    raise ValueError(f"{config.model} has no tokenizer; Spec-Bench prompts are text")
  questions = spec_bench.select(spec_bench.load_questions(), **config.prompts.to_dict())
  if not questions:
    raise ValueError("the prompt selection is empty")
  prompts = [spec_bench.prompt_ids(q, model.tokenizer, config.chat) for q in questions]
  batches = make_batches(questions, prompts, config.batch_size)
  mesh = None
  if config.mesh_shape:
    mesh = sharding.make_mesh(*config.mesh_shape)
    model = sharding.shard_model(model, mesh)  # place the parameters once, not in every timed call
  methods = make_methods(config, model)
  baseline = methods[0].name
  greedy = config.temperature == 0

  def call(method: Method, batch: PromptBatch) -> tuple[specjax.Output, float, int]:
    """One generate call: (output, wall seconds, compilations it triggered)."""
    compiled_before = compilation.count()
    start = time.perf_counter()
    if method.peer is not None:
      out = method.peer.generate(batch.prompts, max_new_tokens=config.max_new_tokens)
      return out, time.perf_counter() - start, 0
    out = specjax.generate(model, list(batch.prompts), max_new_tokens=config.max_new_tokens,
                           temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
                           seed=config.seed, drafter=method.drafter, gamma=method.gamma, mesh=mesh)
    return out, time.perf_counter() - start, compilation.count() - compiled_before

  compile_seconds: dict[str, float | None] = {m.name: None for m in methods}
  if config.warmup:
    for method in methods:
      out, seconds, _ = call(method, batches[0])
      compile_seconds[method.name] = out.stats["compile_seconds"]
      logging.info("warmup %s: %.1f s, of which compiling %.1f s", method.name, seconds,
                   compile_seconds[method.name])

  records, outputs = [], []
  lossless: dict[str, bool | None] = {m.name: (True if greedy and m.peer is None else None) for m in methods}
  for batch in tqdm(batches, desc="prompt batches", unit="batch", disable=not distributed.is_main_process()):
    reference = None  # the baseline's tokens for this batch
    for repeat in range(config.repeats):
      for method in methods:
        out, seconds, new_programs = call(method, batch)
        compile_call_seconds = None
        if new_programs:  # this call compiled a new shape: time a second, compiled call instead
          compile_call_seconds = out.stats["compile_seconds"]
          out, seconds, _ = call(method, batch)
        if reference is None:
          reference = out.tokens
        matches = out.tokens == reference if greedy else None
        agreement = report.agreement(out.tokens, reference) if greedy else None
        if method.peer is not None:
          if repeat == 0 and agreement is not None:
            logging.info("%s agrees with %s on batch %d: %s of the tokens until the first divergence", method.name,
                         baseline, batch.index, [round(a, 2) for a in agreement])
        elif greedy and not matches:
          lossless[method.name] = False
          logging.warning("%s differs from %s on batch %d (questions %s)", method.name, baseline, batch.index,
                          [q.question_id for q in batch.questions])
        stats = out.stats
        records.append({
            "method": method.name, "batch": batch.index, "repeat": repeat, "category": batch.category,
            "question_ids": [q.question_id for q in batch.questions], "seconds": seconds,
            "new_tokens": stats["new_tokens"], "tokens_per_second": stats["new_tokens"] / seconds,
            "target_calls": stats["target_calls"], "mean_accepted": stats["mean_accepted"],
            "acceptance_rate": stats.get("acceptance_rate"), "alpha": stats.get("alpha"),
            "compile_call_seconds": compile_call_seconds,
            "matches_baseline": matches, "agreement": agreement})
        if repeat == 0:
          for row, q in enumerate(batch.questions):
            outputs.append({
                "method": method.name, "question_id": q.question_id, "category": q.category,
                "prompt_tokens": len(batch.prompts[row]), "new_tokens": len(out.tokens[row]),
                "matches_baseline": out.tokens[row] == reference[row] if greedy else None,
                "agreement": agreement[row] if greedy else None,
                "tokens": out.tokens[row], "text": out.texts[row]})

  names = [m.name for m in methods]
  results = {
      "name": name,
      "config": config.to_dict(),
      "environment": environment(),
      "prompts": [{"question_id": q.question_id, "category": q.category, "prompt_tokens": len(p)}
                  for q, p in zip(questions, prompts)],
      "summary": report.summarize(records, names, baseline, compile_seconds, lossless),
      "records": records,
      "outputs": outputs,
  }
  if distributed.is_main_process():  # every process computed the same results; one writes them
    table = report.write(workdir, results)
    print(f"\n{table}\n\nresults in {workdir}")
  return results


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  distributed.initialize_from_flags()  # before any JAX computation; a no-op for a single process
  config_file = config_flags.get_config_filename(flags.FLAGS["config"])
  name = os.path.basename(config_file).replace(".py", "").replace(":", "-")
  workdir = _WORKDIR.value or os.path.join("workdirs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
  run(_CONFIG.value, workdir, name=name)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=parse_flags)
