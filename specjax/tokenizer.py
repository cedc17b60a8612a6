"""Text <-> token ids, and chat prompts, for the models specjax runs.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the Rust backend), the model's Jinja chat
template and its special token ids. It is built either from a GGUF file's metadata
(`Tokenizer.from_gguf`) or from a saved Hugging Face tokenizer directory (`Tokenizer.from_hf_dir`).

The GGUF path mirrors what `transformers` does for `AutoTokenizer.from_pretrained(..., gguf_file=...)`
(see `transformers/integrations/gguf/gguf_tokenizer_mapping.py`), so that `encode`, `decode` and
`apply_chat_template` give the same ids and strings as the transformers reference, without
importing transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
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
  """A byte-level BPE tokenizer plus the model's chat template and special token ids.

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

    Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported; SentencePiece ("llama"),
    unigram ("t5") and other vocabularies raise `TokenizerError`.
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
    if model != "gpt2":
      raise TokenizerError(
        f"unsupported GGUF tokenizer model {model!r}: only byte-level BPE ('gpt2') is supported"
      )
    tokens = get("tokenizer.ggml.tokens")
    merges = get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
      raise TokenizerError("GGUF 'tokenizer.ggml.tokens' is missing or not a list of strings")
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
      raise TokenizerError("GGUF 'tokenizer.ggml.merges' is missing or malformed")
    token_types = get("tokenizer.ggml.token_type") or []
    if len(token_types) not in (0, len(tokens)):
      raise TokenizerError("GGUF 'tokenizer.ggml.token_type' does not match the vocabulary size")

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
    split = _PRE_TOKENIZER_SPLITS.get(get("tokenizer.ggml.pre"))
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
    # Control tokens stay whole and count as special (skipped on decode); a control token spelled
    # outside the byte alphabet is a llama.cpp mislabel, so HF (and we) leave it alone.
    control = [t for t, k in zip(tokens, token_types) if k == _CONTROL and set(t) <= spelled]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    # User-defined tokens (e.g. "<think>") are matched whole but are not special.
    in_vocab = backend.get_vocab(with_added_tokens=True)
    user = [t for t, k in zip(tokens, token_types) if k == _USER_DEFINED and t in in_vocab]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    special: dict[str, str | None] = {}
    names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    for name, key in names.items():
      token_id = get(f"tokenizer.ggml.{key}_token_id")
      if token_id is not None and not 0 <= token_id < len(tokens):
        raise TokenizerError(f"GGUF '{key}' token id {token_id} is outside the vocabulary")
      special[name] = None if token_id is None else tokens[token_id]
    _add_missing_special(backend, special)
    add_bos, add_eos = bool(get("tokenizer.ggml.add_bos_token")), bool(get("tokenizer.ggml.add_eos_token"))
    _set_post_processor(backend, special, add_bos, add_eos)
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
