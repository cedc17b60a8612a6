r"""Every drafter with adaptive drafting against autoregressive decoding, category by category, resolved.

  python -m experiments.run --config=configs/adaptive_by_category.py          # 4 prompts x 13 categories, 3 repeats
  python -m experiments.run --config=configs/adaptive_by_category.py:small    # 2 prompts x 13 categories, 3 repeats
  python -m experiments.run --config=configs/adaptive_by_category.py:full     # 5 prompts x 13 categories, 3 repeats

The question it answers: does any drafter, with the library's default adaptive drafting (at most `gamma` = 4
tokens a round, plain steps where drafting cannot pay), decode slower than autoregressive decoding on some
Spec-Bench category? On a shared CPU one call's time moves by 10-20% between repeats, so one prompt a category
(configs/adaptive_vs_fixed.py) cannot tell 0.95x from 1.0x. Here each category gets several prompts and repeats,
every call is paired with the baseline's call on the same prompt and repeat (interleaved, each repeat starting
one method later), and results.md's "Speedup by category" table gives each category's median paired speedup with
a distribution-free 90% interval and counts, per drafter, the categories whose interval lies above 0.95x,
contains it, or lies below it. Drafters: configs/common.py's DRAFTERS (prompt lookup, the untrained early exit
after layer 24, the shipped MTP heads, distilled draft model and exit adapter). Greedy, batch 1, 64 new tokens;
every output is checked token for token against autoregressive decoding.

Prompts of the test side of the dev/test split (experiments/spec_bench.py `in_split`). `:full` takes 5 prompts a
category (all of each MT-bench category's test side): the 65 prompts the comparisons report.

Time on 2 CPU cores: 7 methods x 52 prompts x 3 repeats of 64 tokens took 33 min (results/adaptive_by_category/),
7 min of it compiling each method for the five prompt-length buckets (46 programs, with a warm compilation cache);
the long prompts of summarization and rag take a third of the decoding time.
"""

from configs import common


def get_config(arg=None):
  variants = common.parse_variants(arg, "configs/adaptive_by_category.py", ("small", "full"))
  if len(variants) > 1:
    raise ValueError("configs/adaptive_by_category.py: 'small' and 'full' exclude each other")
  per_category = {"small": 2, "full": 5}.get(next(iter(variants), None), 4)
  config = common.spec_bench_run(per_category=per_category, max_new_tokens=64, repeats=3)
  config.methods = common.methods("autoregressive") + common.methods(*common.DRAFTERS, adaptive=True, gamma=4)
  return config
