r"""Measures how often each depth's rank-r draft token is the target's greedy token, for a drafter that drafts every
depth from one forward (parallel heads, a block drafter), and stores it beside the checkpoint
(<checkpoint>.ranks.json), where `make_drafter` reads it to draft Medusa's static trees
(`specjax.drafters.draft_tree.static_tree`).

  python -m experiments.rank_accuracy --cache=workdirs/data/train_data-regenerate/held_out [--checkpoint=default]
  python -m experiments.rank_accuracy --drafter=block --checkpoint=workdirs/budget/block/block.safetensors --cache=...

--cache is a feature cache holding the layers the drafter reads (prepare_data's <workdir>/held_out or train):
conversations of the training data, never evaluation prompts. `experiments.train` does the same for every run of
such a drafter it exports, on its held-out split.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
from absl import app, flags

import specjax
from specjax.data import features
from specjax.drafters import draft_head, draft_tree


def measure_and_save(model, drafter, cache: features.FeatureCache, checkpoint_path: str) -> tuple[str, np.ndarray]:
  """Rank accuracy of `drafter` (parallel heads, a block) on `cache`, written beside `checkpoint_path`; (file,
  accuracy)."""
  accuracy, counted = draft_tree.rank_accuracy(model, drafter, cache)
  source = (f"{os.path.relpath(cache.path)}: {len(cache)} sequences, {int(counted[0])} positions compared at depth 1 "
            f"(top {accuracy.shape[1]} ranks)")
  return draft_head.save_rank_accuracy(checkpoint_path, accuracy, source), accuracy


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  model = specjax.load(flags.FLAGS.model, dtype="float32")
  checkpoint = flags.FLAGS.checkpoint
  name = flags.FLAGS.drafter
  path = draft_head.shipped_checkpoint(model, name) if checkpoint == "default" else checkpoint
  drafter = specjax.make_drafter(name, model, path=path)
  written, accuracy = measure_and_save(model, drafter, features.FeatureCache.open(flags.FLAGS.cache), path)
  for k, row in enumerate(accuracy, 1):
    print(f"depth {k}: top-1 {row[0]:.3f}, top-{len(row)} {row.sum():.3f}; ranks 1-5 "
          + " ".join(f"{a:.3f}" for a in row[:5]))
  print(f"wrote {written}")


def _define_flags():
  """Defined when the command runs, not on import: --model is other commands' too."""
  flags.DEFINE_string("drafter", "mtp_parallel", "the drafter: mtp_parallel or block")
  flags.DEFINE_string("checkpoint", "default", "its checkpoint (.safetensors); default: the one shipped for --model")
  flags.DEFINE_string("cache", None, "a feature cache holding the target's last layer (prepare_data's output)")
  flags.DEFINE_string("model", "smollm2-135m", "the target")


if __name__ == "__main__":
  _define_flags()
  flags.mark_flags_as_required(["cache"])
  app.run(main)
