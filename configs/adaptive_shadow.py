r"""Whether scoring the plain steps a drafter follows pays: the trained drafters with and without
`AdaptiveDrafting.shadow`.

  python -m experiments.run --config=configs/adaptive_shadow.py          # 8 prompts x 7 categories, 3 repeats
  python -m experiments.run --config=configs/adaptive_shadow.py:small    # 2 prompts x 7 categories, 3 repeats

Without it a plain step brings no evidence of the acceptance, so adaptive drafting learns whether drafting pays only
by drafting: where the running acceptance says a plain step it drafts anyway while an acceptance `optimism`
standard errors above it says drafting pays, and a drafter below its break-even (the trained exit adapter and the
distilled draft model on translation, alpha ~0.1) drafted in 28-53% of rounds (results/adaptive_optimism/). With
it, the drafter's first-slot predictions over the plain steps it follows anyway are scored as one-token drafts
(specjax/adaptive.py), at the cost of its output head once per catch-up (0.4% of a plain step).

Methods: autoregressive decoding, and the two drafters whose acceptance lies near their break-even (the distilled
draft model and the trained exit adapter) and the sequential MTP module, each with shadow evidence (the default,
named as in configs/bench_peers.py) and without (`<drafter>_no_shadow`). Categories as configs/adaptive_optimism.py:
where the two read lowest (translation, extraction, coding, writing, humanities) and two where drafting pays
(roleplay, qa). Greedy, batch 1, 64 new tokens, every call paired with the baseline's (results.md, "Speedup by
category"), every output checked token for token.

Time on 2 CPU cores: about 40 min for the default, compiling included.
"""

from configs import adaptive_optimism, bench_peers, common, compare_drafters

DRAFTERS = ("draft_model", "layer_skip_trained", "mtp_sequential")
CATEGORIES = adaptive_optimism.CATEGORIES


def get_config(arg=None):
  variants = compare_drafters.parse_variants(arg, "configs/adaptive_shadow.py", allowed=("small",))
  drafters = {m["name"]: m for m in bench_peers.drafter_methods()}
  return common.adaptive_variants(2 if "small" in variants else 8, CATEGORIES, bench_peers.MODEL,
                                  {name: drafters[name] for name in DRAFTERS},
                                  {"": {"shadow": True}, "_no_shadow": {"shadow": False}})
