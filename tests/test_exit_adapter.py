"""Trained early exit (layer skip with an exit adapter): lossless, trainable end to end, checkpoints that refuse
misfits, and an untrained adapter that is exactly early exit one layer later."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax.drafters import draft_head
from specjax.loading import CheckpointError
from specjax.train_drafter import train_drafter
from tests.task_drafters import (VOCAB, assert_greedy_lossless, fewer_layers, perturbed, progression, ragged_prompts,
                                 tiered, train_on_task)

# test id -> options of a fresh adapter
ADAPTERS = {
    "block": dict(exit_layer=2),
    "attention_only": dict(exit_layer=1, mlp=False),
    "block_truncated": dict(exit_layer=3, token_map=list(range(1, VOCAB, 2))),
}


def make(name, target, seed=1):
  return perturbed(specjax.make_drafter("layer_skip", target, adapter="fresh", **ADAPTERS[name]), seed)


# The fast tier: the adapter without an MLP (the block decodes in test_fresh_adapter_with_mlp_drafts_as_early_exit_...,
# a truncated vocabulary in test_mtp.py); the rest of the product is slow.
FAST = {("attention_only", 3)}


@pytest.mark.parametrize("name, gamma", tiered([(name, gamma) for name in sorted(ADAPTERS) for gamma in (1, 3, 5)],
                                               FAST))
def test_greedy_exit_adapter_speculative_equals_autoregressive(name, gamma, random_target):
  assert_greedy_lossless(random_target, make(name, random_target), gamma)


def test_fresh_adapter_with_mlp_drafts_as_early_exit_one_layer_later(random_target):
  """A fresh adapter is a copy of layer k fed from the target's own features: its drafts, hence every
  acceptance count, are those of plain early exit after k + 1 layers. This checks the adapter's KV cache."""
  prompts = ragged_prompts(4)
  adapter = specjax.make_drafter("layer_skip", random_target, adapter="fresh", exit_layer=2)
  plain = specjax.make_drafter("layer_skip", random_target, exit_layer=3)
  assert adapter.feature_layers == (1,) and adapter.options.layers == (0, 1)
  gamma = 4
  a, b = (specjax.generate(random_target, prompts, max_new_tokens=24, drafter=d, gamma=gamma, stop_ids=[],
                           adaptive=False).stats for d in (adapter, plain))
  assert a["accepted_per_row"] == b["accepted_per_row"] and a["rounds_per_row"] == b["rounds_per_row"]
  assert 0 < sum(a["accepted_per_row"]) < sum(a["rounds_per_row"]) * gamma  # drafts both right and wrong


def test_adapter_options_are_checked(random_target):
  with pytest.raises(ValueError, match="needs exit_layer"):
    specjax.make_drafter("layer_skip", random_target, adapter="fresh")
  with pytest.raises(ValueError, match="does not combine with skip_layers"):
    specjax.make_drafter("layer_skip", random_target, adapter="fresh", skip_layers=[1])
  with pytest.raises(ValueError, match="pass adapter='fresh'"):
    specjax.make_drafter("layer_skip", random_target, exit_layer=2, mlp=False)
  with pytest.raises(CheckpointError, match="no shipped 'exit_adapter' checkpoint.*adapter=None for plain early exit"):
    specjax.make_drafter("layer_skip", random_target, adapter="default")


# --------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow  # training end to end: test_mtp.py's mtp_parallel in the fast tier
@pytest.mark.parametrize("mlp", [True, False], ids=["block", "attention_only"])
def test_trained_exit_adapter_learns_a_predictable_task_end_to_end(mlp, task_target, task_caches, tmp_path):
  """Exit after the first of three layers. On this task early exit alone already drafts well, so the adapter
  starts from random weights (drafts mostly rejected) and must learn the target's next token from layer-1
  features."""
  fresh = perturbed(specjax.make_drafter("layer_skip", task_target, adapter="fresh", exit_layer=1, mlp=mlp),
                    scale=0.5)
  run = train_on_task(task_target, fresh, task_caches, tmp_path)
  prompts, out, result = run["prompts"], run["out"], run["result"]
  # The checkpoint round trip gives the same drafter; its exit layer comes with it.
  path = draft_head.save(result.drafter, str(tmp_path / "adapter.safetensors"), task_target, dtype="float32")
  loaded = specjax.make_drafter("layer_skip", task_target, adapter=path)
  assert loaded.options == result.drafter.options
  again = specjax.generate(task_target, prompts, max_new_tokens=30, drafter=loaded, gamma=3, stop_ids=[],
                           adaptive=False)
  assert again.tokens == out.tokens and again.stats["mean_accepted"] == out.stats["mean_accepted"]


# -------------------------------------------------------------------------------------------- checkpoints


def test_adapter_checkpoint_misfits_are_clear_errors(random_target, tmp_path):
  drafter = specjax.make_drafter("layer_skip", random_target, adapter="fresh", exit_layer=2)
  path = draft_head.save(drafter, str(tmp_path / "adapter.safetensors"), random_target)
  assert specjax.make_drafter("layer_skip", random_target, adapter=path, exit_layer=2).options.exit_layer == 2
  with pytest.raises(CheckpointError, match=r"trained after layer 2 \(exit_layer=2\), not exit_layer=3"):
    specjax.make_drafter("layer_skip", random_target, adapter=path, exit_layer=3)
  with pytest.raises(CheckpointError, match="num_layers 4 vs 3"):
    specjax.make_drafter("layer_skip", fewer_layers(random_target, 3), adapter=path)
  with pytest.raises(CheckpointError, match="holds a 'layer_skip' drafter, not 'mtp_parallel'"):
    specjax.make_drafter("mtp_parallel", random_target, path=path)
  with pytest.raises(ValueError, match="a checkpoint brings its own"):
    specjax.make_drafter("layer_skip", random_target, adapter=path, mlp=False)
  mtp = specjax.make_drafter("mtp_parallel", random_target, path=None, num_heads=2)
  other = draft_head.save(mtp, str(tmp_path / "heads.safetensors"), random_target)
  with pytest.raises(CheckpointError, match="holds a 'mtp_parallel' drafter, not 'layer_skip'"):
    specjax.make_drafter("layer_skip", random_target, adapter=other)


def test_adapter_training_needs_its_exit_features_in_the_cache(random_target, tmp_path):
  """Exit after k layers reads the output of layer k - 1: a cache without it is an error naming both sides."""
  from specjax.data.features import build_feature_cache
  seqs = [(np.asarray(progression(1, 1, 16), np.int32), np.ones(16, bool))] * 4
  cache = build_feature_cache(random_target, seqs, str(tmp_path / "cache"), seq_len=16, feature_layers=(2,), top_k=4,
                              batch_size=4)
  fresh = specjax.make_drafter("layer_skip", random_target, adapter="fresh", exit_layer=1)
  with pytest.raises(ValueError, match=r"reads target layers \[0\].*holds \[2\]"):
    train_drafter(random_target, fresh, cache, cache, workdir=str(tmp_path / "w"), steps=2, progress=False)
