"""Training sequences for drafters: a prompt and an answer as token ids, with a loss mask on the answer.

A drafter learns to predict what the target would say next after a prompt, so a sequence is one (user, assistant)
exchange of the data, its prompt written the way the evaluation prompts the target (`prompt_ids`), and its loss mask
marks the positions t whose next token t+1 belongs to the answer (its end-of-turn token included): position t's
hidden state and the target's distribution there are what predicts token t+1. The answer is either the one in the
data (`make_sequences`: teacher forcing on human-written text) or the target's own answer to the same prompt
(`make_prompts`, answered by `experiments.regenerate.build_regenerated_cache`; EAGLE's choice), which is the text
the drafter will meet at inference.

Two prompt formats, one per kind of model (`default_chat`):
  chat   an instruct model (one with a chat template): the user message through the template, its generation prompt
         included (the template writes its BOS and system prompt); the answer ends with the end-of-turn token.
  plain  a base model (no chat template, e.g. Gemma-3-270M): the user text alone, encoded as the tokenizer encodes
         text (its BOS first, nothing after); the answer is the target's own continuation, up to one of its
         end-of-sequence tokens or the end of the sequence. A base model has no turn for the data's answer to fill,
         so only the target's own answers are made in this format (`make_sequences` refuses it).
Either prompt equals `experiments.spec_bench.prompt_ids(question, tokenizer, chat)` for the same text (that function
calls `prompt_ids`), so a drafter trains on the format it is evaluated on.
"""

from __future__ import annotations

import collections
import json
import os
from typing import NamedTuple, Sequence as Seq

import numpy as np
from absl import logging

from specjax.data import sharegpt
from specjax.loading import Model
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


def default_chat(tokenizer: Tokenizer) -> bool:
  """Whether a model is prompted through its chat template (it has one: an instruct model) or with plain text (a base
  model), as the evaluation prompts each (`configs/bench_peers.py:gemma`, `configs/calibrated_costs.py`)."""
  return bool(tokenizer.chat_template)


def prompt_ids(tokenizer: Tokenizer, user_text: str, chat: bool) -> list[int]:
  """One user message as prompt ids: through the chat template with its generation prompt (`chat`), or the plain
  text as `tokenizer.encode` gives it, its BOS included (a base model)."""
  if chat:
    return tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True)
  return tokenizer.encode(user_text)


def render_prompt(tokenizer: Tokenizer, user_text: str, max_tokens: int, chat: bool = True
                  ) -> tuple[list[int], str] | None:
  """(`prompt_ids` of one user message, the user text it holds).

  A prompt longer than `max_tokens` has its user message cut to its first tokens (at a token boundary of
  the message) so that it fits; None if even an empty message would not fit.
  """
  prompt = prompt_ids(tokenizer, user_text, chat)
  if len(prompt) <= max_tokens:
    return prompt, user_text
  offsets = tokenizer.backend.encode(user_text, add_special_tokens=False).offsets
  keep = len(offsets) - (len(prompt) - max_tokens)
  while keep > 0:
    cut = user_text[:offsets[keep - 1][1]]
    prompt = prompt_ids(tokenizer, cut, chat)
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


def _rendered_exchanges(tokenizer: Tokenizer, conversations: Seq[dict | Seq[dict]], seq_len: int,
                        max_pairs_per_conversation: int, with_answers: bool, skipped: collections.Counter,
                        chat: bool = True):
  """(prompt ids, answer ids or None) of each usable exchange, in conversation order; counts the others in
  `skipped`. Answers are rendered only `with_answers` (chat only), and only then does their text have to be
  usable."""
  specials = _special_strings(tokenizer)
  for conversation in conversations:
    messages = sharegpt.to_messages(conversation) if isinstance(conversation, dict) else list(conversation)
    pairs = exchanges(messages, max_pairs_per_conversation)
    if not pairs:
      skipped["conversations without a (user, assistant) exchange"] += 1
    for user_text, answer_text in pairs:
      if any(s in user_text or (with_answers and s in answer_text) for s in specials):
        skipped["special token spelled in the text"] += 1
        continue
      rendered = render_prompt(tokenizer, user_text[:_CHARS_PER_POSITION * seq_len], seq_len // 2, chat)
      if rendered is None:
        skipped["template alone longer than seq_len // 2"] += 1
        continue
      prompt, user_text = rendered
      answer = None
      if with_answers:
        answer = render_answer(tokenizer, prompt, user_text, answer_text[:_CHARS_PER_POSITION * seq_len])
        if answer is None:
          skipped["prompt tokens change when the answer follows"] += 1
          continue
      yield prompt, answer


def _tokenizer_of(model: Model) -> Tokenizer:
  if model.tokenizer is None:
    raise ValueError("rendering text needs the model's tokenizer")
  return model.tokenizer


def check_data_answers(model: Model, chat: bool) -> None:
  """The data's own answers take the chat format: an error naming the alternative for the plain one. A chat answer
  fills the assistant's turn; a base model's plain prompt has no turn, so the data's answer appended to the user's
  text would be neither what the target writes after it nor what the evaluation decodes."""
  if not chat:
    raise ValueError(
        f"{model.name} is prompted with plain text (no chat template): ShareGPT's own answers need the chat format, "
        "where they fill the assistant's turn. Train it on its own answers: configs/train_data.py:regenerate,<model> "
        "(make_prompts, then experiments.regenerate)")


def make_sequences(model: Model, conversations: Seq[dict | Seq[dict]], *, seq_len: int,
                   max_pairs_per_conversation: int = 1, min_answer_tokens: int = MIN_ANSWER_TOKENS,
                   chat: bool | None = None) -> list[Sequence]:
  """Training sequences from conversations' own answers, in conversation order.

  Each (user, assistant) exchange (the first `max_pairs_per_conversation` of a conversation, each on its own
  after the template's default system prompt) becomes one sequence of at most seq_len tokens. A user message
  too long for the answer to start within the first seq_len // 2 tokens is cut. Exchanges with fewer than
  `min_answer_tokens` answer tokens in the sequence, and exchanges whose text contains a special token's
  spelling (e.g. "<|im_end|>", which would encode as the token itself), are skipped.

  Args:
    model: the target, with a tokenizer.
    conversations: ShareGPT dicts (see `sharegpt.to_messages`) or lists of chat messages.
    seq_len: the longest sequence, prompt included.
    chat: the prompt format; None: the model's (`default_chat`). Only the chat format takes the data's answers.
  """
  tokenizer = _tokenizer_of(model)
  check_data_answers(model, default_chat(tokenizer) if chat is None else chat)
  if seq_len < 2 * min_answer_tokens:
    raise ValueError(f"seq_len {seq_len} leaves no room for a {min_answer_tokens}-token answer")
  skipped: collections.Counter = collections.Counter()
  sequences = []
  for prompt, answer in _rendered_exchanges(tokenizer, conversations, seq_len, max_pairs_per_conversation, True,
                                            skipped, chat=True):
    sequence = sequence_from_ids(prompt, answer, seq_len)
    if sequence.loss_mask.sum() < min_answer_tokens:
      skipped[f"fewer than {min_answer_tokens} answer tokens"] += 1
      continue
    sequences.append(sequence)
  logging.info("%d sequences from %d conversations; skipped: %s", len(sequences), len(conversations),
               dict(skipped) or "none")
  return sequences


def make_prompts(model: Model, conversations: Seq[dict | Seq[dict]], *, seq_len: int,
                 max_pairs_per_conversation: int = 1, chat: bool | None = None) -> list[list[int]]:
  """The prompts (`prompt_ids`: chat with the generation prompt, or plain text; None: the model's format,
  `default_chat`) of the exchanges `make_sequences` would take, for the target to answer itself
  (`experiments.regenerate.build_regenerated_cache`): a user message is cut so that the prompt takes at most
  seq_len // 2 tokens; the conversation's own answer is not read."""
  tokenizer = _tokenizer_of(model)
  chat = default_chat(tokenizer) if chat is None else chat
  skipped: collections.Counter = collections.Counter()
  prompts = [prompt for prompt, _ in _rendered_exchanges(tokenizer, conversations, seq_len,
                                                         max_pairs_per_conversation, False, skipped, chat)]
  logging.info("%d prompts from %d conversations; skipped: %s", len(prompts), len(conversations),
               dict(skipped) or "none")
  return prompts


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
