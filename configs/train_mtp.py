r"""Trains an MTP drafter for SmolLM2-135M-Instruct by self-distillation on ShareGPT features.

  python -m experiments.prepare_data --config=configs/train_data.py   # once: the feature caches (~30-40 min)
  python -m experiments.train --config=configs/train_mtp.py:parallel
  python -m experiments.train --config=configs/train_mtp.py:sequential

Variants (the argument after the colon):
  parallel    4 parallel residual heads on the last hidden state (Medusa / Gloeckle et al.)
  sequential  one sequential module applied recurrently (EAGLE) on EAGLE-3 features (layers 2, 15, 27),
              trained with the training-time test over 4 drafting depths
  deepseek    4 distinct sequential modules on the last hidden state (DeepSeek-V3 MTP), chained in training
  small       appended with a comma (e.g. `parallel,small`): a few steps, for a quick end-to-end check

`parallel` (600 steps) took 53 min and `sequential` (3000 steps) 208 min on 2 CPU cores, each beside other jobs
(the Spec-Bench pass adds ~10 min). Runs write metrics.jsonl and orbax
checkpoints to the workdir (default workdirs/train/<variant>/); a killed run restarted with the same
command resumes from its last checkpoint. At the end the drafter is exported (safetensors + a model card)
and its acceptance is measured on Spec-Bench prompts (evaluation only; nothing is trained on them).
Overrides: `--config.steps=500 --config.data_dir=/path/to/caches`.
"""

import ml_collections

from configs import common

VARIANTS = ("parallel", "sequential", "deepseek")


def get_config(arg=None):
  parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
  kinds = [p for p in parts if p in VARIANTS]
  unknown = sorted(set(parts) - set(VARIANTS) - {"small"})
  if unknown or len(kinds) != 1:
    raise ValueError(f"configs/train_mtp.py takes one of {VARIANTS} (optionally ',small'), got {arg!r}")
  kind = kinds[0]
  config = ml_collections.ConfigDict()
  config.model = "smollm2-135m"
  config.data_dir = "workdirs/data/train_data"  # <data_dir>/train and /held_out: prepare_data's default workdir

  # options: make_drafter's keyword arguments for fresh parameters (path=None), besides the token map.
  if kind == "parallel":
    config.drafter = "mtp_parallel"
    config.options = ml_collections.ConfigDict({"path": None, "num_heads": 4})
    config.learning_rate = 1e-3
    config.steps = 600
  elif kind == "sequential":
    config.drafter = "mtp_sequential"
    config.options = ml_collections.ConfigDict({"path": None, "depth": 4, "recurrent": True, "eagle3": True})
    config.learning_rate = 1e-3
    config.steps = 3000  # the shipped module: on the 10k cache (prepare_data --config.num_train=10000)
  else:
    config.drafter = "mtp_sequential"
    config.options = ml_collections.ConfigDict({"path": None, "depth": 4, "recurrent": False, "eagle3": False})
    config.learning_rate = 5e-4
    config.steps = 400
  config.draft_vocab = 8192  # truncated draft vocabulary (FR-Spec); 0 scores the full vocabulary
  return common.drafter_training(config, f"workdirs/train/{kind}", small="small" in parts)
