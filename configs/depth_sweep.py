r"""Acceptance against depth: layer skip's early exit after k layers (several k) beside MTP's heads at depth 1..4.

  python -m experiments.run --config=configs/depth_sweep.py:small    # 1 prompt x 13 categories, 64 tokens
  python -m experiments.run --config=configs/depth_sweep.py          # 2 prompts x 13 categories, 128 tokens

An untrained exit after layer k drafts with the target's first k layers; its acceptance (alpha) grows with k and
so does its cost. An MTP head at depth k predicts k tokens ahead from the newest committed position; its
acceptance given the heads before it were right falls with k. acceptance_vs_depth.png puts both side by side
(left: alpha against exit layer; right: per-depth acceptance of the MTP drafters), acceptance_per_position.png
shows every method's share of rounds with drafts 1..k accepted. Greedy, gamma 4. Expected time on 2 shared CPU
cores (estimated from compare_drafters.py:small's measured ~20 s per compiled program, not run end to end):
`:small` about 25 minutes (8 programs per prompt-length bucket, 4 buckets, then the cost loops); the full config
hours.
"""

from configs import common

EXIT_LAYERS = (8, 16, 20, 24, 28)


def get_config(arg=None):
  variants = common.parse_variants(arg, "configs/depth_sweep.py", ("small",))
  config = common.drafter_comparison(small="small" in variants, split="dev")
  if "small" not in variants:
    config.prompts.per_category = 2
  config.methods = (common.methods("autoregressive") + tuple(common.layer_skip_exit(k) for k in EXIT_LAYERS)
                    + common.methods("mtp_parallel", "mtp_sequential"))
  config.repeats = 1
  return config
