r"""Quickstart: autoregressive vs prompt lookup, layer skip and the shipped MTP drafters on a few Spec-Bench prompts.

  python -m experiments.run --config=configs/quickstart.py

Overrides go on the command line, e.g. `--config.max_new_tokens=16 --config.only=autoregressive`;
tuples are Python literals: `--config.prompts.categories="('qa','rag')"`.
SmolLM2-135M-Instruct in float32 (the dtype tested for parity with HF), greedy, batch 1, one prompt from each of
five categories, chat template on the first turn. Results go to workdirs/quickstart-<time>/ (or --workdir).
2 min 48 s measured on 2 CPU cores (10 programs compiled at 3-10 s each, then the cost loops); on cores shared
with other jobs, several times that.
"""

import ml_collections


def get_config(arg=None):
  if arg:
    raise ValueError(f"configs/quickstart.py takes no argument, got {arg!r}")
  config = ml_collections.ConfigDict()
  config.model = "smollm2-135m"
  config.dtype = "float32"

  config.prompts = ml_collections.ConfigDict()
  # Short prompts share one compiled shape; extraction shows copying from the prompt.
  config.prompts.categories = ("writing", "coding", "qa", "humanities", "extraction")
  config.prompts.per_category = 1  # the first N of each category (0: all)
  config.prompts.question_ids = ()  # explicit ids instead of categories/per_category
  config.prompts.max_prompts = 0  # 0: no cap
  config.chat = True  # apply the model's chat template to the first turn

  config.max_new_tokens = 64
  config.temperature = 0.0  # 0: greedy, and every method is checked token-for-token against autoregressive
  config.temperatures = ()  # run the comparison at each of these, the first giving the main table (empty: temperature)
  config.top_k = 0
  config.top_p = 1.0
  config.seed = 0
  config.batch_size = 1
  config.gamma = 4  # draft tokens per round, unless a method sets its own
  config.adaptive = True  # adaptive drafting (specjax/adaptive.py), the library default; False: gamma every round
  config.gammas = ()  # a gamma sweep: every drafter at each of these (empty: each method's own gamma)
  config.mesh_shape = ml_collections.config_dict.placeholder(tuple)  # (data, model); None: one device

  # name: label in the report; drafter: a `specjax.make_drafter` name (absent: autoregressive).
  config.methods = (
      {"name": "autoregressive"},
      {"name": "prompt_lookup", "drafter": "prompt_lookup", "options": {}},
      {"name": "layer_skip_24", "drafter": "layer_skip", "options": {"exit_layer": 24}},
      # The shipped MTP drafters (specjax/checkpoints/smollm2-135m/).
      {"name": "mtp_parallel", "drafter": "mtp_parallel", "options": {}},
      {"name": "mtp_sequential", "drafter": "mtp_sequential", "options": {}},
  )
  config.only = ""  # comma-separated method names to run (the autoregressive baseline always runs)
  config.repeats = 1  # timed runs of every method per prompt batch
  config.warmup = True  # one untimed (compile + run) call per method on the first batch

  config.costs = ml_collections.ConfigDict()
  config.costs.enabled = True  # c and r in compiled loops after decoding (experiments/costs.py)
  config.costs.repeats = 3  # interleaved rounds; the median counts
  config.costs.count_bytes = True  # bytes per step for the accelerator projection (specjax/roofline.py)
  return config
