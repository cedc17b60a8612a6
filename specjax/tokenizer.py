"""Text <-> token ids, and chat prompts, for the models specjax runs.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the Rust backend), the model's Jinja chat
template and its special token ids. It is built either from a GGUF file's metadata
(`Tokenizer.from_gguf`: byte-level BPE as in Llama 3 / Qwen / SmolLM, or SentencePiece-style BPE with
byte fallback as in Llama 2 / Mistral / Gemma) or from a saved Hugging Face tokenizer directory
(`Tokenizer.from_hf_dir`).

The GGUF path mirrors what `transformers` does for `AutoTokenizer.from_pretrained(..., gguf_file=...)`
(see `transformers/integrations/gguf/gguf_tokenizer_mapping.py`), so that `encode`, `decode` and
`apply_chat_template` give the same ids and strings as the transformers reference, without
importing transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from absl import logging
from jinja2.sandbox import ImmutableSandboxedEnvironment
from specjax.config import cache_dir
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

if TYPE_CHECKING:
  import gguf

__all__ = ["Tokenizer", "TokenizerError"]


class TokenizerError(ValueError):
  """A tokenizer that is missing, malformed, or of a kind this module does not build."""


# Named special tokens a chat template can see, in transformers' order (SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Tokens that end a turn or a text in common chat models; llama.cpp treats these as end-of-generation too.
_END_OF_TURN = (
  "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
  "<|endoftext|>", "<|end_of_text|>", "<EOT>",
)  # fmt: skip

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# SentencePiece's word-boundary mark: "▁" stands for a space in a SentencePiece vocabulary.
_SPIECE_SPACE = "\u2581"

# `general.architecture` values whose SentencePiece vocabulary transformers builds as Gemma's (GemmaTokenizer, with
# merges in file order) or as Phi-3's (prefix space from a normalizer) rather than as Llama's.
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_PHI3_ARCHITECTURES = ("phi3",)

# Named special tokens transformers' tokenizer classes declare by default: made special when the vocabulary has them.
_DEFAULT_SPECIAL = {
  "gemma": ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"),
  "llama": ("<unk>", "<s>", "</s>"),
}

# Version of what a cached SentencePiece tokenizer holds; part of the cache key, so bumping it orphans old files.
_CACHE_FORMAT = 1

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, as transformers' GGUF converter maps them.
# Any other value (e.g. SmolLM2's "smollm") keeps the plain GPT-2 ByteLevel regex, as transformers does.
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
  **dict.fromkeys(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
    _LLAMA3_SPLIT,
  ),
  **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
  "qwen35": _QWEN35_SPLIT,
  "tekken": _TEKKEN_SPLIT,
  **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}  # fmt: skip


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table, the alphabet byte-level BPE vocabularies are spelled in."""
  bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


class Tokenizer:
  """A BPE tokenizer (byte-level, or SentencePiece-style with byte fallback) plus the model's chat template and
  special token ids.

  Attributes:
    backend: the underlying `tokenizers.Tokenizer`.
    chat_template: the Jinja chat template source, or None.
    special_tokens: named special tokens (`bos_token`, `eos_token`, ...) as strings, as the chat
      template sees them.
    eos_id, bos_id, pad_id: special ids (`bos_id`/`pad_id` may be None).
    vocab_size: number of token ids, added tokens included.
    stop_ids: ids that end generation: eos first, then any end-of-turn tokens the vocabulary has.
  """

  def __init__(
    self,
    backend: Backend,
    special_tokens: dict[str, str | None],
    chat_template: str | None = None,
    extra_stop_ids: Iterable[int] = (),
  ):
    self.backend = backend
    self.backend.encode_special_tokens = False  # match special tokens written in the text, as HF does
    self.chat_template = chat_template
    self.special_tokens = {k: v for k, v in special_tokens.items() if k in _NAMED_SPECIAL and v is not None}
    self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    self.bos_id = self._special_id("bos_token")
    self.pad_id = self._special_id("pad_token")
    eos_id = self._special_id("eos_token")
    if eos_id is None:
      raise TokenizerError("tokenizer has no eos token; cannot tell when generation ends")
    self.eos_id: int = eos_id

    special_strings = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    eot_ids = [backend.token_to_id(t) for t in _END_OF_TURN if t in special_strings]
    stops = [i for i in (*eot_ids, *extra_stop_ids) if i is not None and 0 <= i < self.vocab_size]
    self.stop_ids: tuple[int, ...] = (self.eos_id, *sorted(set(stops) - {self.eos_id}))

  def _special_id(self, name: str) -> int | None:
    token = self.special_tokens.get(name)
    return None if token is None else self.backend.token_to_id(token)

  def __repr__(self) -> str:
    return (
      f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
      f"pad_id={self.pad_id}, stop_ids={self.stop_ids})"
    )

  # ------------------------------------------------------------------ construction

  @classmethod
  def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
    """Build the tokenizer described by a GGUF file's `tokenizer.*` metadata.

    Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) and SentencePiece BPE with byte fallback ("llama")
    are supported; unigram ("t5") and other vocabularies raise `TokenizerError`. A SentencePiece file
    usually lists no merges: deriving them from a large vocabulary takes seconds, so that kind is built
    once and then read from a cache (`_cached_backend`).
    """
    fields = reader.fields

    def get(key: str, default: Any = None) -> Any:
      field = fields.get(key)
      try:  # `contents()` decodes scalars, strings and arrays (string arrays -> list[str])
        return default if field is None else field.contents()
      except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise TokenizerError(f"GGUF metadata {key!r} is malformed: {e}") from e

    model = get("tokenizer.ggml.model")
    if model is None:
      raise TokenizerError("GGUF file has no tokenizer (missing 'tokenizer.ggml.model')")
    if model not in ("gpt2", "llama"):
      raise TokenizerError(
        f"unsupported GGUF tokenizer model {model!r}: only byte-level BPE ('gpt2') and SentencePiece BPE ('llama') "
        "are supported"
      )
    tokens = get("tokenizer.ggml.tokens")
    merges = get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
      raise TokenizerError("GGUF 'tokenizer.ggml.tokens' is missing or not a list of strings")
    if (merges is not None or model == "gpt2") and (
      not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges)
    ):
      raise TokenizerError("GGUF 'tokenizer.ggml.merges' is missing or malformed")
    token_types = get("tokenizer.ggml.token_type") or []
    if len(token_types) not in (0, len(tokens)):
      raise TokenizerError("GGUF 'tokenizer.ggml.token_type' does not match the vocabulary size")

    special: dict[str, str | None] = {}
    special_ids: dict[str, int | None] = {}
    names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    for name, key in names.items():
      token_id = special_ids[name] = get(f"tokenizer.ggml.{key}_token_id")
      if token_id is not None and not 0 <= token_id < len(tokens):
        raise TokenizerError(f"GGUF '{key}' token id {token_id} is outside the vocabulary")
      special[name] = None if token_id is None else tokens[token_id]
    # llama.cpp (and transformers) add bos to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = bool(get("tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(get("tokenizer.ggml.add_eos_token"))
    pre = get("tokenizer.ggml.pre")

    def finish(backend: Backend) -> Backend:
      _add_missing_special(backend, special)
      _set_post_processor(backend, special, add_bos, add_eos)
      return backend

    if model == "gpt2":
      backend = finish(_byte_level_backend(tokens, merges, token_types, pre))
    else:
      scores = get("tokenizer.ggml.scores")
      if merges is None and (
        not isinstance(scores, list) or len(scores) != len(tokens) or not all(isinstance(x, float) for x in scores)
      ):
        raise TokenizerError("GGUF 'tokenizer.ggml.scores' is missing or does not match the vocabulary size")
      architecture = get("general.architecture")
      metadata = dict(
        model=model, architecture=architecture, pre=pre, tokens=tokens, scores=scores, token_types=token_types,
        merges=merges, special_ids=special_ids, add_bos=add_bos, add_eos=add_eos,
      )  # fmt: skip
      backend = _cached_backend(
        metadata, lambda: finish(_sentencepiece_backend(tokens, scores, merges, token_types, architecture))
      )
    extra_stops = [get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return cls(backend, special, get("tokenizer.chat_template"), [i for i in extra_stops if i is not None])

  @classmethod
  def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
    """Build from a saved Hugging Face tokenizer directory.

    Reads `tokenizer.json` (vocabulary, pre-tokenizer, post-processor), `tokenizer_config.json`
    (named special tokens, `chat_template`) and `chat_template.jinja`, which wins over the config's
    template. Model-specific tokenizer classes are not emulated: tokenizer.json is taken as is.
    """
    path = os.fspath(path)
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
      raise TokenizerError(f"{path} has no tokenizer.json")
    try:
      backend = Backend.from_file(tokenizer_json)
    except Exception as e:
      raise TokenizerError(f"cannot read {tokenizer_json}: {e}") from e
    config_path = os.path.join(path, "tokenizer_config.json")
    config: dict = {}
    if os.path.isfile(config_path):
      with open(config_path, encoding="utf-8") as f:
        config = json.load(f)

    def content(token: Any) -> str | None:  # config tokens are strings or serialized AddedToken dicts
      return token.get("content") if isinstance(token, dict) else token

    special = {name: content(config.get(name)) for name in _NAMED_SPECIAL}
    _add_missing_special(backend, special)
    # add_bos_token / add_eos_token in the config are ignored: as in transformers v5, tokenizer.json's
    # post-processor alone decides what encode(add_special_tokens=True) adds.

    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
      template = {t["name"]: t["template"] for t in template}.get("default")
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):
      with open(jinja_path, encoding="utf-8") as f:
        template = f.read()
    return cls(backend, special, template)

  # ------------------------------------------------------------------ encode / decode

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids for `text`; special tokens written in the text (e.g. "<|im_start|>") map to their ids."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: int | Sequence[int] | Any, skip_special_tokens: bool = False) -> str:
    """Text for `ids` (a list, a numpy/jax array, or a single id)."""
    if isinstance(ids, int) or getattr(ids, "ndim", 1) == 0:
      ids = [ids]
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self.backend.id_to_token(token_id)

  # ------------------------------------------------------------------ chat

  def apply_chat_template(
    self,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tokenize: bool = True,
    **template_kwargs: Any,
  ) -> list[int] | str:
    """Render `messages` with the model's chat template as transformers does, and tokenize it
    (without adding bos/eos: the template writes what it needs). Extra kwargs reach the template."""
    if not self.chat_template:
      raise TokenizerError("tokenizer has no chat template")
    if not messages:
      raise ValueError("cannot apply a chat template to an empty conversation")
    # HF drops None-valued keys: templates handle a missing key better than a literal "None".
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    rendered = _compile_template(self.chat_template).render(
      messages=messages,
      tools=None,
      documents=None,
      add_generation_prompt=add_generation_prompt,
      **{**self.special_tokens, **template_kwargs},
    )
    return self.encode(rendered, add_special_tokens=False) if tokenize else rendered

  # ------------------------------------------------------------------ identity

  def fingerprint(self) -> str:
    """SHA-256 of the vocabulary (token strings in id order) and the bos/eos/pad ids.

    Equal fingerprints mean ids denote the same strings and the same special tokens, e.g. that a
    draft and a target model can share token ids.
    """
    payload = {
      "tokens": [self.backend.id_to_token(i) for i in range(self.vocab_size)],
      "bos_id": self.bos_id,
      "eos_id": self.eos_id,
      "pad_id": self.pad_id,
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------- helpers


def _byte_level_backend(tokens: list[str], merges: list[str], token_types: list[int], pre: str | None) -> Backend:
  """GPT-2-style byte-level BPE, as transformers builds it for a GGUF (`byte_level_tokenizer`), with the split regex
  `pre` names and the file's control and user-defined tokens added."""
  # Vocabulary tokens are spelled in GPT-2's byte alphabet; respell any that are not (HF does the same).
  alphabet = _bytes_to_unicode()
  spelled = set(alphabet.values())
  vocab = {
    t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
  }
  try:
    bpe = BPE(
      vocab=vocab,
      merges=[tuple(m.split(" ")) for m in merges],
      dropout=None,
      continuing_subword_prefix="",
      end_of_word_suffix="",
      fuse_unk=False,
    )
  except Exception as e:  # the Rust side raises plain Exceptions for unknown merge tokens etc.
    raise TokenizerError(f"GGUF BPE vocabulary/merges are inconsistent: {e}") from e
  backend = Backend(bpe)
  split = _PRE_TOKENIZER_SPLITS.get(pre)
  if split is None:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    backend.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  backend.decoder = decoders.ByteLevel()

  # HF's GPT2Tokenizer registers its default "<|endoftext|>" as special first. When the vocabulary
  # lacks it, HF appends it as a new id past the model's vocabulary; we deliberately do not.
  if "<|endoftext|>" in vocab:
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
  # A control token spelled outside the byte alphabet is a llama.cpp mislabel, so HF (and we) leave it alone.
  _add_gguf_tokens(backend, tokens, token_types, control_ok=lambda t: set(t) <= spelled)
  return backend


def _sentencepiece_backend(
  tokens: list[str],
  scores: list[float] | None,
  merges: list[str] | None,
  token_types: list[int],
  architecture: str | None,
) -> Backend:
  """SentencePiece BPE with byte fallback ("<0x41>" tokens), as transformers builds it for a GGUF whose
  `tokenizer.ggml.model` is "llama" (`sentencepiece_tokenizer`, `gemma_tokenizer`, `phi3_tokenizer`): the
  vocabulary as the file spells it, the file's merges or ones derived from the vocabulary, spaces written as "▁",
  and the file's control and user-defined tokens added.

  The architecture picks the variant transformers picks: Gemma's (spaces replaced by a normalizer, no prefix
  space), Phi-3's (a normalizer that also prepends "▁") or Llama's (a `Metaspace` pre-tokenizer that prepends "▁"
  to the first word only, stripped again on decode). The file's `add_space_prefix` flag is ignored, as
  transformers ignores it.
  """
  gemma = architecture in _GEMMA_ARCHITECTURES
  spelled = tokens
  if gemma:
    # Gemma files spell a token of two or more spaces with real spaces, where the text is looked up with "▁"s.
    spelled = [_SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
  vocab = {t: i for i, t in enumerate(spelled)}
  if merges is not None:
    pairs = [tuple(m.split(" ")) for m in merges]
  elif gemma:  # Gemma's scores do not follow its merge order; the order of its tokens does
    pairs = _derive_merges(vocab, {t: -i for i, t in enumerate(spelled)})
  else:
    pairs = _derive_merges(vocab, dict(zip(spelled, scores or ())))
  try:
    # Gemma's unk token is GemmaTokenizer's default; LlamaTokenizer gives its BPE none (byte fallback covers all).
    bpe = BPE(
      vocab=vocab, merges=pairs, dropout=None, fuse_unk=True, byte_fallback=True, unk_token="<unk>" if gemma else None
    )
  except Exception as e:
    raise TokenizerError(f"GGUF SentencePiece vocabulary/merges are inconsistent: {e}") from e
  backend = Backend(bpe)
  to_text = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
  if gemma:
    backend.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(to_text)
  else:
    if architecture in _PHI3_ARCHITECTURES:
      backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(_SPIECE_SPACE), normalizers.Replace(" ", _SPIECE_SPACE)]
      )
    else:
      backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPIECE_SPACE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([*to_text, decoders.Strip(" ", 1, 0)])

  defaults = [t for t in _DEFAULT_SPECIAL["gemma" if gemma else "llama"] if t in vocab]
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in defaults])
  _add_gguf_tokens(backend, tokens, token_types)
  return backend


def _derive_merges(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
  """The merges a BPE vocabulary implies, best first, as transformers derives them (`generate_merges`).

  Each token of `ranks` contributes every split of it into two vocabulary tokens (in id order of the two halves);
  merges are ordered by the rank of the token they make (higher first), then by the lengths of their halves
  (longer first), ties keeping that order.
  """
  merges = []
  for token, rank in ranks.items():
    local = [(token[:k], token[k:], rank) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
    if len(local) > 1:
      local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.extend(local)
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(left, right) for left, right, _ in merges]


def _add_gguf_tokens(
  backend: Backend, tokens: list[str], token_types: list[int], control_ok: Callable[[str], bool] = lambda t: True
) -> None:
  """Add the file's control tokens as special (kept whole, skipped on decode) and its user-defined tokens (e.g.
  "<think>") as plain added tokens (kept whole), as transformers' `add_gguf_special_tokens` does."""
  control = [t for t, k in zip(tokens, token_types) if k == _CONTROL and control_ok(t)]
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
  # A user-defined token the vocabulary spells otherwise (Gemma's runs of spaces) is left out, as HF leaves it out.
  in_vocab = backend.get_vocab(with_added_tokens=True)
  user = [t for t, k in zip(tokens, token_types) if k == _USER_DEFINED and t in in_vocab]
  backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _cached_backend(metadata: dict[str, Any], build: Callable[[], Backend]) -> Backend:
  """`build()`, saved as a tokenizer.json in `cache_dir()` under a hash of `metadata` (everything the build reads)
  and `_CACHE_FORMAT`, and read back from there by later calls.

  The file is written atomically (a temporary file renamed over it), so a concurrent or killed build never leaves
  a partial one; a file that does not load is rebuilt and replaced; a cache that cannot be written costs the next
  call a rebuild, with a warning.
  """
  payload = json.dumps([_CACHE_FORMAT, metadata], ensure_ascii=False, sort_keys=True)
  path = os.path.join(cache_dir(), f"tokenizer-{hashlib.sha256(payload.encode('utf-8')).hexdigest()[:32]}.json")
  if os.path.exists(path):
    try:
      return Backend.from_file(path)
    except Exception as e:  # truncated or garbled by something other than us: rebuild it
      logging.warning("specjax.tokenizer: rebuilding the cached tokenizer %s, which does not load: %s", path, e)
  backend = build()
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".tmp", dir=os.path.dirname(path))
    try:
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(backend.to_str())
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  except OSError as e:
    logging.warning("specjax.tokenizer: cannot cache the tokenizer in %s: %s", path, e)
  return backend


def _add_missing_special(backend: Backend, special: dict[str, str | None]) -> None:
  """Register named special tokens that are not yet added tokens as special, as HF does on load."""
  added = {t.content for t in backend.get_added_tokens_decoder().values()}
  missing = [t for t in dict.fromkeys(special.values()) if t is not None and t not in added]
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def _set_post_processor(backend: Backend, special: dict[str, str | None], add_bos: bool, add_eos: bool) -> None:
  """Prepend bos / append eos on `encode(add_special_tokens=True)`, like HF's `update_post_processor`."""
  bos, eos = special.get("bos_token"), special.get("eos_token")
  add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
  single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
  pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
  tokens = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
  backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


class _GenerationTag(jinja2.ext.Extension):
  """Accept HF's `{% generation %}...{% endgeneration %}` (assistant-mask marker) and just render its body."""

  tags = {"generation"}

  def parse(self, parser: Any) -> jinja2.nodes.Node:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller: Any) -> str:
    return caller()


def _raise_exception(message: str) -> None:
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
  # HF's tojson: plain json.dumps (Jinja's own escapes HTML characters, which templates do not want).
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
  """Compile a chat template in the same sandboxed environment transformers uses."""
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise TokenizerError(f"chat template does not parse: {e}") from e
