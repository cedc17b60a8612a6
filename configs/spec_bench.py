r"""Spec-Bench: every drafter against autoregressive decoding on all 13 categories (Xia et al., 2024).

  python -m experiments.run --config=configs/spec_bench.py          # 5 prompts x 13 categories, 128 tokens
  python -m experiments.run --config=configs/spec_bench.py:small    # 1 prompt x 13 categories, 64 tokens

SmolLM2-135M-Instruct, fp32, greedy, batch 1, chat template on the first turn. `self_draft` drafts with the
target itself (there is no smaller SmolLM2 here): all drafts are accepted, so it measures what a round costs;
point its `draft` option at a smaller checkpoint with the same tokenizer to measure a real draft model.
"""

import ml_collections


def get_config(arg=None):
  if arg not in (None, "", "small"):
    raise ValueError(f"configs/spec_bench.py takes no argument or 'small', got {arg!r}")
  small = arg == "small"
  config = ml_collections.ConfigDict()
  config.model = "smollm2-135m"
  config.dtype = "float32"

  config.prompts = ml_collections.ConfigDict()
  config.prompts.categories = ()  # all 13
  config.prompts.per_category = 1 if small else 5
  config.prompts.question_ids = ()
  config.prompts.max_prompts = 0
  config.chat = True

  config.max_new_tokens = 64 if small else 128
  config.temperature = 0.0
  config.temperatures = ()  # run the comparison at each of these, the first giving the main table (empty: temperature)
  config.top_k = 0
  config.top_p = 1.0
  config.seed = 0
  config.batch_size = 1
  config.gamma = 4
  config.adaptive = True  # adaptive drafting (specjax/adaptive.py), the library default; False: gamma every round
  config.gammas = ()  # a gamma sweep: every drafter at each of these (empty: each method's own gamma)
  config.mesh_shape = ml_collections.config_dict.placeholder(tuple)

  config.methods = (
      {"name": "autoregressive"},
      {"name": "prompt_lookup", "drafter": "prompt_lookup", "options": {}},
      {"name": "layer_skip_24", "drafter": "layer_skip", "options": {"exit_layer": 24}},
      {"name": "layer_skip_28", "drafter": "layer_skip", "options": {"exit_layer": 28}, "gamma": 3},
      # The target as its own draft: every token accepted, so this measures the loop's cost, not a gain.
      {"name": "self_draft", "drafter": "draft_model", "options": {"draft": "smollm2-135m"}},
  )
  config.only = ""
  config.repeats = 1 if small else 2
  config.warmup = True

  config.costs = ml_collections.ConfigDict()
  config.costs.enabled = True  # c and r in compiled loops after decoding (experiments/costs.py)
  config.costs.repeats = 5  # interleaved rounds; the median counts
  config.costs.count_bytes = True  # bytes per step for the accelerator projection (specjax/roofline.py)
  return config
