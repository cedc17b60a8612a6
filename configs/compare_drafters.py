r"""Every drafter against autoregressive decoding on all 13 Spec-Bench categories, with costs and projections.

  python -m experiments.run --config=configs/compare_drafters.py:small      # 1 prompt x 13 categories, 64 tokens
  python -m experiments.run --config=configs/compare_drafters.py            # 5 prompts x 13 categories, 128 tokens
  python -m experiments.run --config=configs/compare_drafters.py:small,sampling   # temperature 0.7, top-p 0.9
  python -m experiments.run --config=configs/compare_drafters.py:small,both       # greedy, then 0.7 (alpha plot)

Expected time on 2 CPU cores: `:small` (64 tokens) took 17 min, of which compiling 31 shape buckets (4-10 s
each) and 2-3 min of cost loops (results/compare_drafters-small/); the full config took 86 min, of which 5 min
compiling (results/compare_drafters/). `both` runs everything twice.

Methods (configs/common.py; SmolLM2-135M-Instruct, fp32, batch 1, gamma 4 unless a method sets its own): prompt
lookup; untrained early exit after layer 24; the best layer-skip set found by the search
(configs/layer_skip_sets/smollm2-135m.json, with the gamma it was searched for) and the best set of the multi-layer
search on ShareGPT text (smollm2-135m-deep.json); a trained exit adapter (layer_skip adapter="default"); the
distilled draft model ("smollm2-135m-draft"); parallel MTP heads and a sequential MTP module (the shipped
checkpoints). A method that `needs` a shipped checkpoint not yet in specjax/checkpoints/smollm2-135m/ is left out
with a warning in the log and listed in results.md. Variants (comma-separated): `small` (one prompt per category, 64
tokens, one repeat), `sampling` (temperature 0.7, top-p 0.9: lossless in distribution, so no token check), `both`
(greedy, then temperature 0.7 on the same prompts: results.md's table is greedy, alpha_by_temperature.png compares
them), `adaptive` (adaptive drafting, specjax/adaptive.py: per-row confidence stop and a per-round draft length from
the running acceptance and the costs, `gamma` the most per round; by default every round drafts `gamma` tokens, so
that acceptance per position is measured at a fixed chain length), `budget` (prompt lookup and the searched skip set
beside every drafter trained on one budget, `budget_<run>`, from its run's checkpoint in workdirs/budget/: the
comparison at equal training; a run not trained yet is left out, as a missing checkpoint is), `data` (the data
control: the sequential module trained on the target's own answers against the same module trained on ShareGPT's
answers at equal positions, `budget_sequential` and `budget_sequential_sharegpt`, paired in one run).
"""

from configs import common

VARIANTS = ("small", "sampling", "both", "adaptive", "budget", "data")
METHODS = ("autoregressive", "prompt_lookup", "layer_skip_exit24", "layer_skip_best_set", "layer_skip_deep_set",
           "layer_skip_trained_exit", "draft_model", "mtp_parallel", "mtp_sequential")
# `budget`: the drafters trained on one budget (configs/train_budget.py), beside the untrained ones at their best.
BUDGET_METHODS = ("autoregressive", "prompt_lookup", "layer_skip_best_set",
                  *(common.budget_method(run)["name"] for run in common.BUDGET_RUNS))
# `data`: does training on the target's own answers matter? The same family, budget and held-out split.
DATA_METHODS = ("autoregressive", "budget_sequential", "budget_sequential_sharegpt")


def get_config(arg=None):
  variants = common.parse_variants(arg, "configs/compare_drafters.py", VARIANTS)
  if {"sampling", "both"} <= variants:
    raise ValueError("configs/compare_drafters.py: 'sampling' and 'both' exclude each other")
  config = common.drafter_comparison(small="small" in variants, adaptive="adaptive" in variants)
  config.temperature = 0.7 if "sampling" in variants else 0.0
  config.temperatures = (0.0, 0.7) if "both" in variants else ()
  if {"budget", "data"} <= variants:
    raise ValueError("configs/compare_drafters.py: 'budget' and 'data' exclude each other ('budget' has both "
                     "methods of 'data')")
  config.methods = common.methods(*(BUDGET_METHODS if "budget" in variants else
                                    DATA_METHODS if "data" in variants else METHODS))
  return config
