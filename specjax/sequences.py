"""Training sequences for drafters: a chat prompt and an answer as token ids, with a loss mask on the answer.

A drafter learns to predict what the target would say next in an assistant answer, so a sequence is one
(user, assistant) exchange rendered with the target's chat template, and its loss mask marks the positions t
whose next token t+1 belongs to the answer (its end-of-turn token included): position t's hidden state and
the target's distribution there are what predicts token t+1. The answer is either the one in the data
(teacher forcing on human-written text) or the target's own greedy answer to the same prompt
(`regenerate=True`, EAGLE's choice), which is the text the drafter will meet at inference.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import time
from typing import NamedTuple, Sequence as Seq

import numpy as np
from absl import logging
from tqdm.auto import tqdm

from specjax.generate import generate
from specjax import sharegpt
from specjax.loading import CheckpointError, Model
from specjax.tokenizer import Tokenizer

MIN_ANSWER_TOKENS = 16
# Text beyond this many characters per position cannot reach the sequence: it is not tokenized.
_CHARS_PER_POSITION = 32


class Sequence(NamedTuple):
  """tokens int32 [T <= seq_len]; loss_mask bool [T]: True where the next token is part of the answer."""
  tokens: np.ndarray
  loss_mask: np.ndarray


def sequence_from_ids(prompt_ids: Seq[int], answer_ids: Seq[int], seq_len: int) -> Sequence:
  """prompt + answer cut to seq_len; loss_mask[t] is True iff token t + 1 is an answer token."""
  tokens = np.asarray([*prompt_ids, *answer_ids][:seq_len], np.int32)
  loss_mask = np.zeros(len(tokens), bool)
  loss_mask[max(len(prompt_ids) - 1, 0):len(tokens) - 1] = True
  return Sequence(tokens, loss_mask)


def _special_strings(tokenizer: Tokenizer) -> tuple[str, ...]:
  return tuple(t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special)


def render_prompt(tokenizer: Tokenizer, user_text: str, max_tokens: int) -> tuple[list[int], str] | None:
  """(chat prompt ids for one user message, generation prompt included, the user text it holds).

  A prompt longer than `max_tokens` has its user message cut to its first tokens (at a token boundary of
  the message) so that it fits; None if even an empty message would not fit.
  """
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True)
  if len(prompt) <= max_tokens:
    return prompt, user_text
  offsets = tokenizer.backend.encode(user_text, add_special_tokens=False).offsets
  keep = len(offsets) - (len(prompt) - max_tokens)
  while keep > 0:
    cut = user_text[:offsets[keep - 1][1]]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": cut}], add_generation_prompt=True)
    if len(prompt) <= max_tokens:
      return prompt, cut
    keep -= len(prompt) - max_tokens  # re-tokenizing at the cut can merge tokens differently
  return None


def render_answer(tokenizer: Tokenizer, prompt_ids: Seq[int], user_text: str, answer_text: str) -> list[int] | None:
  """The answer's token ids as the chat template writes them after the prompt, through its end-of-turn token.

  `prompt_ids` must be what `render_prompt` gave for `user_text`. None when the rendered exchange does not
  start with the prompt's tokens (the template or the tokenizer joins them differently).
  """
  messages = [{"role": "user", "content": user_text}, {"role": "assistant", "content": answer_text}]
  full = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
  if full[:len(prompt_ids)] != list(prompt_ids):
    return None
  answer = full[len(prompt_ids):]
  stops = [i for i, t in enumerate(answer) if t in tokenizer.stop_ids]
  return answer[:stops[-1] + 1] if stops else answer  # what the template writes after the turn is not generated


def exchanges(messages: Seq[dict], max_pairs: int) -> list[tuple[str, str]]:
  """Up to `max_pairs` (user text, assistant text) pairs: a user message directly followed by an answer."""
  pairs = []
  for first, second in zip(messages, messages[1:]):
    if first["role"] == "user" and second["role"] == "assistant":
      pairs.append((first["content"], second["content"]))
      if len(pairs) == max_pairs:
        break
  return pairs


def make_sequences(model: Model, conversations: Seq[dict | Seq[dict]], *, seq_len: int,
                   max_pairs_per_conversation: int = 1, regenerate: bool = False, max_new_tokens: int | None = None,
                   batch_size: int = 16, min_answer_tokens: int = MIN_ANSWER_TOKENS,
                   progress_path: str | None = None) -> list[Sequence]:
  """Training sequences from conversations, in conversation order.

  Each (user, assistant) exchange (the first `max_pairs_per_conversation` of a conversation, each on its own
  after the template's default system prompt) becomes one sequence of at most seq_len tokens. A user message
  too long for the answer to start within the first seq_len // 2 tokens is cut. Exchanges with fewer than
  `min_answer_tokens` answer tokens in the sequence, and exchanges whose text contains a special token's
  spelling (e.g. "<|im_end|>", which would encode as the token itself), are skipped.

  Args:
    model: the target, with a tokenizer.
    conversations: ShareGPT dicts (see `sharegpt.to_messages`) or lists of chat messages.
    seq_len: the longest sequence, prompt included.
    regenerate: replace each answer by the target's greedy answer to the same prompt (`specjax.generate`,
      `batch_size` prompts of similar lengths per call).
    max_new_tokens: the longest regenerated answer (default: what fits in seq_len after the prompt).
    progress_path: where regeneration saves the answers made so far, so that a killed run resumes (see
      `_greedy_answers`).
  """
  tokenizer = model.tokenizer
  if tokenizer is None:
    raise ValueError("make_sequences renders chat text: the model needs a tokenizer")
  if seq_len < 2 * min_answer_tokens:
    raise ValueError(f"seq_len {seq_len} leaves no room for a {min_answer_tokens}-token answer")
  specials = _special_strings(tokenizer)
  skipped: collections.Counter = collections.Counter()
  prompts, answers = [], []  # one entry per kept exchange
  for conversation in conversations:
    messages = sharegpt.to_messages(conversation) if isinstance(conversation, dict) else list(conversation)
    pairs = exchanges(messages, max_pairs_per_conversation)
    if not pairs:
      skipped["conversations without a (user, assistant) exchange"] += 1
    for user_text, answer_text in pairs:
      if any(s in user_text or s in answer_text for s in specials):
        skipped["special token spelled in the text"] += 1
        continue
      rendered = render_prompt(tokenizer, user_text[:_CHARS_PER_POSITION * seq_len], seq_len // 2)
      if rendered is None:
        skipped["template alone longer than seq_len // 2"] += 1
        continue
      prompt, user_text = rendered
      answer = None
      if not regenerate:
        answer = render_answer(tokenizer, prompt, user_text, answer_text[:_CHARS_PER_POSITION * seq_len])
        if answer is None:
          skipped["prompt tokens change when the answer follows"] += 1
          continue
      prompts.append(prompt)
      answers.append(answer)
  if regenerate:
    answers = _greedy_answers(model, prompts, seq_len, max_new_tokens, batch_size, progress_path)
  sequences = []
  for prompt, answer in zip(prompts, answers):
    sequence = sequence_from_ids(prompt, answer, seq_len)
    if sequence.loss_mask.sum() < min_answer_tokens:
      skipped[f"fewer than {min_answer_tokens} answer tokens"] += 1
      continue
    sequences.append(sequence)
  logging.info("%d sequences from %d conversations (%s); skipped: %s", len(sequences), len(conversations),
               "target-generated answers" if regenerate else "answers from the data", dict(skipped) or "none")
  return sequences


def _greedy_answers(model: Model, prompts: list[list[int]], seq_len: int, max_new_tokens: int | None,
                    batch_size: int, progress_path: str | None = None,
                    save_every_seconds: float = 60.0) -> list[list[int]]:
  """The target's greedy answer to every prompt, batched by similar prompt length to limit padding.

  With `progress_path`, the answers made so far are saved there (atomically, at most every
  `save_every_seconds` and after the last batch), and a rerun over the same prompts and settings starts from
  them: a killed regeneration loses at most that much work. Saved progress of other prompts is an error.
  """
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  answers: list[list[int] | None] = [None] * len(prompts)
  settings = [repr(model.config), [list(map(int, p)) for p in prompts], seq_len, max_new_tokens, batch_size]
  fingerprint = hashlib.sha256(json.dumps(settings).encode()).hexdigest()
  if progress_path and os.path.exists(progress_path):
    for i, tokens in _load_progress(progress_path, fingerprint).items():
      answers[i] = tokens
    logging.info("resuming greedy answers: %d of %d from %s", sum(a is not None for a in answers), len(prompts),
                 progress_path)
  last_save = time.monotonic()
  batches = range(0, len(order), batch_size)
  for number, start in enumerate(tqdm(batches, desc="greedy answers", unit="batch")):
    rows = order[start:start + batch_size]
    if all(answers[i] is not None for i in rows):
      continue
    room = seq_len - min(len(prompts[i]) for i in rows)
    # Rounded up so that batches share a few compiled shapes; answers are cut to seq_len afterwards.
    new_tokens = max_new_tokens or min(seq_len, -(-room // 32) * 32)
    out = generate(model, [prompts[i] for i in rows], max_new_tokens=new_tokens)
    for i, tokens in zip(rows, out.tokens):
      answers[i] = tokens
    if progress_path and (number == len(batches) - 1 or time.monotonic() - last_save >= save_every_seconds):
      _save_progress(progress_path, fingerprint, answers)
      last_save = time.monotonic()
  return answers


def _save_progress(path: str, fingerprint: str, answers: Seq[Seq[int] | None]) -> None:
  done = [i for i, a in enumerate(answers) if a is not None]
  tmp = f"{path}.tmp.npz"
  np.savez(tmp, fingerprint=np.asarray(fingerprint), indices=np.asarray(done, np.int64),
           lengths=np.asarray([len(answers[i]) for i in done], np.int64),
           tokens=np.concatenate([np.zeros(0, np.int32)] + [np.asarray(answers[i], np.int32) for i in done]))
  os.replace(tmp, path)


def _load_progress(path: str, fingerprint: str) -> dict[int, list[int]]:
  try:
    with np.load(path) as data:
      saved, indices, lengths, tokens = str(data["fingerprint"]), data["indices"], data["lengths"], data["tokens"]
  except (OSError, ValueError, KeyError, EOFError) as e:
    raise CheckpointError(f"{path}: unreadable progress of a regeneration ({e}); delete it to start over") from e
  if saved != fingerprint:
    raise CheckpointError(f"{path} holds answers to other prompts or settings; delete it or choose another workdir")
  starts = np.cumsum(lengths) - lengths
  return {int(i): tokens[s:s + n].tolist() for i, s, n in zip(indices, starts, lengths)}


def save_sequences(path: str, sequences: Seq[Sequence], source: dict) -> None:
  """Writes sequences and a JSON-able description of their source to one .npz file, atomically."""
  lengths = np.asarray([len(s.tokens) for s in sequences], np.int64)
  tokens = np.concatenate([np.zeros(0, np.int32), *(s.tokens for s in sequences)]).astype(np.int32)
  loss_mask = np.concatenate([np.zeros(0, bool), *(s.loss_mask for s in sequences)]).astype(bool)
  tmp = f"{path}.partial.npz"
  np.savez(tmp, lengths=lengths, tokens=tokens, loss_mask=loss_mask,
           source=np.asarray(json.dumps(source, sort_keys=True)))
  os.replace(tmp, path)


def load_sequences(path: str) -> tuple[list[Sequence], dict]:
  """(sequences, source description) from `save_sequences`."""
  with np.load(path) as data:
    lengths, tokens, loss_mask = data["lengths"], data["tokens"], data["loss_mask"]
    source = json.loads(str(data["source"]))
  starts = np.cumsum(lengths) - lengths
  sequences = [Sequence(tokens[s:s + n], loss_mask[s:s + n]) for s, n in zip(starts, lengths)]
  return sequences, source
