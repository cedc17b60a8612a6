r"""How much optimism adaptive drafting should have: the trained drafters at several `AdaptiveDrafting.optimism` values.

  python -m experiments.run --config=configs/adaptive_optimism.py          # 5 prompts x 7 categories, 3 repeats
  python -m experiments.run --config=configs/adaptive_optimism.py:small    # 2 prompts x 7 categories, 3 repeats

Where the running acceptance says a plain step, adaptive drafting drafts anyway while an acceptance `optimism` (z)
standard errors above it says drafting pays (specjax/adaptive.py). Its acceptance counts decay by `memory` = 0.9 a
round, so they never hold more than about ten drafts, and the standard error never falls below about
sqrt(alpha (1 - alpha) / 11): at alpha 0.1 the bonus is z x 0.09, and the prior (0.5, worth one draft) adds 0.04 more.
A drafter that accepts half of what it needs to break even still drafts in a share of rounds: on translation
(results/adaptive_by_category-full/) the exit adapter (alpha 0.08, break-even 0.17) drafted in 27% of rounds and
the draft model (alpha 0.11) in 53%, and both read 0.94-0.96x. Less optimism drafts less there, and holds a paying
drafter in plain steps longer after a dip where drafting pays little.

Methods: autoregressive decoding, and the two drafters whose acceptance lies near their break-even (the distilled
draft model and the trained exit adapter; prompt lookup and the MTP heads draft in every round, the untrained early
exit in none, so the optimism does not change them), each at optimism 0.5 (the default), 0.25 and 0, named
`<drafter>_z<optimism>`. Categories: the ones where they read lowest in that run (translation, extraction, coding,
writing, humanities) and two where drafting pays (roleplay, qa). Greedy, batch 1, 64 new tokens, every call paired
with the baseline's (results.md, "Speedup by category"), every output checked token for token.

Prompts of the dev side of the dev/test split (the comparisons report the test side). Time on 2 CPU cores: 39 min for
the earlier default of 8 prompts a category (results/adaptive_optimism/), compiling included.
"""

from configs import common

OPTIMISMS = (0.5, 0.25, 0.0)
DRAFTERS = ("draft_model", "layer_skip_trained_exit")
CATEGORIES = ("writing", "roleplay", "coding", "extraction", "humanities", "translation", "qa")


def get_config(arg=None):
  variants = common.parse_variants(arg, "configs/adaptive_optimism.py", ("small",))
  return common.adaptive_variants(2 if "small" in variants else 5, CATEGORIES, DRAFTERS,
                                  {f"_z{z:g}": {"optimism": z} for z in OPTIMISMS})
