r"""A target's draft vocabulary size, chosen on the Spec-Bench dev prompts: the smallest truncated vocabulary whose
token map covers >= 95% of the target's greedy tokens there.

  python -m experiments.draft_vocab --model=gemma3-270m     # writes configs/draft_vocab/gemma3-270m.json
  python -m experiments.draft_vocab --model=smollm2-135m    # a report only: SmolLM2's budget keeps 8,192 (below)
  python -m experiments.draft_vocab --model=gemma3-270m --per_category=1 --max_new_tokens=16 --out=/tmp/x.json

A truncated draft head (FR-Spec; EAGLE-3's d2t map) scores `size` tokens only: the `size` most frequent greedy next
tokens of the train cache's answers, the stop tokens forced in (`specjax.data.features.top_token_map`, the token map
every family's training builds). A token outside the map is never drafted, so the share of the target's own tokens
the map holds bounds every drafter's acceptance. This tool decodes the target's greedy answers to the Spec-Bench dev
prompts (`experiments.spec_bench.select(split="dev")`: 240 questions, or `--per_category` of each category) in the
prompt format of the comparisons (`specjax.data.sequences.default_chat`: the chat template for SmolLM2, plain text for
Gemma-3-270M), `--max_new_tokens` each, counts every token it writes (a final stop token included, as the cache counts
it), and reports for each candidate size (powers of two 2,048 .. 65,536 below the vocabulary, and the full
vocabulary) the share of those tokens the train cache's map of that size covers. It chooses the smallest size
covering `--threshold` and writes a JSON record: the sizes and coverages, the choice, the prompts, the train cache
(its path, positions and a digest of its counts) and the commit.

configs/train_budget.py takes Gemma-3-270M's draft vocabulary from its record (`draft_vocab_record`, read by
experiments/train.py through `load_draft_vocab`); without the record a Gemma run stops with this command. SmolLM2's
budget keeps the 8,192 tokens its shipped drafters and budget results were trained with, record or not (its record, if
written, is a report). Dev prompts only: the comparisons report on the test side.

Time: the greedy decode of 240 prompts x 128 tokens dominates (prompts of up to ~800 tokens, batched by length).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any, Sequence

import numpy as np
from absl import app, flags, logging

import specjax
from specjax.data import features, sequences
from experiments import spec_bench
from experiments.cli import code_commit, write_atomic

THRESHOLD = 0.95
RECORDS = "configs/draft_vocab"  # <model>.json, from the repository root


def record_path(model_name: str) -> str:
  return os.path.join(RECORDS, f"{model_name}.json")


def candidate_sizes(vocab_size: int, smallest: int = 2048, largest: int = 65536) -> tuple[int, ...]:
  """Powers of two from `smallest` to `largest` that are below the vocabulary, then the full vocabulary."""
  sizes, size = [], smallest
  while size <= largest and size < vocab_size:
    sizes.append(size)
    size *= 2
  return (*sizes, vocab_size)


def coverages(train_counts: np.ndarray, greedy_counts: np.ndarray, stop_ids: Sequence[int],
              sizes: Sequence[int]) -> dict[int, float]:
  """{size: the share of `greedy_counts`' tokens held by the token map of `size` built from `train_counts`}."""
  return {int(size): features.token_map_coverage(greedy_counts, features.top_token_map(train_counts, size, stop_ids))
          for size in sizes}


def choose(coverage: dict[int, float], threshold: float = THRESHOLD) -> int:
  """The smallest size whose coverage reaches `threshold`; the largest size when none does."""
  covering = [size for size, share in coverage.items() if share >= threshold]
  return min(covering) if covering else max(coverage)


def greedy_token_counts(model: specjax.Model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        batch_size: int = 8) -> np.ndarray:
  """How often each token is one the target writes greedily after `prompts` (up to `max_new_tokens` each, through
  its stop token): int64 [V]. Prompts of similar lengths are decoded `batch_size` at a time."""
  counts = np.zeros(model.config.vocab_size, np.int64)
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  for first in range(0, len(order), batch_size):
    rows = [prompts[i] for i in order[first:first + batch_size]]
    out = specjax.generate(model, rows, max_new_tokens=max_new_tokens)
    for tokens in out.tokens:
      np.add.at(counts, np.asarray(tokens, np.int64), 1)
    logging.info("decoded %d of %d prompts", min(first + batch_size, len(order)), len(order))
  return counts


def counts_digest(token_counts: np.ndarray) -> str:
  return hashlib.sha256(np.asarray(token_counts, np.int64).tobytes()).hexdigest()[:16]


def measure(model: specjax.Model, train_cache: features.FeatureCache, questions: Sequence[spec_bench.Question], *,
            max_new_tokens: int, threshold: float = THRESHOLD, sizes: Sequence[int] | None = None,
            batch_size: int = 8) -> dict[str, Any]:
  """The record: the target's greedy tokens after `questions` (in its prompt format), each candidate size's coverage
  of them by `train_cache`'s token map, and the chosen size."""
  if train_cache.meta["vocab_size"] != model.config.vocab_size:
    raise ValueError(f"the train cache {train_cache.path} has a vocabulary of {train_cache.meta['vocab_size']}, "
                     f"{model.name} one of {model.config.vocab_size}: another target's cache")
  chat = sequences.default_chat(model.tokenizer)
  prompts = [spec_bench.prompt_ids(q, model.tokenizer, chat) for q in questions]
  start = time.perf_counter()
  greedy = greedy_token_counts(model, prompts, max_new_tokens, batch_size)
  seconds = time.perf_counter() - start
  stop_ids = train_cache.meta.get("stop_ids", ())
  coverage = coverages(train_cache.token_counts, greedy, stop_ids, sizes or candidate_sizes(model.config.vocab_size))
  return {
      "model": model.name, "vocab_size": model.config.vocab_size, "threshold": threshold,
      "draft_vocab": choose(coverage, threshold), "coverage": {str(k): round(v, 5) for k, v in coverage.items()},
      "prompts": {"split": "dev", "question_ids": [q.question_id for q in questions],
                  "format": "chat" if chat else "plain", "max_new_tokens": max_new_tokens,
                  "greedy_tokens": int(greedy.sum()), "decode_seconds": round(seconds, 1)},
      "train_cache": {"path": os.path.abspath(train_cache.path), "sequences": len(train_cache),
                      "masked_positions": int(train_cache.token_counts.sum()), "token_counts_sha256": counts_digest(train_cache.token_counts),
                      "source": train_cache.meta.get("source", {})},
  }


def load_draft_vocab(path: str, model_name: str, token_counts: np.ndarray | None = None) -> int:
  """The draft vocabulary size a record chose for `model_name` (0: the full vocabulary); an error naming the command
  that writes it when it is missing or made for another model. A train cache other than the record's (`token_counts`
  of the run's train cache) is logged: the choice was made on other counts."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no draft vocabulary record at {path}: choose one on the Spec-Bench dev prompts with "
                            f"`python -m experiments.draft_vocab --model={model_name} --out={path}` (it needs the "
                            "model's train cache), or give --config.draft_vocab=<size> "
                            "--config.draft_vocab_record=''")
  with open(path) as f:
    record = json.load(f)
  if record.get("model") != model_name:
    raise ValueError(f"{path} chose a draft vocabulary for {record.get('model')!r}, not {model_name!r}")
  if token_counts is not None and counts_digest(token_counts) != record["train_cache"]["token_counts_sha256"]:
    logging.warning("%s was chosen on another train cache (%s); its coverages are not this cache's", path,
                    record["train_cache"]["path"])
  size = int(record["draft_vocab"])
  return 0 if size >= int(record["vocab_size"]) else size


def default_data_dir(model_name: str) -> str:
  """The regenerated cache configs/train_data.py builds for the model (prepare_data's workdir)."""
  from configs import train_data  # the repository's config, not part of the package

  variant = next((v for v, m in train_data.MODELS.items() if m == model_name), None)
  return train_data.get_config("regenerate" + (f",{variant}" if variant else "")).workdir


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  commit = code_commit()
  FLAGS = flags.FLAGS
  model = specjax.load(FLAGS.model, dtype="float32")
  data_dir = FLAGS.data_dir or default_data_dir(FLAGS.model)
  train_cache = features.FeatureCache.open(os.path.join(data_dir, "train"))
  questions = spec_bench.select(spec_bench.load_questions(), per_category=FLAGS.per_category, split="dev")
  record = measure(model, train_cache, questions, max_new_tokens=FLAGS.max_new_tokens, threshold=FLAGS.threshold,
                   batch_size=FLAGS.batch_size)
  record.update(command="python -m experiments.draft_vocab " + " ".join(sys.argv[1:]), commit=commit,
                date=time.strftime("%Y-%m-%d"))
  print(f"{model.name}: {record['prompts']['greedy_tokens']:,} greedy tokens after {len(questions)} Spec-Bench dev "
        f"prompts ({record['prompts']['format']} format), {record['prompts']['decode_seconds']:.0f} s of decoding")
  for size, share in record["coverage"].items():
    print(f"  V'={int(size):>7,}: covers {share:.2%}" + ("   <- chosen" if int(size) == record["draft_vocab"] else ""))
  out = FLAGS.out or record_path(model.name)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  write_atomic(out, json.dumps(record, indent=1) + "\n")
  print(f"smallest covering {FLAGS.threshold:.0%}: {record['draft_vocab']:,}; wrote {out}")


def _define_flags():
  """Defined when the command runs, not on import (experiments/train.py imports this module): its names (--model,
  --out, --max_new_tokens) are other commands' too."""
  flags.DEFINE_string("model", "smollm2-135m", "the target (specjax.load)")
  flags.DEFINE_string("data_dir", "", "prepare_data's workdir whose train cache ranks the tokens; default: the model's "
                      "regenerated cache of configs/train_data.py")
  flags.DEFINE_integer("per_category", 0, "dev questions per category (0: all 240)")
  flags.DEFINE_integer("max_new_tokens", 128, "greedy tokens per prompt")
  flags.DEFINE_integer("batch_size", 8, "prompts per decoding call")
  flags.DEFINE_float("threshold", THRESHOLD, "the coverage the chosen size reaches")
  flags.DEFINE_string("out", "", f"the record; default {RECORDS}/<model>.json")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
