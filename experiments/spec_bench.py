"""Spec-Bench prompts (Xia et al., 2024): the 480 questions of `data/spec_bench/question.jsonl`.

Thirteen categories: the eight MT-bench ones (10 questions each, "multi-turn conversation"; we use the
first turn) and translation, summarization, qa, math_reasoning, rag (80 each). Provenance and license:
data/spec_bench/SOURCE.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

from specjax.data import sequences

# The data lives at the repository root (next to `experiments/`); the package is installed editable.
QUESTIONS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "data", "spec_bench", "question.jsonl")

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
              "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclasses.dataclass(frozen=True)
class Question:
  question_id: int
  category: str
  turns: tuple[str, ...]


def load_questions(path: str = QUESTIONS_PATH) -> list[Question]:
  """All questions, in file order."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"Spec-Bench questions not found at {path}; specjax expects a source checkout "
                            "(pip install -e .) with data/spec_bench/question.jsonl")
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [Question(int(r["question_id"]), r["category"], tuple(r["turns"])) for r in rows]


SPLITS = ("", "dev", "test")


def in_split(question: Question, questions: Sequence[Question], split: str) -> bool:
  """Whether `question` is on the `split` side of the dev/test split: within its category, in file order, the
  questions at even places (0, 2, 4, ...) are dev and those at odd places test (MT-bench's categories: 5 and 5;
  the others: 40 and 40). Constants are tuned on dev and reported on test; "" is every question."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; splits: dev, test, or '' for every question")
  if not split:
    return True
  place = [q.question_id for q in questions if q.category == question.category].index(question.question_id)
  return (place % 2 == 0) == (split == "dev")


def select(questions: Sequence[Question], *, categories: Sequence[str] = (), per_category: int = 0,
           question_ids: Sequence[int] = (), max_prompts: int = 0, split: str = "") -> list[Question]:
  """Picks questions deterministically (file order).

  Args:
    categories: categories to draw from, in this order (empty: all thirteen).
    per_category: the first this many questions of each category (0: all of them), of the split's side.
    question_ids: explicit ids; when given, `categories` and `per_category` are ignored (each must be on the
      split's side).
    max_prompts: cap on the total (0: no cap).
    split: "dev" or "test" (`in_split`), or "" for every question.
  """
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; splits: dev, test, or '' for every question")
  if question_ids:
    by_id = {q.question_id: q for q in questions}
    unknown = [i for i in question_ids if i not in by_id]
    if unknown:
      raise ValueError(f"unknown Spec-Bench question ids: {unknown}")
    chosen = [by_id[i] for i in question_ids]
    outside = [q.question_id for q in chosen if not in_split(q, questions, split)]
    if outside:
      raise ValueError(f"question ids {outside} are not on the {split} side of the dev/test split")
  else:
    categories = tuple(categories) or CATEGORIES
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
      raise ValueError(f"unknown Spec-Bench categories {unknown}; choose from {', '.join(CATEGORIES)}")
    chosen = []
    for category in categories:
      pool = [q for q in questions if q.category == category and in_split(q, questions, split)]
      if per_category > len(pool):
        raise ValueError(f"category {category!r} has {len(pool)} questions, asked for {per_category}")
      chosen += pool[:per_category or len(pool)]
  return chosen[:max_prompts] if max_prompts else chosen


def prompt_text(question: Question, *, min_tokens: int = 0, tokenizer=None,
                questions: Sequence[Question] = ()) -> str:
  """The question's first turn; with `min_tokens`, preceded by the first turns of the questions before it in
  `questions` (the nearest first, wrapping around to the end), joined by blank lines, until `tokenizer` encodes
  the text to at least `min_tokens` tokens: a long context that ends with the question, so that a model with
  sliding-window layers decodes past its window."""
  text = question.turns[0]
  if not min_tokens:
    return text
  if tokenizer is None or not questions:
    raise ValueError("prompt_text with min_tokens needs the tokenizer and the questions to draw context from")
  at = next((i for i, q in enumerate(questions) if q.question_id == question.question_id), 0)
  earlier = [questions[(at - k) % len(questions)] for k in range(1, len(questions))]
  parts = [text]
  for other in earlier:
    if len(tokenizer.encode("\n\n".join(parts))) >= min_tokens:
      break
    parts.insert(0, other.turns[0])
  else:
    raise ValueError(f"all {len(questions)} questions together hold fewer than {min_tokens} tokens")
  return "\n\n".join(parts)


def prompt_ids(question: Question, tokenizer, chat: bool, *, min_tokens: int = 0,
               questions: Sequence[Question] = ()) -> list[int]:
  """Token ids of the question's first turn (`prompt_text`: with `min_tokens`, after earlier questions): as a
  one-message chat (with the generation prompt) or the plain text, its BOS included (a base model); the training data
  writes its prompts with the same function (`specjax.data.sequences.prompt_ids`)."""
  text = prompt_text(question, min_tokens=min_tokens, tokenizer=tokenizer, questions=questions)
  return sequences.prompt_ids(tokenizer, text, chat)
