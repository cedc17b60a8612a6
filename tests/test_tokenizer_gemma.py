"""specjax.tokenizer on SentencePiece-style BPE GGUFs (`tokenizer.ggml.model == "llama"`: Gemma, Llama 2, Mistral,
Phi-3) against transformers' tokenizer for the same file: Gemma-3-270M's (slow: reading the file and transformers'
build of its tokenizer take seconds) and tiny synthetic ones, and the cache that spares a rebuild of the merges."""

import json
import os
import random

import gguf
import numpy as np
import pytest

from experiments.spec_bench import load_questions
from specjax import tokenizer as tokenizer_module
from specjax.data import sharegpt
from specjax.loading import resolve_path
from specjax.tokenizer import Tokenizer, TokenizerError
from tests.test_tokenizer import model_gguf_writer

SPACE = "\u2581"  # SentencePiece's "▁"

# Gemma 3's special ids: <pad> <eos> <bos> <unk>, <start_of_turn>, <end_of_turn>.
PAD, EOS, BOS, UNK, START_OF_TURN, END_OF_TURN = 0, 1, 2, 3, 105, 106

EDGE_CASES = [
  "", " ", "  ", "   ", "\n", "\n\n\n", "\t", "\t\t x\t", " leading", "trailing ", "  both  ", "a  b   c    d",
  "line\nbreak\r\nwindows\rcr", "x" + " " * 31 + "y", "\n" * 40 + "end", "\t" * 33, " \n \n\t\n  \t ",
  "emoji: 😀🚀👩‍👩‍👧‍👦 🇫🇷 ❤️ 🫠", "日本語のテキストと中文文本，还有한국어.", "rare CJK 𠀀𪚥 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
  "combining e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 \u0e01\u0e34", "Héllo wörld, ça va? Ærøskøbing naïve",
  "zero width \u200b\u200c\u200d, nbsp\u00a0, bom \ufeff, separators a\u2028b\u2029c",
  "control \x00\x01\x07\x08\x0b\x0c\x1b[31m\x7f\x80\x9f", "private use \ue000\U000f0000\U0010fffd",
  "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos><bos>text<eos><eos>",
  "<pad><unk><mask>[multimodal]<unused0><unused6241><start_of_image><end_of_image>",
  "not special: <start_of_turn > < bos> <bos <eos/> [multimodal ]", "<0x41> and <0xFF> written out",
  SPACE + " literal lower one eighth block " + SPACE * 2, "def f(x):\n    return x ** 2  # comment\n",
  "https://example.com/a?b=c&d=e#f", "digits 0 1 12 123 1234 3.14159 -0.5e-10 2024-11-29",
  "MiXeD CaSe it's we'll they're I'M", "rtl עברית العربية", "\\ backslash \" quote ' apostrophe `tick`",
]


def random_strings(n: int, seed: int = 0) -> list[str]:
  """Strings of code points from all over Unicode (controls, rare scripts, private use, astral planes): most are
  not in any vocabulary, so they exercise the byte fallback."""
  rng = random.Random(seed)
  ranges = [(0x0, 0x20), (0x20, 0x7F), (0x7F, 0xA0), (0xA0, 0x2FF), (0x300, 0x36F), (0x370, 0x1FFF),
            (0x2000, 0x2BFF), (0x3000, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xF8FF), (0xF900, 0xFFFD),
            (0x10000, 0x1FAFF), (0x20000, 0x2FFFF), (0xE0000, 0x10FFFF)]
  strings = []
  for _ in range(n):
    chars = []
    for _ in range(rng.randrange(1, 24)):
      lo, hi = rng.choice(ranges)
      chars.append(chr(rng.randrange(lo, hi)) if rng.random() < 0.8 else rng.choice(" \n\t"))
    strings.append("".join(chars))
  return strings


def corpus() -> list[str]:
  """The strings the Gemma tokenizer is compared on: edge cases, random Unicode, every Spec-Bench turn and the
  messages of the first ShareGPT conversations."""
  turns = [turn for question in load_questions() for turn in question.turns]
  conversations, _ = sharegpt.read_conversations(limit=150)
  messages = [m["value"] for c in conversations for m in c["conversations"]]
  return EDGE_CASES + random_strings(100) + turns + messages


# ---------------------------------------------------------------------- Gemma-3-270M


@pytest.fixture(scope="module")
def gemma_path() -> str:
  """Gemma-3-270M's GGUF, as `specjax.load("gemma3-270m")` finds it (a missing package is an error naming its extra)."""
  return resolve_path("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_cache(tmp_path_factory):
  """An empty $SPECJAX_CACHE for the module, so that `ours` is a first build (the merges derived)."""
  with pytest.MonkeyPatch.context() as mp:
    path = tmp_path_factory.mktemp("specjax_cache")
    mp.setenv("SPECJAX_CACHE", str(path))
    yield path


@pytest.fixture(scope="module")
def gemma_reader(gemma_path):
  return gguf.GGUFReader(gemma_path)


@pytest.fixture(scope="module")
def ours(gemma_reader, gemma_cache):
  return Tokenizer.from_gguf(gemma_reader)


@pytest.fixture(scope="module")
def hf(gemma_path):
  """transformers' tokenizer for the same file (seconds: it derives the merges too)."""
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(os.path.dirname(gemma_path), gguf_file=os.path.basename(gemma_path))


@pytest.mark.slow
def test_gemma_special_ids_stop_ids_and_no_template(ours, hf):
  assert ours.vocab_size == len(hf) == 262144
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (BOS, EOS, PAD)
  assert ours.stop_ids == (EOS, END_OF_TURN)
  assert ours.token_to_id("<start_of_turn>") == hf.convert_tokens_to_ids("<start_of_turn>") == START_OF_TURN
  assert ours.token_to_id("<unk>") == UNK and ours.id_to_token(UNK) == "<unk>"
  assert ours.chat_template is None and hf.chat_template is None  # a base model: prompts are plain text
  assert ours.encode("hi")[0] == BOS and ours.encode("hi", add_special_tokens=False)[0] != BOS  # add_bos_token
  assert ours.encode("") == hf.encode("") == [BOS]
  assert ours.id_to_token(138) == SPACE * 2  # the file spells it "  "; HF respells it as the vocabulary looks it up


@pytest.mark.slow
def test_gemma_backend_is_transformers(ours, hf):
  """The whole tokenizer.json (vocabulary, merges, normalizer, added tokens, post-processor, decoder) is HF's."""
  assert json.loads(ours.backend.to_str()) == json.loads(hf.backend_tokenizer.to_str())


@pytest.mark.slow
def test_gemma_encode_decode_matches_transformers(ours, hf):
  texts = corpus()
  assert len(texts) >= 1000
  mismatches = []
  for text in texts:
    ids = hf.encode(text)
    plain = hf.encode(text, add_special_tokens=False)
    got = (ours.encode(text), ours.encode(text, add_special_tokens=False), ours.decode(ids),
           ours.decode(ids, skip_special_tokens=True))
    want = (ids, plain, hf.decode(ids), hf.decode(ids, skip_special_tokens=True))
    if got != want:
      mismatches.append((text[:80], [i for i, (g, w) in enumerate(zip(got, want)) if g != w]))
  assert not mismatches, f"{len(mismatches)} of {len(texts)} strings differ (text, which of encode / encode " \
                         f"without specials / decode / decode skipping specials): {mismatches[:5]}"
  # Byte fallback and no normalization but of spaces: every text comes back, but a "▁" written in it (decoded as " ").
  lost = [t for t in texts if ours.decode(ours.encode(t, add_special_tokens=False)) != t]
  assert lost == [t for t in texts if SPACE in t]


@pytest.mark.slow
def test_gemma_decode_arbitrary_ids_matches_transformers(ours, hf):
  # Byte-fallback ids (238..493) in random order mostly do not form UTF-8; specials, newline / tab runs and the
  # respelled space runs (107..166), and ids from anywhere in the vocabulary are mixed in.
  rng = random.Random(0)
  pools = [range(238, 494), range(0, 200), range(ours.vocab_size), [PAD, EOS, BOS, UNK, START_OF_TURN, END_OF_TURN]]
  for n in [1, 2, 3, 5, 8, 16, 40] * 30:
    ids = [rng.choice(rng.choice(pools)) for _ in range(n)]
    assert ours.decode(ids) == hf.decode(ids), ids
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), ids
  byte = lambda b: 238 + b  # noqa: E731  <0x00> is id 238
  # A run of byte tokens that is not UTF-8 (a truncated "日", a stray 0xFF, "A") decodes to one U+FFFD per byte.
  invalid = [byte(0xE6), byte(0x97), byte(0xFF), byte(0x41)]
  assert ours.decode(invalid) == hf.decode(invalid) == "\ufffd" * 4
  assert ours.decode([byte(0xE6), byte(0x97), byte(0xA5), END_OF_TURN, byte(0x41)]) == "日<end_of_turn>A"
  assert ours.decode(np.asarray([BOS, 9259], dtype=np.int32)) == hf.decode([BOS, 9259])


@pytest.mark.slow
def test_gemma_second_build_reads_the_cache(ours, gemma_reader, gemma_cache, monkeypatch):
  cached = [p for p in os.listdir(gemma_cache) if p.endswith(".json")]
  assert len(cached) == 1 and cached[0].startswith("tokenizer-")

  def no_build(*args, **kwargs):
    raise AssertionError("the tokenizer was rebuilt instead of read from the cache")

  monkeypatch.setattr(tokenizer_module, "_sentencepiece_backend", no_build)
  again = Tokenizer.from_gguf(gemma_reader)
  assert again.backend.to_str() == ours.backend.to_str()
  assert (again.stop_ids, again.fingerprint()) == (ours.stop_ids, ours.fingerprint())
  assert os.listdir(gemma_cache) == cached  # no temporary file left behind


# ---------------------------------------------------------------------- synthetic SentencePiece GGUFs

SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<pad>", 1), ("<mask>", 3), ("<bos>", 1), ("<eos>", 3)]
PIECES = [SPACE, "a", "b", "c", "t", "h", "e", "1", "2", "x", "é", "ab", "bc", SPACE + "t", "he", SPACE + "the",
          SPACE + "a", "12", SPACE + "ab", "<", ">"]
EXTRA = [("<think>", 4), ("\n\n", 4), ("   ", 4), ("<|eot_id|>", 3), ("<end_of_turn>", 3), ("\t", 4)]


def _sentencepiece_gguf(path, arch="llama", scores=True, merges=None, add_bos=None, add_eos=None):
  """A tiny SentencePiece-BPE GGUF: named specials (`<s>` bos, `</s>` eos, `<unk>`; HF's class defaults `<pad>`,
  `<bos>` typed normal), 256 byte-fallback tokens, pieces whose scores disagree with their order ("bc" outranks
  "ab": Gemma ranks merges by order, the others by score), control and user-defined tokens, among them a run of
  spaces that Gemma respells. add_bos/add_eos None leave the flag out."""
  byte_tokens = [(f"<0x{b:02X}>", 6) for b in range(256)]
  tokens = [t for t, _ in SPECIALS + byte_tokens] + PIECES + [t for t, _ in EXTRA]
  types = [k for _, k in SPECIALS + byte_tokens] + [1] * len(PIECES) + [k for _, k in EXTRA]
  writer = model_gguf_writer(path, arch)
  writer.add_tokenizer_model("llama")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  if scores:
    values = [0.0] * (len(SPECIALS) + 256) + [-float(i) for i in range(len(PIECES))] + [0.0] * len(EXTRA)
    values[tokens.index("bc")] = 0.5
    writer.add_token_scores(values if scores is True else values[: scores])
  if merges is not None:
    writer.add_token_merges(merges)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_unk_token_id(0)
  if add_bos is not None:
    writer.add_add_bos_token(add_bos)
  if add_eos is not None:
    writer.add_add_eos_token(add_eos)
  writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


SYNTHETIC_TEXTS = ["abc", " abc", "  the  ", "x<think>\n\n\n   a\t<|eot_id|>", "é日", "<s>12</s>"]
# transformers 5.25's tokens for SYNTHETIC_TEXTS (bos first): Llama's Metaspace prepends "▁" to the first word
# unless it is a space, Phi-3's normalizer to the text, Gemma none; Gemma ranks "ab" before "bc" (file order).
SYNTHETIC_TOKENS = {
  "llama": [
    ["▁a", "bc"], ["▁a", "bc"], ["▁", "▁the", "▁", "▁"],
    ["▁", "x", "<think>", "\n\n", "<0x0A>", "   ", "a", "\t", "<|eot_id|>"], ["▁", "é", "<0xE6>", "<0x97>", "<0xA5>"],
    ["<s>", "12", "</s>"],
  ],
  "gemma3": [
    ["ab", "c"], ["▁ab", "c"], ["▁", "▁the", "▁", "▁"],
    ["x", "<think>", "\n\n", "<0x0A>", "▁", "▁", "▁a", "\t", "<|eot_id|>"], ["é", "<0xE6>", "<0x97>", "<0xA5>"],
    ["<s>", "12", "</s>"],
  ],
  "phi3": [
    ["▁a", "bc"], ["▁", "▁a", "bc"], ["▁", "▁", "▁the", "▁", "▁"],
    ["▁", "x", "<think>", "\n\n", "▁", "<0x0A>", "   ", "▁a", "\t", "<|eot_id|>"],
    ["▁", "é", "<0xE6>", "<0x97>", "<0xA5>"], ["<s>", "▁", "12", "</s>"],
  ],
}  # fmt: skip
# ... and their decoding, skipping special tokens: Llama's decoder strips the first space, prepended or not, and
# Phi-3's normalizer also marks the space of a piece after a user-defined token.
SYNTHETIC_DECODED = {
  "llama": ["abc", "abc", " the  ", "x<think>\n\n\n   a\t", "é日", "12"],
  "gemma3": ["abc", " abc", "  the  ", "x<think>\n\n\n   a\t", "é日", "12"],
  "phi3": ["abc", " abc", "  the  ", "x<think>\n\n \n    a\t", "é日", "12"],
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
  path = tmp_path / "cache"
  monkeypatch.setenv("SPECJAX_CACHE", str(path))
  return path


@pytest.mark.parametrize("arch", sorted(SYNTHETIC_TOKENS))
def test_synthetic_sentencepiece_tokens(tmp_path, cache, arch):
  ours = Tokenizer.from_gguf(gguf.GGUFReader(_sentencepiece_gguf(tmp_path / "sp.gguf", arch)))
  assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.pad_id) == (290, 1, 2, None)
  assert ours.stop_ids == (2, 287, 288)  # </s>, <|eot_id|>, <end_of_turn>
  for text, expected, decoded in zip(SYNTHETIC_TEXTS, SYNTHETIC_TOKENS[arch], SYNTHETIC_DECODED[arch]):
    ids = ours.encode(text)  # no add_bos_token flag: a SentencePiece vocabulary gets bos
    assert [ours.id_to_token(i) for i in ids] == ["<s>", *expected], text
    assert ours.decode(ids, skip_special_tokens=True) == decoded, text
  # Gemma makes transformers' default named tokens special; the others leave "<pad>" a normal token.
  assert (ours.encode("<pad>", add_special_tokens=False) == [3]) == (arch == "gemma3")


def test_synthetic_sentencepiece_flags_and_file_merges(tmp_path, cache):
  path = _sentencepiece_gguf(tmp_path / "sp.gguf", add_bos=False, add_eos=True, merges=["b c", "▁ a"], scores=False)
  ours = Tokenizer.from_gguf(gguf.GGUFReader(path))
  ids = ours.encode("abc")
  assert [ours.id_to_token(i) for i in ids] == ["▁a", "bc", "</s>"]  # the file's merges, no bos, eos
  assert ours.decode(ids, skip_special_tokens=True) == "abc"


@pytest.mark.parametrize(
  "kwargs, match",
  [(dict(scores=False), "tokenizer.ggml.scores"), (dict(scores=10), "tokenizer.ggml.scores"),
   (dict(merges=["a b c"]), "merges"), (dict(merges=["zz a"]), "inconsistent")],
)
def test_synthetic_sentencepiece_errors(tmp_path, cache, kwargs, match):
  with pytest.raises(TokenizerError, match=match):
    Tokenizer.from_gguf(gguf.GGUFReader(_sentencepiece_gguf(tmp_path / "bad.gguf", **kwargs)))


def test_sentencepiece_cache(tmp_path, cache, monkeypatch):
  reader = gguf.GGUFReader(_sentencepiece_gguf(tmp_path / "sp.gguf", "gemma3"))
  first = Tokenizer.from_gguf(reader)
  files = sorted(cache.iterdir())
  assert [f.name[:10] for f in files] == ["tokenizer-"]
  builds = []
  build = tokenizer_module._sentencepiece_backend
  monkeypatch.setattr(tokenizer_module, "_sentencepiece_backend", lambda *a: builds.append(1) or build(*a))

  second = Tokenizer.from_gguf(reader)  # read from the cache
  assert builds == [] and second.backend.to_str() == first.backend.to_str()
  assert second.encode(" abc") == first.encode(" abc")

  files[0].write_text(files[0].read_text()[:1000])  # truncated: rebuilt and rewritten, not an error
  third = Tokenizer.from_gguf(reader)
  assert builds == [1] and third.backend.to_str() == first.backend.to_str()
  assert files[0].read_text() == first.backend.to_str() and sorted(cache.iterdir()) == files
  files[0].write_bytes(b"\xff\x00 not json")
  assert Tokenizer.from_gguf(reader).encode(" abc") == first.encode(" abc") and builds == [1, 1]

  # Other metadata (here the add_eos flag), another cache file.
  other = Tokenizer.from_gguf(gguf.GGUFReader(_sentencepiece_gguf(tmp_path / "eos.gguf", "gemma3", add_eos=True)))
  assert other.encode("abc")[-1] == 2 and len(list(cache.iterdir())) == 2 and len(builds) == 3

  # A cache that cannot be written costs a rebuild each time, not an error.
  blocked = tmp_path / "not_a_directory"
  blocked.write_text("")
  monkeypatch.setenv("SPECJAX_CACHE", str(blocked))
  for expected_builds in (4, 5):
    assert Tokenizer.from_gguf(reader).encode(" abc") == first.encode(" abc") and len(builds) == expected_builds


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3", "mistral"])
@pytest.mark.parametrize("flags", [{}, dict(add_bos=False, add_eos=True, merges=["b c", "▁ a", "a b"])])
def test_synthetic_sentencepiece_matches_transformers(tmp_path, cache, arch, flags):
  from transformers import AutoTokenizer
  path = _sentencepiece_gguf(tmp_path / "sp.gguf", arch, **flags)
  ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
  ours = Tokenizer.from_gguf(gguf.GGUFReader(path))
  assert json.loads(ours.backend.to_str()) == json.loads(ref.backend_tokenizer.to_str())
  assert (ours.vocab_size, ours.bos_id, ours.eos_id) == (len(ref), ref.bos_token_id, ref.eos_token_id)
  texts = SYNTHETIC_TEXTS + EDGE_CASES + random_strings(20)
  for text in texts:
    ids = ref.encode(text)
    assert ours.encode(text) == ids, text
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
  if arch in SYNTHETIC_TOKENS and not flags:  # the pinned tokens of the fast test are transformers'
    assert [ref.convert_ids_to_tokens(ref.encode(t))[1:] for t in SYNTHETIC_TEXTS] == SYNTHETIC_TOKENS[arch]
