r"""Trains an exit adapter for SmolLM2-135M-Instruct (trained early exit, Kangaroo-style) on ShareGPT features.

  python -m experiments.prepare_data --config=configs/train_data.py:exits   # once: features after layers 4..16
  python -m experiments.train --config=configs/train_exit.py:8               # the adapter after 8 layers

The argument is k, the target layers the draft runs before the adapter (`make_drafter("layer_skip", model,
exit_layer=k, adapter=...)`); training reads the output of 0-based layer k - 1 from the feature cache.
configs/train_data.py's default caches hold layers (2, 15, 27, 29), so k = 3, 16 and 28 train on them; its
`exits` variant adds layers 3, 5, 7, 9, 11 and 15 (k = 4, 6, 8, 10, 12, 16), where the data dir below points
for any k the default caches lack. Variants after the k, comma-separated (e.g. `8,attention,small`):
  attention   the adapter is one attention block (Kangaroo's), without the MLP of a whole decoder block
  small       a few steps, for a quick end-to-end check

An adapter step costs about one decoder layer's forward and backward over the batch plus the truncated head, so
a run takes well under the MTP variants' time on 2 shared CPU cores. At the end the adapter is exported
(<workdir>/layer_skip.safetensors + model card) and its acceptance measured on Spec-Bench (evaluation only).
"""

import ml_collections

from configs import common

DEFAULT_CACHE_LAYERS = (2, 15, 27, 29)  # configs/train_data.py's feature_layers
VARIANTS = ("attention", "small")


def get_config(arg=None):
  parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
  numbers = [p for p in parts if p.isdigit()]
  unknown = sorted(set(parts) - set(numbers) - set(VARIANTS))
  if unknown or len(numbers) != 1:
    raise ValueError(f"configs/train_exit.py takes the exit layer k (e.g. ':8'), optionally with {VARIANTS}, "
                     f"got {arg!r}")
  exit_layer = int(numbers[0])
  mlp = "attention" not in parts
  config = ml_collections.ConfigDict()
  config.model = "smollm2-135m"
  # <data_dir>/train and /held_out must hold layer k - 1's output (prepare_data's workdirs).
  default = exit_layer - 1 in DEFAULT_CACHE_LAYERS
  config.data_dir = "workdirs/data/train_data" if default else "workdirs/data/train_data-exits"
  config.drafter = "layer_skip"
  # make_drafter's keyword arguments for a fresh adapter, besides the token map.
  config.options = ml_collections.ConfigDict({"adapter": "fresh", "exit_layer": exit_layer, "mlp": mlp})
  config.learning_rate = 1e-3
  config.steps = 600
  config.draft_vocab = 8192  # truncated draft vocabulary (FR-Spec); 0 scores the full vocabulary
  name = f"exit{exit_layer}" + ("" if mlp else "-attention")
  return common.drafter_training(config, f"workdirs/train/{name}", small="small" in parts)
