"""What the configs share: a Spec-Bench run's model, prompts, decoding settings and methods (experiments/run.py),
and a drafter training run's fields (`drafter_training`, experiments/train.py).

Each experiment config in this directory starts from `spec_bench_run(...)` and takes its methods from `METHODS` by
name (`methods(...)`); any field can be overridden on the command line (`--config.max_new_tokens=16`,
`--config.prompts.categories="('qa',)"`). Configs are data: this is the one module they import, and a method only
declares what it needs (a shipped checkpoint, `"needs"`; a checkpoint file of its own, `"checkpoint"`; a searched
layer-skip set, `"skip_set"`), which the runner looks up when it builds the method.
"""

import ml_collections

MODEL = "smollm2-135m"


def layer_skip_exit(layer: int) -> dict:
  """Layer skip's untrained early exit: the target's first `layer` layers and its LM head draft."""
  return {"name": f"layer_skip_exit{layer}", "drafter": "layer_skip", "options": {"exit_layer": layer}}


# Every method a config runs, by name. A method builds a specjax drafter (`"drafter"`, its `"options"`; none:
# autoregressive decoding) or a peer (`"peer"`: another implementation on the same weights, experiments/peers.py).
# `"skip_set"`: a layer-skip record of experiments/search_layer_skip.py (a path from the repository root) whose
# options the drafter takes, at the gamma it was searched for unless the method sets `"gamma"`. `"needs"`: the
# shipped checkpoints (specjax/checkpoints/<model>/<name>.safetensors) without which the runner leaves the method
# out, with a log line.
METHODS = {method["name"]: method for method in (
    {"name": "autoregressive"},
    {"name": "prompt_lookup", "drafter": "prompt_lookup", "options": {}},
    layer_skip_exit(24),
    layer_skip_exit(12),  # Gemma-3-270M's 18 layers (configs/bench_peers.py:gemma)
    {"name": "layer_skip_best_set", "drafter": "layer_skip", "skip_set": "configs/layer_skip_sets/smollm2-135m.json"},
    # The multi-layer search on ShareGPT training text (teacher-forced, `--method=teacher_forced`).
    {"name": "layer_skip_deep_set", "drafter": "layer_skip",
     "skip_set": "configs/layer_skip_sets/smollm2-135m-deep.json"},
    {"name": "layer_skip_trained_exit", "drafter": "layer_skip", "options": {"adapter": "default"},
     "needs": ("exit_adapter",)},
    # The draft reads the prompt's last 256 tokens only: on Spec-Bench's long prompts (summarization, rag: 600-800
    # tokens) its prefill cost ~8% of the call, while its acceptance with windows of 64-256 tokens stayed within 0.03
    # of the whole prompt's on those categories (specjax/drafters/draft_model.py `init`).
    {"name": "draft_model", "drafter": "draft_model", "options": {"draft": f"{MODEL}-draft", "prompt_window": 256},
     "needs": ("draft_model",)},
    {"name": "mtp_parallel", "drafter": "mtp_parallel", "options": {}},
    {"name": "mtp_sequential", "drafter": "mtp_sequential", "options": {}},
    # The target as its own draft: every draft is accepted, so it measures what a round costs.
    {"name": "self_draft", "drafter": "draft_model", "options": {"draft": MODEL}},
    {"name": "hf_autoregressive", "peer": "hf_autoregressive", "options": {}},
    {"name": "hf_prompt_lookup", "peer": "hf_prompt_lookup", "options": {}},
    # HF's assisted generation with the shipped distilled draft, exported to an HF directory on the fly.
    {"name": "hf_assisted", "peer": "hf_assisted", "options": {"draft": f"{MODEL}-draft"}, "needs": ("draft_model",)},
    {"name": "llamacpp_autoregressive", "peer": "llamacpp_autoregressive", "options": {}},
    {"name": "llamacpp_prompt_lookup", "peer": "llamacpp_prompt_lookup", "options": {}},
    # llama.cpp on as many threads as specjax's programs run on (n_threads -1: experiments/peers.py SAME_THREADS),
    # not the faster of 1 and all: the comparison on one GGUF at equal threads (configs/bench_peers.py:quantized).
    {"name": "llamacpp_autoregressive_same_threads", "peer": "llamacpp_autoregressive", "options": {"n_threads": -1}},
    {"name": "llamacpp_prompt_lookup_same_threads", "peer": "llamacpp_prompt_lookup", "options": {"n_threads": -1}},
)}

# The runs of configs/train_budget.py (launch/train_budget.sh: every family trained on one budget of the target's
# own answers, and the sequential module on ShareGPT's answers) and the drafter each trains; a run's checkpoint is
# <BUDGET>/<run>/<drafter>.safetensors (experiments/train.py's export). As methods, `budget_<run>`.
BUDGET = "workdirs/budget"
BUDGET_RUNS = {"parallel": "mtp_parallel", "sequential": "mtp_sequential", "deepseek": "mtp_sequential",
               "exit": "layer_skip", "exit16": "layer_skip", "draft": "draft_model",
               "sequential-sharegpt": "mtp_sequential", "block": "block"}


def budget_method(run: str) -> dict:
  """The method drafting with the checkpoint of budget run `run` (the draft model as `draft_model` drafts)."""
  drafter = BUDGET_RUNS[run]
  return {"name": "budget_" + run.replace("-", "_"), "drafter": drafter,
          "options": {"prompt_window": 256} if drafter == "draft_model" else {},
          "checkpoint": f"{BUDGET}/{run}/{drafter}.safetensors"}


METHODS.update((m["name"], m) for m in map(budget_method, BUDGET_RUNS))

# Every drafter once, as the library ships it (no searched skip sets): the set the peer comparison and the adaptive
# drafting runs compare.
DRAFTERS = ("prompt_lookup", "layer_skip_exit24", "mtp_parallel", "mtp_sequential", "draft_model",
            "layer_skip_trained_exit")


def methods(*names: str, **fields) -> tuple[dict, ...]:
  """`METHODS[name]` for each of `names` (copies), with `fields` (e.g. `adaptive=True, gamma=4`) set on the
  drafting ones."""
  unknown = [name for name in names if name not in METHODS]
  if unknown:
    raise ValueError(f"unknown methods {unknown}; methods: {', '.join(METHODS)}")
  return tuple({**METHODS[name], **(fields if METHODS[name].get("drafter") else {})} for name in names)


def parse_variants(arg, config_name: str, allowed: tuple[str, ...]) -> set:
  """The comma-separated variants of `arg` (a config's argument), each one of `allowed`."""
  variants = {a.strip() for a in (arg or "").split(",") if a.strip()}
  unknown = sorted(variants - set(allowed))
  if unknown:
    raise ValueError(f"{config_name} takes a comma-separated subset of {', '.join(allowed)}; got {unknown}")
  return variants


def spec_bench_run(*, per_category: int, max_new_tokens: int, adaptive: bool = True, repeats: int = 1,
                   model: str = MODEL, split: str = "test") -> ml_collections.ConfigDict:
  """A Spec-Bench run's config. `split`: the side of the dev/test split its prompts come from (experiments/spec_bench.py
  `in_split`): "test" for the runs that report (comparisons), "dev" for those that choose a constant (sweeps of
  gamma, depth, tree size and the adaptive policy's optimism), so nothing is tuned on the prompts it is reported on."""
  config = ml_collections.ConfigDict()
  config.model = model
  config.dtype = "float32"  # the dtype tested for parity with HF transformers
  # True: the target keeps its GGUF's quantized blocks (`specjax.load(..., quantized=True)`, float32 activations), the
  # CPU kernels multiplying by them; every method, the autoregressive baseline included, decodes that target, so the
  # losslessness check is against the quantized target's own tokens.
  config.quantized = False

  config.prompts = ml_collections.ConfigDict()
  config.prompts.categories = ()  # Spec-Bench categories (empty: all 13)
  config.prompts.per_category = per_category  # the first N of each category (0: all)
  config.prompts.question_ids = ()  # explicit ids instead of categories/per_category
  config.prompts.max_prompts = 0  # 0: no cap
  config.prompts.split = split  # "dev" / "test": one side of the dev/test split; "" every question
  config.chat = True  # apply the model's chat template to the first turn
  # N > 0: each question preceded by the questions before it in the file until its prompt holds >= N tokens
  # (experiments/spec_bench.py `prompt_text`): a long context ending with the question (sliding windows exercised)
  config.min_prompt_tokens = 0

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
  # A never-drafting control: autoregressive decoding again as the method `control`, timed like the others; its paired
  # speedup (1.00x but for the machine) shows the measurement floor beside theirs.
  config.control = True
  config.repeats = repeats  # timed runs of every method per prompt batch
  config.warmup = True  # one untimed (compile + run) call per method on the first batch
  return config


def drafter_comparison(*, small: bool, adaptive: bool = False, split: str = "test") -> ml_collections.ConfigDict:
  """The run of configs/compare_drafters.py and of the sweeps over its drafters: 5 prompts of each category, 128 new
  tokens, 2 repeats (`small`: 1 prompt, 64 tokens, 1 repeat), top-p 0.9 where sampling, costs measured."""
  config = spec_bench_run(per_category=1 if small else 5, max_new_tokens=64 if small else 128, adaptive=adaptive,
                          repeats=1 if small else 2, split=split)
  config.top_p = 0.9  # applies when sampling
  config.costs = costs(repeats=5)
  return config


def costs(repeats: int) -> ml_collections.ConfigDict:
  """Draft cost c and verify cost r measured in compiled loops after decoding (experiments/costs.py)."""
  return ml_collections.ConfigDict({
      "enabled": True,
      "repeats": repeats,  # interleaved rounds; the median counts
      "count_bytes": True,  # bytes per step: the roofline fraction, c and r in bytes (experiments/costs.py)
  })


def adaptive_variants(per_category: int, categories: tuple[str, ...], drafters: tuple[str, ...],
                      variants: dict[str, dict]) -> ml_collections.ConfigDict:
  """A Spec-Bench run (greedy, batch 1, 64 new tokens, 3 repeats) of autoregressive decoding and each of `drafters`
  (names in `METHODS`) under each of `variants` ({suffix: AdaptiveDrafting options}; a method is named
  <drafter><suffix>), at a static maximum gamma of 4. It chooses among the variants: prompts of the dev side."""
  config = spec_bench_run(per_category=per_category, max_new_tokens=64, repeats=3, split="dev")
  config.prompts.categories = categories
  config.methods = methods("autoregressive") + tuple(
      {**method, "name": f"{method['name']}{suffix}", "adaptive": dict(options), "gamma": 4}
      for method in methods(*drafters) for suffix, options in variants.items())
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
  # with `positions`: end this run where this fraction of them is seen (one of eval_fractions), its schedule the whole
  # budget's, so its points are the full run's; rerun without it to go on (no run.json, no export until the end)
  config.stop_fraction = 0.0
  config.eval_sequences = 96  # held-out sequences for per-depth top-1
  config.save_every = 50  # checkpoint interval (steps); what a killed run redoes at most
  config.mesh_shape = ml_collections.config_dict.placeholder(tuple)  # (data, model); None: one device

  config.export_dtype = "bfloat16"
  config.export_path = ""  # default <workdir>/<drafter>.safetensors
  # Acceptance on Spec-Bench (evaluation only): greedy, chain of `gamma` drafts; after training, or at every
  # evaluation step with `along_the_way`. Prompts of the dev side of the dev/test split only: the comparisons report
  # on the test side, which nothing in training reads.
  config.spec_bench = ml_collections.ConfigDict({"enabled": True, "per_category": 1, "max_new_tokens": 128,
                                                "gamma": 4, "along_the_way": False, "split": "dev"})

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
