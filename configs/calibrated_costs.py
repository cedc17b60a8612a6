r"""Adaptive drafting planning with forward costs calibrated for the model it runs, against the typed table.

  python -m experiments.run --config=configs/calibrated_costs.py:smollm2         # 1 prompt x 13 categories
  python -m experiments.run --config=configs/calibrated_costs.py:gemma3          # the same on Gemma-3-270M
  python -m experiments.run --config=configs/calibrated_costs.py:smollm2,small   # 1 prompt x 3 categories, a check
  python -m experiments.run --config=configs/calibrated_costs.py:gemma3,batch4   # also at batch 4

Adaptive drafting prices a round with f(n), a target forward over n rows (batch rows x tokens) over a 1-row one
(specjax/adaptive.py). With `forward_costs=None` (the default) it plans with f(n) measured for the model, dtype, rows
and host it runs on (specjax/calibration.py: at the first call, then from the cache); with "typed", with
`specjax.adaptive.CPU_FORWARD_COSTS`, measured once for SmolLM2-135M float32 on one CPU, whatever the model. Each
drafter runs both ways, `<drafter>_calibrated` and `<drafter>_typed`, at gamma 4, as a chain and (`_tree16`) with
trees of 16 nodes where they pay (their verification is a forward over 17 rows a batch row: the steep part of f),
against autoregressive decoding, interleaved per prompt. Drafters: prompt lookup (no draft cost: the plan weighs
its acceptance against the forward costs alone) on both models; on SmolLM2 also the shipped parallel MTP heads.
SmolLM2-135M-Instruct gets the chat template; Gemma-3-270M is a base model: plain-text prompts. Greedy, 128 new
tokens, 2 repeats; every output is checked token for token. results.md's "Forward costs" table gives each method's
f(n) and where it came from, its rounds by draft length and tree rounds, its speedup, and the paired speedup of
calibrated over typed with its interval (experiments/report.py, `forward_costs_table`).

The calibrations run in the warmup calls, once per model, gamma, tree size and batch (seconds each, compiling
included; the records of the timed calls say "cached"), so on a loaded machine they time the load too: run it on a
quiet one, with no earlier calibration of this machine in the cache (`rm -r ~/.cache/specjax/forward_costs`, or a
`$SPECJAX_CACHE` of its own), since a cached table is read, not measured again.
Time on 2 CPU cores shared with other jobs: `:smollm2,small` took 9 min and `:gemma3,small` 6 min (18 and 10
programs compiled: 2 prompt-length buckets); the full runs (1 prompt a category, 2 repeats: 234 and 130 timed calls
of 128 tokens, 5 buckets) are for a quiet machine; `batch4` adds about half again.
"""

from configs import common

MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
# Drafters per model (names in common.METHODS): those that need no checkpoint the model lacks.
DRAFTERS = {"smollm2": ("prompt_lookup", "mtp_parallel"), "gemma3": ("prompt_lookup",)}
TREE_NODES = 16
VARIANTS = {"_calibrated": {}, "_typed": {"forward_costs": "typed"}}  # AdaptiveDrafting options
SMALL_CATEGORIES = ("writing", "coding", "extraction")


def get_config(arg=None):
  variants = common.parse_variants(arg, "configs/calibrated_costs.py", tuple(MODELS) + ("small", "batch4"))
  models = [m for m in MODELS if m in variants]
  if len(models) != 1:
    raise ValueError(f"configs/calibrated_costs.py runs one model a run: name one of {', '.join(MODELS)}, got {arg!r}")
  small = "small" in variants
  config = common.spec_bench_run(per_category=1, max_new_tokens=32 if small else 128, repeats=1 if small else 2,
                                 model=MODELS[models[0]])
  config.chat = models[0] != "gemma3"  # Gemma-3-270M is a base model: the question as plain text
  if small:
    config.prompts.categories = SMALL_CATEGORIES
  if "batch4" in variants:
    config.batch_sizes = (1, 4)
  methods = list(common.methods("autoregressive"))
  for method in common.methods(*DRAFTERS[models[0]]):
    for tree_nodes in (None, TREE_NODES):
      for suffix, options in VARIANTS.items():
        tree = {} if tree_nodes is None else {"tree_nodes": tree_nodes}
        name = method["name"] + ("" if tree_nodes is None else f"_tree{tree_nodes}") + suffix
        methods.append({**method, **tree, "name": name, "adaptive": dict(options), "gamma": 4})
  config.methods = tuple(methods)
  return config
