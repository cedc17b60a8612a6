"""Choosing a target's draft vocabulary on the Spec-Bench dev prompts (experiments/draft_vocab.py): the smallest
candidate size whose token map, ranked by the train cache, covers the threshold of the target's greedy tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

import specjax
from experiments import draft_vocab, regenerate, spec_bench
from specjax.data import features


def test_candidates_are_powers_of_two_below_the_vocabulary_then_the_whole_of_it():
  assert draft_vocab.candidate_sizes(262144) == (2048, 4096, 8192, 16384, 32768, 65536, 262144)
  assert draft_vocab.candidate_sizes(49152) == (2048, 4096, 8192, 16384, 32768, 49152)
  assert draft_vocab.candidate_sizes(32, smallest=4, largest=16) == (4, 8, 16, 32)
  assert draft_vocab.candidate_sizes(16, smallest=4, largest=16) == (4, 8, 16)


def test_the_choice_is_the_smallest_size_covering_the_threshold_of_a_planted_distribution():
  """Train counts rank ids 0, 1, 2, ... (id i more frequent than i + 1); the target's greedy tokens put 60% of their
  mass on ids 0-3, 30% on 4-7, 6% on 8-15 and 4% on 16-31: maps of 4, 8, 16, 32 cover 60%, 90%, 96% and 100%."""
  vocab = 32
  train_counts = np.arange(vocab, 0, -1, dtype=np.int64) * 10
  greedy = np.zeros(vocab, np.int64)
  greedy[0:4], greedy[4:8], greedy[8:16], greedy[16:32] = 150, 75, [8, 7] * 4, [3, 2] * 8
  assert greedy.sum() == 1000
  sizes = draft_vocab.candidate_sizes(vocab, smallest=4, largest=16)
  coverage = draft_vocab.coverages(train_counts, greedy, stop_ids=(), sizes=sizes)
  assert coverage == pytest.approx({4: 0.6, 8: 0.9, 16: 0.96, 32: 1.0})
  assert draft_vocab.choose(coverage, 0.95) == 16
  assert draft_vocab.choose(coverage, 0.9) == 8 and draft_vocab.choose(coverage, 0.97) == 32
  assert draft_vocab.choose({4: 0.5, 8: 0.7}, 0.95) == 8  # none covers it: the largest
  # A stop token is forced into every map (a drafter that cannot end a turn never ends one), in place of id 3.
  with_stop = draft_vocab.coverages(train_counts, greedy, stop_ids=(31,), sizes=(4,))
  assert with_stop[4] == pytest.approx((150 * 3 + 2) / 1000)


def test_measure_counts_the_targets_greedy_tokens_on_dev_prompts_in_its_format(tiny_base, tmp_path):
  """On a base model: the dev questions as plain prompts, every greedy token counted (a final stop token included),
  each size's coverage by the train cache's map, the smallest covering size chosen, and a record train runs read."""
  prompts = [[1, 5, 6, 7], [1, 9, 8], [1, 4, 4, 4, 4], [1, 12, 13]]
  cache = regenerate.build_regenerated_cache(tiny_base, prompts, str(tmp_path / "train"), seq_len=24,
                                             feature_layers=(0, 3), top_k=4, batch_size=2)
  questions = spec_bench.select(spec_bench.load_questions(), categories=("writing", "roleplay", "qa"),
                                per_category=1, split="dev")
  sizes = draft_vocab.candidate_sizes(32, smallest=4, largest=16)
  record = draft_vocab.measure(tiny_base, cache, questions, max_new_tokens=6, threshold=0.5, sizes=sizes,
                               batch_size=2)
  greedy = np.zeros(32, np.int64)
  for q in questions:
    ids = spec_bench.prompt_ids(q, tiny_base.tokenizer, chat=False)
    assert ids[0] == tiny_base.tokenizer.bos_id
    np.add.at(greedy, specjax.generate(tiny_base, [ids], max_new_tokens=6).tokens[0], 1)
  expected = {size: features.token_map_coverage(greedy, features.top_token_map(cache.token_counts, size, (2,)))
              for size in sizes}
  assert record["coverage"] == {str(k): pytest.approx(v, abs=1e-5) for k, v in expected.items()}
  assert record["draft_vocab"] == min(k for k, v in expected.items() if v >= 0.5) < 32  # not the whole vocabulary
  assert record["prompts"]["format"] == "plain" and record["prompts"]["greedy_tokens"] == greedy.sum()
  assert record["prompts"]["question_ids"] == [q.question_id for q in questions]
  assert all(spec_bench.in_split(q, spec_bench.load_questions(), "dev") for q in questions)

  path = tmp_path / "record.json"
  path.write_text(json.dumps(record))
  assert draft_vocab.load_draft_vocab(str(path), "tiny-base", cache.token_counts) == record["draft_vocab"]
  path.write_text(json.dumps({**record, "draft_vocab": 32}))
  assert draft_vocab.load_draft_vocab(str(path), "tiny-base") == 0  # the full vocabulary
  with pytest.raises(ValueError, match="for 'tiny-base', not 'gemma3-270m'"):
    draft_vocab.load_draft_vocab(str(path), "gemma3-270m")
  with pytest.raises(FileNotFoundError, match="python -m experiments.draft_vocab --model=gemma3-270m"):
    draft_vocab.load_draft_vocab(str(tmp_path / "absent.json"), "gemma3-270m")
