"""What every Spec-Bench run shares: the model, the prompts and the decoding settings (experiments/run.py).

Each config in this directory starts from `spec_bench_run(...)` and adds its methods and its own fields; any field
can be overridden on the command line (`--config.max_new_tokens=16`, `--config.prompts.categories="('qa',)"`).
"""

import ml_collections


def spec_bench_run(*, per_category: int, max_new_tokens: int, adaptive: bool = True, repeats: int = 1,
                   model: str = "smollm2-135m") -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = model
  config.dtype = "float32"  # the dtype tested for parity with HF transformers

  config.prompts = ml_collections.ConfigDict()
  config.prompts.categories = ()  # Spec-Bench categories (empty: all 13)
  config.prompts.per_category = per_category  # the first N of each category (0: all)
  config.prompts.question_ids = ()  # explicit ids instead of categories/per_category
  config.prompts.max_prompts = 0  # 0: no cap
  config.chat = True  # apply the model's chat template to the first turn

  config.max_new_tokens = max_new_tokens
  config.temperature = 0.0  # 0: greedy, and every method is checked token-for-token against autoregressive
  config.temperatures = ()  # run the comparison at each of these, the first giving the main table (empty: temperature)
  config.top_k = 0
  config.top_p = 1.0
  config.seed = 0
  config.batch_size = 1  # prompts per generate call (consecutive prompts of one category)
  config.batch_sizes = ()  # run the comparison at each of these, the first giving the main table (empty: batch_size)
  config.gamma = 4  # draft tokens per round, unless a method sets its own
  config.adaptive = adaptive  # adaptive drafting (specjax/adaptive.py); False: gamma every round
  config.gammas = ()  # a gamma sweep: every drafter at each of these (empty: each method's own gamma)
  config.mesh_shape = ml_collections.config_dict.placeholder(tuple)  # (data, model); None: one device

  config.only = ""  # comma-separated method names to run (the autoregressive baseline always runs)
  config.repeats = repeats  # timed runs of every method per prompt batch
  config.warmup = True  # one untimed (compile + run) call per method on the first batch
  return config


def costs(repeats: int) -> ml_collections.ConfigDict:
  """Draft cost c and verify cost r measured in compiled loops after decoding (experiments/costs.py)."""
  return ml_collections.ConfigDict({
      "enabled": True,
      "repeats": repeats,  # interleaved rounds; the median counts
      "count_bytes": True,  # bytes per step for the accelerator projection (specjax/roofline.py)
  })


def adaptive_variants(per_category: int, categories: tuple[str, ...], model: str, drafters: dict[str, dict],
                      variants: dict[str, dict]) -> ml_collections.ConfigDict:
  """A Spec-Bench run (greedy, batch 1, 64 new tokens, 3 repeats) of autoregressive decoding and each of `drafters`
  (methods by name, as configs/bench_peers.py gives them) under each of `variants` ({suffix: AdaptiveDrafting
  options}; a method is named <drafter><suffix>), at a static maximum gamma of 4."""
  config = spec_bench_run(per_category=per_category, max_new_tokens=64, repeats=3, model=model)
  config.prompts.categories = categories
  config.methods = ({"name": "autoregressive"},) + tuple(
      {**method, "name": f"{name}{suffix}", "adaptive": dict(options), "gamma": 4}
      for name, method in drafters.items() for suffix, options in variants.items())
  return config


def drafter_training(config: ml_collections.ConfigDict, workdir: str, small: bool) -> ml_collections.ConfigDict:
  """The fields every drafter-training config (configs/train_*.py, experiments/train.py) shares: batches, schedule,
  logging, export, the Spec-Bench check; `small` shrinks the run to a quick check. The budget is `steps`, or
  `positions` (answer positions seen) when that is set."""
  config.batch_size = 8  # sequences of 256 tokens per step
  config.positions = 0  # > 0: train until the batches have held this many answer positions (`steps` is then unused)
  config.pool_positions = 0  # > 0: draw batches from the first sequences holding this many answer positions
  config.held_out_dir = ""  # the held-out cache; default <data_dir>/held_out
  config.warmup_steps = 40
  config.weight_decay = 0.0
  config.clip_norm = 1.0
  config.seed = 0
  config.log_every = 10
  config.eval_every = 100
  config.eval_fractions = ()  # with `positions`: evaluate where these fractions of it are seen, instead of eval_every
  config.eval_sequences = 96  # held-out sequences for per-depth top-1
  config.save_every = 50  # checkpoint interval (steps); what a killed run redoes at most
  config.mesh_shape = ml_collections.config_dict.placeholder(tuple)  # (data, model); None: one device

  config.export_dtype = "bfloat16"
  config.export_path = ""  # default <workdir>/<drafter>.safetensors
  # Acceptance on Spec-Bench (evaluation only): greedy, chain of `gamma` drafts; after training, or at every
  # evaluation step with `along_the_way`.
  config.spec_bench = ml_collections.ConfigDict({"enabled": True, "per_category": 1, "max_new_tokens": 128,
                                                "gamma": 4, "along_the_way": False})

  config.workdir = workdir
  if small:
    config.steps = 20
    config.warmup_steps = 5
    config.eval_every = 10
    config.eval_sequences = 8
    config.save_every = 10
    config.spec_bench.enabled = False
    config.workdir += "-small"
  return config
