r"""Builds drafter training data: train and held-out feature caches of the frozen target on ShareGPT.

  python -m experiments.prepare_data --config=configs/train_data.py [--config.workdir=DIR]

For each side of the split (train, held_out): read ShareGPT, take the configured number of conversations and
build the split's feature cache in <workdir>/<split>/: either render the data's exchanges into sequences
(`specjax.data.sequences.make_sequences`, saved to <workdir>/<split>.sequences.npz) and run the target over them
(`specjax.data.features.build_feature_cache`), or, with `regenerate`, render only the prompts
(`specjax.data.sequences.make_prompts`) and let the target answer them, keeping its features while it decodes
(`experiments.regenerate.build_regenerated_cache`). Both builds resume a killed run. The prompts are in the format
the evaluation gives the model (`config.chat`; None: the model's, `sequences.default_chat`): through the chat
template, or plain text for a base model, which only the target's own answers can follow. Prints the read statistics,
the masked positions, how much of the target's greedy tokens truncated draft vocabularies cover, and the wall
time; writes the same to <workdir>/summary.json.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import time
from typing import Any, Sequence

import ml_collections
from absl import app, flags, logging

import specjax
from specjax.data import features, sequences, sharegpt
from experiments import cli, regenerate
from experiments.cli import parse_flags

_CONFIG = cli.define_config_flag("Data config: configs/train_data.py[:variants].")
SPLITS = ("train", "held_out")


def source_description(config: ml_collections.ConfigDict, split: str, stats: sharegpt.ReadStats,
                       chat: bool = True) -> dict[str, Any]:
  """What the sequences of one split are made of; stored with them and in the cache's meta.json."""
  source = {
      "dataset": os.path.basename(stats.path),
      "dataset_package": f"{sharegpt.DISTRIBUTION} {importlib.metadata.version(sharegpt.DISTRIBUTION)}",
      "conversations_in_file": stats.conversations,
      "split": split,
      "held_out_fraction": config.held_out_fraction,
      "split_seed": config.seed,
      "conversations": config.num_train if split == "train" else config.num_held_out,
      "max_pairs_per_conversation": config.max_pairs_per_conversation,
      "regenerate": config.regenerate,
      "regenerate_temperature": config.regenerate_temperature if config.regenerate else None,
      "regenerate_seed": config.regenerate_seed if config.regenerate and config.regenerate_temperature else None,
      "min_answer_tokens": None if config.regenerate else sequences.MIN_ANSWER_TOKENS,
      "seq_len": config.seq_len,
      "model": config.model,
      "dtype": config.dtype,
  }
  if config.regenerate:  # the data's own answers are always chat exchanges (make_sequences refuses plain text)
    source["prompt_format"] = "chat" if chat else "plain"
  return source


def split_sequences(config: ml_collections.ConfigDict, model: specjax.Model, conversations: Sequence[dict],
                    source: dict[str, Any], path: str) -> list[sequences.Sequence]:
  """The split's sequences of the data's own answers: loaded from `path` when made from the same source, else
  made and saved there."""
  if os.path.exists(path):
    saved, saved_source = sequences.load_sequences(path)
    if saved_source == json.loads(json.dumps(source)):
      logging.info("reusing %d sequences from %s", len(saved), path)
      return saved
    raise ValueError(f"{path} holds sequences made from another source ({saved_source}); delete it or choose "
                     "another workdir")
  made = sequences.make_sequences(model, conversations, seq_len=config.seq_len,
                                  max_pairs_per_conversation=config.max_pairs_per_conversation)
  sequences.save_sequences(path, made, source)
  return made


def split_cache(config: ml_collections.ConfigDict, model: specjax.Model, conversations: Sequence[dict],
                source: dict[str, Any], workdir: str, split: str, feature_layers: tuple[int, ...], chat: bool = True
                ) -> tuple[features.FeatureCache, float]:
  """The split's feature cache, and the seconds spent making its sequences or prompts: of the target's own
  answers (`config.regenerate`: decoded with the features kept) or of the data's (a forward over them)."""
  start = time.perf_counter()
  out_dir = os.path.join(workdir, split)
  kwargs = dict(seq_len=config.seq_len, feature_layers=feature_layers, top_k=config.top_k,
                dtype=config.feature_dtype, source=source)
  if config.regenerate:
    prompts = sequences.make_prompts(model, conversations, seq_len=config.seq_len,
                                     max_pairs_per_conversation=config.max_pairs_per_conversation, chat=chat)
    rendered = time.perf_counter() - start
    sampled = f"-temperature{config.regenerate_temperature:g}-seed{config.regenerate_seed}"
    answers_path = os.path.join(config.answers_dir or workdir,
                                f"{split}.answers{sampled if config.regenerate_temperature else ''}.npz")
    return regenerate.build_regenerated_cache(
        model, prompts, out_dir, batch_size=config.regenerate_batch_size,
        temperature=config.regenerate_temperature, seed=config.regenerate_seed, answers_path=answers_path,
        **kwargs), rendered
  seqs = split_sequences(config, model, conversations, source, os.path.join(workdir, f"{split}.sequences.npz"))
  rendered = time.perf_counter() - start
  return features.build_feature_cache(model, seqs, out_dir, batch_size=config.batch_size,
                                      chunk_batches=config.chunk_batches, **kwargs), rendered


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Builds both caches into `workdir` and returns the summary it prints."""
  start = time.perf_counter()
  os.makedirs(workdir, exist_ok=True)
  model = specjax.load(config.model, dtype=config.dtype)
  feature_layers = tuple(config.feature_layers) or features.default_feature_layers(model.config.num_layers)
  chat = sequences.default_chat(model.tokenizer) if config.get("chat") is None else config.chat
  if not config.regenerate:  # said before reading ShareGPT, not after
    sequences.check_data_answers(model, chat)
  conversations, stats = sharegpt.read_conversations()
  print(f"read {stats}")
  sides = dict(zip(SPLITS, sharegpt.split(conversations, config.held_out_fraction, config.seed)))
  wanted = {"train": config.num_train, "held_out": config.num_held_out}
  summary: dict[str, Any] = {"config": config.to_dict(), "read": str(stats), "workdir": os.path.abspath(workdir)}
  caches = {}
  for split in SPLITS:
    if wanted[split] > len(sides[split]):
      raise ValueError(f"{split} has {len(sides[split])} conversations, {wanted[split]} asked for")
    source = source_description(config, split, stats, chat)
    cache, sequences_seconds = split_cache(config, model, sides[split][:wanted[split]], source, workdir, split,
                                           feature_layers, chat)
    caches[split] = cache
    disk = sum(os.path.getsize(os.path.join(cache.path, f)) for f in os.listdir(cache.path))
    summary[split] = {"path": os.path.abspath(cache.path), "sequences": len(cache),
                      "masked_positions": cache.meta["masked_positions"], "disk_bytes": disk,
                      "sequences_seconds": round(sequences_seconds, 1),
                      "features_seconds": cache.meta["build_seconds"]}
    print(f"{split}: {len(cache):,} sequences, {cache.meta['masked_positions']:,} masked positions, "
          f"{disk / 1e9:.2f} GB in {cache.path} (rendering {sequences_seconds:.0f} s, the target "
          f"{cache.meta['build_seconds']:.0f} s{' answering' if config.regenerate else ''})")

  # Truncated draft vocabularies from the train cache's greedy-token counts, and how much they cover.
  stop_ids = caches["train"].meta["stop_ids"]
  coverage = {}
  for size in config.token_map_sizes:
    token_map = features.top_token_map(caches["train"].token_counts, size, stop_ids)
    coverage[size] = {split: round(features.token_map_coverage(caches[split].token_counts, token_map), 4)
                      for split in SPLITS}
    print(f"token map V'={size}: covers {coverage[size]['train']:.2%} of train greedy tokens, "
          f"{coverage[size]['held_out']:.2%} of held-out ones")
  summary["token_map_coverage"] = coverage
  summary["seconds"] = round(time.perf_counter() - start, 1)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print(f"wall time {summary['seconds']:.0f} s; summary in {os.path.join(workdir, 'summary.json')}")
  return summary


def reproduce_command(data_dir: str) -> str:
  """The prepare_data command that rebuilds the cache in `data_dir`: its summary.json's config, written as the
  config variant plus the fields that differ from it (the output folder left out)."""
  from configs import train_data  # the repository's config, not part of the package

  path = os.path.join(data_dir, "summary.json")
  if not os.path.isfile(path):
    return ("python -m experiments.prepare_data --config=configs/train_data.py  # the settings of this data are not "
            f"recorded ({path} is missing)")
  with open(path) as f:
    used = json.load(f)["config"]
  model_variants = [v for v, model in train_data.MODELS.items() if model == used.get("model")]
  variant = ",".join((["regenerate"] if used.get("regenerate") else []) + model_variants[:1])
  default = train_data.get_config(variant or None).to_dict()
  overrides = []
  for key, value in used.items():
    if key == "workdir" or key not in default:
      continue
    if isinstance(value, list):
      value = tuple(value)
    if value != (tuple(default[key]) if isinstance(default[key], list) else default[key]):
      literal = repr(value) if not isinstance(value, str) else value
      overrides.append(f"--config.{key}={literal}" if " " not in literal else f"--config.{key}=\"{literal}\"")
  config_arg = "--config=configs/train_data.py" + (f":{variant}" if variant else "")
  return " ".join(["python -m experiments.prepare_data", config_arg, *overrides])


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  run(config, config.workdir)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=parse_flags)
