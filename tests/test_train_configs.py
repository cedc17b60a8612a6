"""Drafter-training configs run end to end through experiments.train on a tiny model: every variant trains,
exports a checkpoint (and a draft model an HF directory) that loads back into a drafter."""

from __future__ import annotations

import ast
import json
import os
import shlex

import numpy as np
import pytest

import specjax
from configs import train_draft, train_exit, train_mtp
from experiments import train
from specjax import export
from specjax.data.features import build_feature_cache


@pytest.fixture(scope="module")
def tiny_run(tiny, tmp_path_factory):
  """The tiny model as an HF Llama directory and train/held-out caches with every layer's features."""
  root = tmp_path_factory.mktemp("train_configs")
  model_dir = export.save_hf(tiny, str(root / "model"))
  model = specjax.load(model_dir)
  rng = np.random.default_rng(0)
  for split in ("train", "held_out"):
    seqs = [(rng.integers(0, tiny.config.vocab_size, size=24).astype(np.int32), np.arange(24) >= 8)
            for _ in range(16)]
    build_feature_cache(model, seqs, str(root / "data" / split), seq_len=24,
                        feature_layers=tuple(range(tiny.config.num_layers)), top_k=4, batch_size=8)
  return model_dir, str(root / "data"), root


@pytest.mark.parametrize("module, arg, options", [
    (train_mtp, "parallel,small", {}),
    (train_exit, "8,small", {"exit_layer": 1}),
    # the attention-only adapter's config: the block's config above with one option (its drafts: test_exit_adapter.py)
    pytest.param(train_exit, "16,attention,small", {"exit_layer": 2}, marks=pytest.mark.slow),
    (train_draft, "small", {"num_layers": 2}),
], ids=["mtp_parallel", "exit_block", "exit_attention", "draft_model"])
def test_training_config_trains_and_exports_a_loadable_drafter(module, arg, options, tiny_run):
  model_dir, data_dir, root = tiny_run
  config = module.get_config(arg)
  config.model, config.data_dir, config.draft_vocab = model_dir, data_dir, 16  # half the vocabulary
  config.steps, config.batch_size, config.eval_sequences = 3, 4, 4
  config.workdir = str(root / "runs" / f"{config.drafter}-{arg}")
  config.options.update(options)
  if config.get("export_hf"):
    config.export_hf = os.path.join(config.workdir, "hf")
  card = train.run(config, "python -m experiments.train (test)")
  assert card["steps"] == 3 and "eval_top1_1" in card["held_out"]
  path = os.path.join(config.workdir, f"{config.drafter}.safetensors")
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # as open() makes a file, not private
  with open(os.path.splitext(path)[0] + ".md") as f:
    assert f"{specjax.drafters.checkpoint_option(config.drafter)}=<this .safetensors file>" in f.read()
  model = specjax.load(model_dir)
  loaded = specjax.make_drafter(config.drafter, model, **{specjax.drafters.checkpoint_option(config.drafter): path})
  assert loaded.options.draft_vocab == 16
  if config.drafter == "mtp_parallel":  # its rank accuracy on the held-out split, for Medusa's static trees
    assert len(loaded.options.rank_accuracy) == loaded.options.num_heads
  prompt = [[5, 9, 2, 7, 5, 9, 2, 7, 1]]
  assert (specjax.generate(model, prompt, max_new_tokens=8, drafter=loaded, gamma=2, stop_ids=[]).tokens
          == specjax.generate(model, prompt, max_new_tokens=8, stop_ids=[]).tokens)
  if config.get("export_hf"):
    assert specjax.load(config.export_hf).config.num_layers == 2
    assert os.stat(os.path.join(config.export_hf, "model.safetensors")).st_mode & 0o777 == 0o666 & ~umask


def test_exit_config_reads_the_cache_that_holds_its_layer():
  assert train_exit.get_config("16").data_dir == "workdirs/data/train_data"  # layer 15's output: default caches
  assert train_exit.get_config("8").data_dir == "workdirs/data/train_data-exits"
  assert train_exit.get_config("8,attention").options.to_dict() == {"adapter": "fresh", "exit_layer": 8, "mlp": False}
  with pytest.raises(ValueError, match="takes the exit layer k"):
    train_exit.get_config("attention")
  assert train_draft.get_config("6").options.num_layers == 6


def test_model_cards_name_the_data_command_that_rebuilds_their_cache(tmp_path):
  from configs import train_data
  from experiments import prepare_data
  used = train_data.get_config("regenerate").to_dict()
  used.update(num_train=1200, feature_layers=[2, 3, 5], workdir="/somewhere/else")
  (tmp_path / "summary.json").write_text(json.dumps({"config": used}))
  command = prepare_data.reproduce_command(str(tmp_path))
  assert command.startswith("python -m experiments.prepare_data --config=configs/train_data.py:regenerate ")
  overrides = dict(arg.removeprefix("--config.").split("=", 1) for arg in shlex.split(command)[4:])
  assert {k: ast.literal_eval(v) for k, v in overrides.items()} == {"num_train": 1200, "feature_layers": (2, 3, 5)}
  assert "not recorded" in prepare_data.reproduce_command(str(tmp_path / "absent"))


def test_a_drafter_that_cannot_draft_the_evaluations_chain_is_refused_before_training(tiny_run):
  """3 heads cannot draft Spec-Bench's chain of 4: said at the start, with no step taken and nothing written."""
  model_dir, data_dir, root = tiny_run
  config = train_mtp.get_config("parallel,small")
  config.model, config.data_dir, config.draft_vocab = model_dir, data_dir, 16
  config.workdir = str(root / "runs" / "three-heads")
  config.options.num_heads, config.spec_bench.enabled, config.spec_bench.gamma = 3, True, 4
  with pytest.raises(ValueError, match=r"proposes at most 3 tokens a round; the Spec-Bench evaluation drafts "
                                       r"spec_bench.gamma=4"):
    train.run(config, "python -m experiments.train (test)")
  assert not os.path.exists(os.path.join(config.workdir, "checkpoints"))
