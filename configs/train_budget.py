r"""Every drafter family trained on one budget: the same answer positions seen, the same data, the same held-out split.

  python -m experiments.prepare_data --config=configs/train_data.py:regenerate   # the target's own answers
  python -m experiments.train --config=configs/train_budget.py:sequential          # one family
  launch/train_budget.sh                                                          # the whole set, in the background
  python -m experiments.curves --workdirs=workdirs/budget                         # the curves, results.json/md

The argument is a family, optionally with variants (comma-separated, e.g. `sequential,sharegpt`):
  parallel    4 parallel residual heads on the last hidden state (Medusa / Gloeckle et al.)
  sequential  one sequential module applied recurrently on EAGLE-3 features (layers 2, 15, 27), 4 depths
  deepseek    4 distinct sequential modules on the last hidden state (DeepSeek-V3 MTP), chained: a chain of gamma 4
              as every family drafts (3 modules could not draft the evaluation's fourth token)
  exit        a trained exit adapter after k = 3 target layers (Kangaroo-style; see EXIT_LAYER)
  exit16      the same after k = 16 layers (layer 15's output, the deepest exit the cache holds short of the MTP
              features): the trained exit's acceptance at its most expensive
  exit10      the same after k = 10 layers: Gemma-3-270M's middle (its layer 9; SmolLM2's cache does not hold it)
  draft       a distilled 4-layer draft model (target layers 0, 10, 19, 29 to start from)
  block       a block drafter: one block of the target's kind (a copy of its last layer to start from) drafting 4
              tokens in one forward from EAGLE-3's features (layers 2, 15, 27; specjax/drafters/block.py)
  seed2       the same run with seed 1 instead of 0 (the batches' order, and a fresh drafter's random start where its
              `make` takes a seed), named <family>-seed2: how far two runs of one recipe fall apart
  sharegpt    the data-matching control: train on ShareGPT's own answers instead of the target's, same pool of
              positions, evaluated on the same held-out split (the regenerated one). Its cache:
                python -m experiments.prepare_data --config=configs/train_data.py --config.num_train=14000
              (the same split; 14,000 conversations give ~8,000 sequences of ~146 answer positions, ~1.16M,
              past the pool, as the regenerated cache's ~7,500 answers are)
  small       the `small` caches of configs/train_data.py and a budget of a few steps: an end-to-end check
  gemma3      the target Gemma-3-270M instead of SmolLM2 (combines with a family, seed2 and small; e.g.
              `:exit10,gemma3,seed2`): see below

Gemma-3-270M (`gemma3`): the same positions, pool, evaluation points and schedule, on its own regenerated cache
(configs/train_data.py:regenerate,gemma3: its greedy continuations of plain-text prompts, features of layers 2, 9, 15
and 17), in workdirs/budget-gemma3/<run>; its Spec-Bench evaluation prompts it as the comparisons do, with plain text.
Its families read what its cache holds: the exit after 3 layers (layer 2), `exit10` after 10 of its 18 layers (layer
9, the middle feature, as SmolLM2's exit16 reads its middle layer 15; `exit16` also runs, 16 of 18 layers), the
sequential module and the block on layers 2, 9, 15, the draft model from its layers 0, 6, 11, 17 (evenly spaced). Its
draft vocabulary is chosen on the Spec-Bench dev prompts (`python -m experiments.draft_vocab --model=gemma3-270m`,
written to configs/draft_vocab/gemma3-270m.json and read when a run starts; a run without the record stops with that
command). It has no ShareGPT control: a base model's plain prompt has no place for ShareGPT's answers.
  python -m experiments.prepare_data --config=configs/train_data.py:regenerate,gemma3
  python -m experiments.draft_vocab --model=gemma3-270m
  python -m experiments.train --config=configs/train_budget.py:sequential,gemma3
  RUNS="sequential,gemma3 exit,gemma3" launch/train_budget.sh
  python -m experiments.curves --workdirs=workdirs/budget-gemma3

The MTP families start from fresh parameters; `--config.options.path=<checkpoint>` starts from a trained one instead
(continued training, off the budget: give it its own `--config.workdir`).

Every run consumes `positions` answer positions (masked positions of its batches, counted, not steps), drawn from
the first sequences of its train cache that hold `pool_positions` (so the two caches of the data study offer the
same positions), and is evaluated where 1/64, 1/32, ..., 1/2 and all of the budget are seen: held-out per-depth
top-1 (the first `eval_sequences` held-out sequences) and Spec-Bench tokens per target forward on a fixed prompt
set (one prompt per category, greedy, a chain of gamma 4, 64 new tokens; evaluation only).

The budget, from one training step's CPU time (batch 8 x 256 of the `small` regenerated cache, SmolLM2, median of 3
steps on 2 cores shared with other work, 2026-12-04): parallel 2.84 s, sequential 6.95 s, deepseek 5.09 s (with 3
modules; its run with 4 took 5.6 CPU-s a step), exit 1.55 s, draft 4.05 s; ~1,280 answer positions per step on
the regenerated cache (~160 per answer), ~1,170 on ShareGPT's (~146). 1.5M positions are ~1,170 steps per run (~1,280 for the ShareGPT control): 1,170 x (2.84 + 6.95
+ 5.09 + 1.55 + 4.05) + 1,280 x 6.95 = 32,900 CPU-s = 9.1 CPU-hours of training, and ~1.2 more for 7 evaluation
points per run (~100 CPU-s each): about 10.5 CPU-hours for the set.
"""

import ml_collections
from ml_collections import config_dict

from configs import common

# The exit after k = 3 layers reads layer 2's output, the shallowest exit the cache holds (it holds layers 2, 15,
# 27, 29). Shallow wins on the evidence of specjax/checkpoints/smollm2-135m/exit_adapter.md: adapters after 4, 8 and
# 12 layers reached held-out top-1 0.284, 0.291 and 0.329 while a draft step's cost grew from 0.20 to 0.47 of a
# target step; agreement grows more slowly with k than the cost, and k = 16 would cost ~0.6 of a target step.
EXIT_LAYER = 3

# make_drafter's arguments for fresh parameters (besides the token map) and the learning rate, per family.
FAMILIES = {
    "parallel": {"drafter": "mtp_parallel", "options": {"path": None, "num_heads": 4}, "learning_rate": 1e-3},
    "sequential": {"drafter": "mtp_sequential", "learning_rate": 1e-3,
                   "options": {"path": None, "depth": 4, "recurrent": True, "eagle3": True}},
    "deepseek": {"drafter": "mtp_sequential", "learning_rate": 5e-4,
                 "options": {"path": None, "depth": 4, "recurrent": False, "eagle3": False}},
    "exit": {"drafter": "layer_skip", "options": {"adapter": "fresh", "exit_layer": EXIT_LAYER, "mlp": True},
             "learning_rate": 1e-3},
    # The deep exit the cache allows (layer 15's output): the most a trained exit can accept at this budget, at
    # ~0.6 of a target step per draft; its training step costs what the shallow exit's does (cached features).
    "exit16": {"drafter": "layer_skip", "options": {"adapter": "fresh", "exit_layer": 16, "mlp": True},
               "learning_rate": 1e-3},
    # Gemma-3-270M's middle feature (layer 9 of 18), ~0.55 of its layers as SmolLM2's exit16 is of its 30.
    "exit10": {"drafter": "layer_skip", "options": {"adapter": "fresh", "exit_layer": 10, "mlp": True},
               "learning_rate": 1e-3},
    "draft": {"drafter": "draft_model", "options": {"draft": "fresh", "num_layers": 4}, "learning_rate": 5e-4},
    # One block of the target's kind drafting 4 tokens in one forward from EAGLE-3's features (DFlash / PARD).
    "block": {"drafter": "block", "options": {"path": None, "block_size": 4, "layers": 1}, "learning_rate": 1e-3},
}
VARIANTS = ("sharegpt", "small", "gemma3", "seed2")
REGENERATED = "workdirs/data/train_data-regenerate"  # prepare_data's workdir for configs/train_data.py:regenerate
SHAREGPT = "workdirs/data/train_data"  # ... for configs/train_data.py

# The targets (the `gemma3` variant; none: SmolLM2): the model, its regenerated cache (configs/train_data.py's workdir)
# and the layers it holds, where its runs go, and its draft vocabulary: a size, or the record experiments/train.py reads
# it from when a run starts (experiments/draft_vocab.py: the smallest covering 95% of the target's greedy tokens on the
# Spec-Bench dev prompts). SmolLM2 keeps the 8,192 tokens its shipped drafters and budget results were trained with.
TARGETS = {
    "smollm2": {"model": "smollm2-135m", "regenerated": REGENERATED, "feature_layers": (2, 15, 27, 29),
                "budget": common.BUDGET, "draft_vocab": 8192, "draft_vocab_record": ""},
    "gemma3": {"model": "gemma3-270m", "regenerated": "workdirs/data/train_data-regenerate-gemma3",
               "feature_layers": (2, 9, 15, 17), "budget": "workdirs/budget-gemma3", "draft_vocab": 0,
               "draft_vocab_record": "configs/draft_vocab/gemma3-270m.json"},
}


def get_config(arg=None):
  parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
  families = [p for p in parts if p in FAMILIES]
  unknown = sorted(set(parts) - set(FAMILIES) - set(VARIANTS))
  if unknown or len(families) != 1:
    raise ValueError(f"configs/train_budget.py takes one family of {tuple(FAMILIES)}, optionally with variants "
                     f"{VARIANTS} (e.g. ':sequential,sharegpt'), got {arg!r}")
  family, small, sharegpt = families[0], "small" in parts, "sharegpt" in parts
  target = TARGETS["gemma3" if "gemma3" in parts else "smollm2"]
  if sharegpt and target["model"] != TARGETS["smollm2"]["model"]:
    raise ValueError(f"configs/train_budget.py: {target['model']} is a base model, trained on its own answers only "
                     "(a plain-text prompt has no place for ShareGPT's): drop `sharegpt`")
  exit_layer = FAMILIES[family]["options"].get("exit_layer")
  if exit_layer is not None and exit_layer - 1 not in target["feature_layers"]:
    raise ValueError(f"configs/train_budget.py: {family} exits after layer {exit_layer - 1}, which {target['model']}'s "
                     f"cache does not hold (layers {target['feature_layers']})")
  config = ml_collections.ConfigDict()
  config.model = target["model"]
  config.family = family
  config.drafter = FAMILIES[family]["drafter"]
  config.options = ml_collections.ConfigDict(FAMILIES[family]["options"])
  if "path" in config.options:  # None: fresh parameters; --config.options.path=<checkpoint> continues training it
    config.options.path = config_dict.placeholder(str)
  config.learning_rate = FAMILIES[family]["learning_rate"]
  # Truncated draft vocabulary (FR-Spec), the same for every family of a target: a size, or (`draft_vocab_record`, when
  # set) the size its record chose, read when the run starts.
  config.draft_vocab = target["draft_vocab"]
  config.draft_vocab_record = target["draft_vocab_record"]
  config.steps = 0  # unused: the budget is `positions`
  name = family + ("-sharegpt" if sharegpt else "") + ("-seed2" if "seed2" in parts else "")
  config = common.drafter_training(config, f"{target['budget']}/{name}", small=False)
  if "seed2" in parts:
    config.seed = 1

  suffix = "-small" if small else ""
  config.data_dir = (SHAREGPT if sharegpt else target["regenerated"]) + suffix
  config.held_out_dir = f"{target['regenerated']}{suffix}/held_out"  # one held-out split for every run
  config.data_answers = "sharegpt" if sharegpt else "regenerated"  # checked against the train cache's source
  config.positions = 1_500_000  # answer positions seen by every run (sized in the docstring)
  config.pool_positions = 1_000_000  # drawn from the first sequences holding this many (both caches hold more)
  config.eval_fractions = tuple(2.0 ** -i for i in range(6, -1, -1))  # 1/64 .. 1: 7 log-spaced points
  config.spec_bench.update(max_new_tokens=64, along_the_way=True)
  if small:
    config.positions = 4096
    config.pool_positions = 2048
    config.warmup_steps = 2
    config.eval_fractions = (0.25, 0.5, 1.0)
    config.eval_sequences = 8
    config.save_every = 2
    config.log_every = 1
    config.spec_bench.update(max_new_tokens=16, per_category=1)
    config.workdir += suffix
    if config.draft_vocab_record:  # the check runs before any record is made (it needs the full cache)
      config.draft_vocab, config.draft_vocab_record = 8192, ""
  return config
