r"""What a speculative round that does not draft costs against an autoregressive step, per drafter.

  python benchmarks/bench_plain_round.py [--new_tokens=64] [--repeats=5] [--batch=1]
      [--drafters=prompt_lookup,layer_skip,mtp_parallel,mtp_sequential,draft_model,exit_adapter]

With adaptive drafting a drafter that cannot pay falls back to plain target steps inside the speculative loop; this
is the floor of its speed. Each drafter decodes one Spec-Bench prompt (writing, chat template) greedily with
adaptive drafting and a draft step priced at 100 target steps (`Drafter.cost`), so no round drafts (checked: every
round is a plain step); autoregressive `generate` decodes the same prompt. `--batch=B` decodes the first B writing
prompts together instead. A drafter with its own cache (the distilled draft model, the exit adapter, sequential
MTP) follows every plain step (its `update` over the step's token). Per method, seconds per decode step =
(t(new_tokens) - t(8)) / (new_tokens - 8), so prefill and per-call overhead cancel; the methods run interleaved,
medians over `--repeats` rounds, after a first call of each length that compiles.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from absl import app, flags

import specjax
from experiments import spec_bench

_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens per call (more than 8).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timing rounds.")
_BATCH = flags.DEFINE_integer("batch", 1, "Prompts decoded together (Spec-Bench writing prompts).")
_DRAFTERS = flags.DEFINE_list(
    "drafters", ["prompt_lookup", "layer_skip", "mtp_parallel", "mtp_sequential", "draft_model", "exit_adapter"],
    "Drafters to time.")
# method -> (drafter, options): the shipped trained drafters, and layer skip exiting after 24 layers
_DRAFTER_OPTIONS = {"layer_skip": ("layer_skip", {"exit_layer": 24}),
                    "exit_adapter": ("layer_skip", {"adapter": "default"}),
                    "draft_model": ("draft_model", {"draft": "smollm2-135m-draft"})}


def main(argv):
  del argv
  n = _NEW_TOKENS.value
  if n <= 8:
    raise app.UsageError("--new_tokens must be more than 8")
  model = specjax.load("smollm2-135m")
  questions = spec_bench.select(spec_bench.load_questions(), categories=["writing"], per_category=_BATCH.value)
  prompts = [spec_bench.prompt_ids(question, model.tokenizer, chat=True) for question in questions]

  def decode(drafter):
    if drafter is not None:  # a draft step priced at 100 target steps: no round drafts
      drafter = dataclasses.replace(drafter, cost=dataclasses.replace(drafter.cost, step=100.0))
    return lambda tokens: specjax.generate(model, prompts, max_new_tokens=tokens, stop_ids=(), drafter=drafter)
  runs = {"autoregressive": decode(None)}
  for name in _DRAFTERS.value:
    drafter_name, options = _DRAFTER_OPTIONS.get(name, (name, {}))
    runs[name] = decode(specjax.make_drafter(drafter_name, model, **options))
  for run in runs.values():
    run(n), run(8)
  seconds = {name: [] for name in runs}
  for _ in range(_REPEATS.value):
    for name, run in runs.items():
      start = time.perf_counter()
      out = run(n)
      middle = time.perf_counter()
      run(8)
      seconds[name].append(((middle - start) - (time.perf_counter() - middle)) / (n - 8))
      if name != "autoregressive" and out.stats["plain_steps"] != out.stats["rounds"]:
        raise AssertionError(f"{name} drafted: {out.stats}")
  base = statistics.median(seconds["autoregressive"])
  print(f"\nSmolLM2-135M, fp32, batch {len(prompts)}, {n} new tokens, median of {_REPEATS.value} interleaved rounds\n")
  print(f"{'method':<20} {'ms/step':>8} {'speed vs autoregressive':>24}")
  for name, values in seconds.items():
    step = statistics.median(values)
    print(f"{name:<20} {1e3 * step:>8.2f} {base / step:>23.3f}x")


if __name__ == "__main__":
  app.run(main)
