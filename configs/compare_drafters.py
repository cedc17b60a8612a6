r"""Every drafter against autoregressive decoding on all 13 Spec-Bench categories, with costs and projections.

  python -m experiments.run --config=configs/compare_drafters.py:small      # 1 prompt x 13 categories, 64 tokens
  python -m experiments.run --config=configs/compare_drafters.py            # 5 prompts x 13 categories, 128 tokens
  python -m experiments.run --config=configs/compare_drafters.py:small,sampling   # temperature 0.7, top-p 0.9
  python -m experiments.run --config=configs/compare_drafters.py:small,both       # greedy, then 0.7 (alpha plot)

Expected time on 2 CPU cores: `:small` (64 tokens) took 17 min, of which compiling 31 shape buckets (4-10 s
each) and 2-3 min of cost loops (results/compare_drafters-small/); the full config took 86 min, of which 5 min
compiling (results/compare_drafters/). `both` runs everything twice.

Methods (SmolLM2-135M-Instruct, fp32, batch 1, gamma 4 unless a method sets its own): prompt lookup; untrained
early exit after layer 24; the best layer-skip set found by the search (configs/layer_skip_sets/smollm2-135m.json,
with the gamma it was searched for) and the best set of the multi-layer search on ShareGPT text
(smollm2-135m-deep.json); a trained exit adapter (layer_skip adapter="default"); the distilled draft
model ("smollm2-135m-draft"); parallel MTP heads and a sequential MTP module (the shipped checkpoints). A method
that `needs` a shipped checkpoint not yet in specjax/checkpoints/smollm2-135m/ is left out with a warning in the
log and listed in results.md. Variants (comma-separated): `small` (one prompt per category, 64 tokens, one
repeat), `sampling` (temperature 0.7, top-p 0.9: lossless in distribution, so no token check), `both` (greedy,
then temperature 0.7 on the same prompts: results.md's table is greedy, alpha_by_temperature.png compares them),
`adaptive` (adaptive drafting, specjax/adaptive.py: per-row confidence stop and a per-round draft length from the
running acceptance and the costs, `gamma` the most per round; by default every round drafts `gamma` tokens, so that
acceptance per position is measured at a fixed chain length).
"""

import os

from configs import bench_peers, common
from specjax.drafters import layer_skip

SKIP_SET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layer_skip_sets", "smollm2-135m.json")
# The multi-layer search on ShareGPT training text (teacher-forced, `--method=teacher_forced`).
DEEP_SKIP_SET = os.path.join(os.path.dirname(SKIP_SET), "smollm2-135m-deep.json")
VARIANTS = ("small", "sampling", "both", "adaptive")


def best_skip_set(path: str = SKIP_SET, name: str = "layer_skip_best_set") -> dict:
  """A searched layer-skip set as a method: its options and the gamma it was searched for."""
  record = layer_skip.read_skip_set(path)
  return {"name": name, "drafter": "layer_skip", "options": layer_skip.load_skip_set(path),
          "gamma": int(record["gamma"])}


def drafter_methods() -> tuple:
  return (
      {"name": "autoregressive"},
      {"name": "prompt_lookup", "drafter": "prompt_lookup", "options": {}},
      {"name": "layer_skip_exit24", "drafter": "layer_skip", "options": {"exit_layer": 24}},
      best_skip_set(),
      best_skip_set(DEEP_SKIP_SET, "layer_skip_deep_set"),
      {"name": "layer_skip_trained_exit", "drafter": "layer_skip", "options": {"adapter": "default"},
       "needs": ("exit_adapter",)},
      {"name": "draft_model", "drafter": "draft_model",
       "options": {"draft": "smollm2-135m-draft", "prompt_window": bench_peers.DRAFT_PROMPT_WINDOW},
       "needs": ("draft_model",)},
      {"name": "mtp_parallel", "drafter": "mtp_parallel", "options": {}},
      {"name": "mtp_sequential", "drafter": "mtp_sequential", "options": {}},
  )


def parse_variants(arg, config_name: str, allowed=VARIANTS) -> set:
  variants = {a.strip() for a in (arg or "").split(",") if a.strip()}
  unknown = sorted(variants - set(allowed))
  if unknown:
    raise ValueError(f"{config_name} takes a comma-separated subset of {', '.join(allowed)}; got {unknown}")
  if {"sampling", "both"} <= variants:
    raise ValueError(f"{config_name}: 'sampling' and 'both' exclude each other")
  return variants


def get_config(arg=None):
  variants = parse_variants(arg, "configs/compare_drafters.py")
  small = "small" in variants
  config = common.spec_bench_run(per_category=1 if small else 5, max_new_tokens=64 if small else 128,
                                 adaptive="adaptive" in variants, repeats=1 if small else 2)
  config.temperature = 0.7 if "sampling" in variants else 0.0
  config.temperatures = (0.0, 0.7) if "both" in variants else ()
  config.top_p = 0.9  # applies when sampling
  config.methods = drafter_methods()
  config.costs = common.costs(repeats=5)
  return config
