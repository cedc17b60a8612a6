r"""Adaptive drafting against every fixed draft length, per drafter, in one run.

  python -m experiments.run --config=configs/adaptive_vs_fixed.py:small   # 1 prompt x 13 categories, 64 tokens
  python -m experiments.run --config=configs/adaptive_vs_fixed.py         # 2 prompts x 13 categories, 128 tokens
  python -m experiments.run --config=configs/adaptive_vs_fixed.py:small,g1,g2   # fixed gamma 1 and 2 only

Each of specjax's drafters (configs/common.py's DRAFTERS: prompt lookup, the untrained early exit after layer 24,
the shipped MTP heads, distilled draft model and exit adapter) runs with adaptive drafting (the library default:
per-row confidence bars and a draft length per round from the running acceptance and the measured costs, at most
`gamma` = 4 tokens, plain steps where drafting cannot pay; named as in common.METHODS) and with every fixed draft
length 1..4, or the ones named as `g<gamma>` arguments (`<drafter>_g<gamma>`: every round drafts gamma tokens), all
against autoregressive decoding, interleaved per prompt, two repeats. results.md's "Adaptive against fixed draft
lengths" table puts each drafter's adaptive speedup beside its best and worst fixed one. Greedy, batch 1; every
output is checked token for token against autoregressive decoding.

Time on 2 CPU cores: `:small` on its 10 categories with prompts under 128 tokens (`--config.prompts.categories=...`)
took 42-46 min, most of it compiling the 31 methods' programs for the shape buckets, and `:small,g1,g2` (19 methods,
results/adaptive_vs_fixed/) 29 min; the long prompts of extraction, summarization and rag add two buckets (about
20 min more for all 31).
"""

from configs import common

GAMMAS = (1, 2, 3, 4)


def get_config(arg=None):
  variants = common.parse_variants(arg, "configs/adaptive_vs_fixed.py",
                                   tuple(f"g{gamma}" for gamma in GAMMAS) + ("small",))
  small = "small" in variants
  gammas = [gamma for gamma in GAMMAS if f"g{gamma}" in variants] or GAMMAS
  config = common.spec_bench_run(per_category=1 if small else 2, max_new_tokens=64 if small else 128, repeats=2)
  methods = list(common.methods("autoregressive"))
  for method in common.methods(*common.DRAFTERS):
    methods.append({**method, "adaptive": True, "gamma": max(GAMMAS)})
    methods += [{**method, "name": f"{method['name']}_g{gamma}", "adaptive": False, "gamma": gamma}
                for gamma in gammas]
  config.methods = tuple(methods)
  return config
