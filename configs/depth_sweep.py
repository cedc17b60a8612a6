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

from configs import compare_drafters

EXIT_LAYERS = (8, 16, 20, 24, 28)


def get_config(arg=None):
  variants = compare_drafters.parse_variants(arg, "configs/depth_sweep.py", allowed=("small",))
  config = compare_drafters.get_config(",".join(sorted(variants)))
  if "small" not in variants:
    config.prompts.per_category = 2
  config.methods = (
      ({"name": "autoregressive"},)
      + tuple({"name": f"layer_skip_exit{k}", "drafter": "layer_skip", "options": {"exit_layer": k}}
              for k in EXIT_LAYERS)
      + ({"name": "mtp_parallel", "drafter": "mtp_parallel", "options": {}},
         {"name": "mtp_sequential", "drafter": "mtp_sequential", "options": {}}))
  config.repeats = 1
  return config
