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

from configs import compare_drafters


def get_config(arg=None):
  variants = compare_drafters.parse_variants(arg, "configs/gamma_sweep.py", allowed=("small",))
  config = compare_drafters.get_config(",".join(sorted(variants)))
  if "small" not in variants:
    config.prompts.per_category = 2
  config.gammas = (1, 2, 3, 4, 6)
  config.methods = tuple(m for m in compare_drafters.drafter_methods()
                         if m["name"] not in ("layer_skip_exit24",))  # the searched set stands for layer skip
  config.repeats = 1
  return config
