r"""Gamma sweep: tokens per target forward (mean_accepted) and speedup against gamma, per drafter.

  python -m experiments.run --config=configs/gamma_sweep.py:small    # 1 prompt x 13 categories, 64 tokens
  python -m experiments.run --config=configs/gamma_sweep.py          # 2 prompts x 13 categories, 128 tokens

Every drafter runs at each gamma in `config.gammas` (named `<method>_g<gamma>`; a drafter that proposes at most
K tokens, like 4 parallel MTP heads, stops at K). Writes mean_accepted_vs_gamma.png (mean accepted and speedup
against gamma, one line per drafter) beside the usual table. Expected time on 2 shared CPU cores (estimated from
compare_drafters.py:small's measured ~20 s per compiled program, not run end to end): `:small` about an hour
(20 programs per prompt-length bucket, 4 buckets, then cost loops for 19 drafter/gamma pairs); the full config
several hours.
Greedy; `--config.temperature=0.7` samples instead. Methods needing a checkpoint not shipped yet are left out
with a warning (see configs/compare_drafters.py).
"""

from configs import common

# The searched skip set stands for layer skip (no untrained early exit).
METHODS = ("autoregressive", "prompt_lookup", "layer_skip_best_set", "layer_skip_deep_set", "layer_skip_trained_exit",
           "draft_model", "mtp_parallel", "mtp_sequential")


def get_config(arg=None):
  variants = common.parse_variants(arg, "configs/gamma_sweep.py", ("small",))
  config = common.drafter_comparison(small="small" in variants, split="dev")
  if "small" not in variants:
    config.prompts.per_category = 2
  config.gammas = (1, 2, 3, 4, 6)
  config.methods = common.methods(*METHODS)
  config.repeats = 1
  return config
