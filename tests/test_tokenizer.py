"""specjax.tokenizer against the Hugging Face transformers reference (GGUF and saved-directory paths), on SmolLM2's
tokenizer and a synthetic GGUF (slow: they need SmolLM2's GGUF or transformers), and its errors."""

import copy
import json
import os
import random
import re

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer as TokenizersBackend
from tokenizers import processors

from specjax.tokenizer import Tokenizer, TokenizerError, _bytes_to_unicode

TEXTS = [
  "",
  "Hello, world!",
  " leading space and trailing space ",
  "Héllo wörld, ça va? Ærøskøbing naïve façade",
  "日本語のテキストと中文文本，还有한국어.",
  "emoji: 😀🚀👩‍👩‍👧‍👦 🇫🇷 ❤️",
  "def f(x):\n    if x:\n\treturn x ** 2  # comment\n    return None\n",
  "tabs\t\tand   runs     of spaces\n\n\n\r\nand newlines\n",
  "digits 0 1 12 123 1234 3.14159 2024-11-29 +44(0)20 7946 0958",
  "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> and <|im_start|><|im_start|>",
  "not special: <|im_start |> <im_start> |im_end|",
  "MiXeD CaSe it's we'll they're I'M",
  "\u200b zero width, \u00a0nbsp, combining e\u0301, rtl עברית العربية",
  "   ",
  "\n",
]

SYSTEM_CONVERSATION = [
  {"role": "system", "content": "You are a terse assistant."},
  {"role": "user", "content": "What is 2+2?"},
]
MULTI_TURN = [
  {"role": "user", "content": "Hi there 👋"},
  {"role": "assistant", "content": "Hello! How can I help?"},
  {"role": "user", "content": "Write `print('x')` in Python.\n  Indented line."},
  {"role": "assistant", "content": "print('x')"},
  {"role": "user", "content": "Thanks."},
]
CONVERSATIONS = {
  "single_user": [{"role": "user", "content": "Tell me a joke."}],
  "system": SYSTEM_CONVERSATION,
  "multi_turn": MULTI_TURN,
}


@pytest.fixture(scope="module")
def reader(smollm2_path):
  return gguf.GGUFReader(smollm2_path)  # parsing the metadata takes seconds: do it once


@pytest.fixture(scope="module")
def ours(reader):
  return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def hf(smollm2_path):
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory):
  path = tmp_path_factory.mktemp("hf_tokenizer")
  hf.save_pretrained(path)
  return path


# ---------------------------------------------------------------------- special ids


@pytest.mark.slow
def test_special_ids(ours, hf):
  assert ours.token_to_id("<|endoftext|>") == 0
  assert ours.token_to_id("<|im_start|>") == 1
  assert ours.token_to_id("<|im_end|>") == 2
  assert (ours.eos_id, ours.bos_id, ours.pad_id) == (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (2, 1, 2)
  assert ours.vocab_size == len(hf) == 49152
  assert ours.stop_ids[0] == ours.eos_id
  assert 2 in ours.stop_ids and 0 in ours.stop_ids  # <|im_end|>, <|endoftext|>
  assert len(set(ours.stop_ids)) == len(ours.stop_ids)


# ---------------------------------------------------------------------- encode / decode


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(ours, hf, text):
  assert ours.encode(text) == hf(text)["input_ids"] == hf.encode(text)
  assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_special_tokens_in_text_are_single_ids(ours):
  assert ours.encode("<|im_start|>user<|im_end|>")[0] == 1
  assert ours.encode("<|im_start|>user<|im_end|>")[-1] == 2
  assert ours.encode("") == []
  assert ours.bos_id not in ours.encode("plain text")  # this GGUF says add_bos_token = false


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_hf_and_round_trips(ours, hf, text):
  ids = hf.encode(text)
  assert ours.decode(ids) == hf.decode(ids) == text
  assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
  assert ours.decode(np.asarray(ids, dtype=np.int32)) == text


@pytest.mark.slow
def test_decode_arbitrary_ids_matches_hf(ours, hf):
  # Random ids include special tokens and split UTF-8 byte sequences (decoded to U+FFFD).
  rng = random.Random(0)
  for n in (1, 2, 7, 64):
    ids = [rng.randrange(ours.vocab_size) for _ in range(n)] + [0, 1, 2]
    rng.shuffle(ids)
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
  assert ours.decode(2) == "<|im_end|>"
  assert ours.decode([1, 2], skip_special_tokens=True) == ""


# ---------------------------------------------------------------------- chat template


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(ours, hf, name, add_generation_prompt):
  messages = CONVERSATIONS[name]
  kw = dict(add_generation_prompt=add_generation_prompt)
  text = ours.apply_chat_template(messages, tokenize=False, **kw)
  assert text == hf.apply_chat_template(messages, tokenize=False, **kw)
  assert ours.apply_chat_template(messages, **kw) == hf.apply_chat_template(messages, return_dict=False, **kw)
  assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.slow
def test_chat_template_default_system_prompt(ours):
  with_default = ours.apply_chat_template(CONVERSATIONS["single_user"], tokenize=False)
  assert with_default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
  explicit = ours.apply_chat_template(SYSTEM_CONVERSATION, tokenize=False)
  assert explicit.startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n")
  assert "SmolLM" not in explicit
  ids = ours.apply_chat_template(SYSTEM_CONVERSATION)
  assert ids[0] == 1 and ids.count(2) == 2  # one <|im_start|> id, an <|im_end|> per message


@pytest.mark.slow
def test_chat_template_drops_none_fields_like_hf(ours, hf):
  messages = [{"role": "user", "content": "hi", "name": None}]
  assert ours.apply_chat_template(messages, tokenize=False) == hf.apply_chat_template(
    messages, tokenize=False, add_generation_prompt=True
  )


# ---------------------------------------------------------------------- from_hf_dir and fingerprint


@pytest.mark.slow
def test_from_hf_dir_matches_gguf_and_hf(ours, hf, hf_dir):
  loaded = Tokenizer.from_hf_dir(hf_dir)
  assert (loaded.eos_id, loaded.bos_id, loaded.pad_id, loaded.vocab_size) == (2, 1, 2, 49152)
  assert loaded.stop_ids == ours.stop_ids
  assert loaded.fingerprint() == ours.fingerprint()
  for text in TEXTS:
    ids = loaded.encode(text)
    assert ids == hf.encode(text)
    assert loaded.decode(ids) == hf.decode(ids)
  for messages in CONVERSATIONS.values():
    assert loaded.apply_chat_template(messages) == ours.apply_chat_template(messages)


@pytest.mark.slow
def test_from_hf_dir_template_in_config_and_bos_post_processor(hf, hf_dir, tmp_path):
  from transformers import AutoTokenizer
  # Template moved into tokenizer_config.json; bos added by tokenizer.json's post-processor. The config's
  # add_bos_token=False is ignored when tokenizer.json exists (transformers v5), by HF and by us.
  backend = TokenizersBackend.from_file(str(hf_dir / "tokenizer.json"))
  bos_first = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
  backend.post_processor = bos_first
  backend.save(str(tmp_path / "tokenizer.json"))
  config = json.loads((hf_dir / "tokenizer_config.json").read_text())
  config.update(chat_template=hf.chat_template, add_bos_token=False)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

  ref = AutoTokenizer.from_pretrained(tmp_path)
  loaded = Tokenizer.from_hf_dir(tmp_path)
  for text in ("hello", "", "<|im_start|>x"):
    assert loaded.encode(text) == ref.encode(text)
    assert loaded.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
  assert loaded.encode("hello")[0] == 1 and loaded.encode("hello", add_special_tokens=False)[0] != 1
  messages = CONVERSATIONS["multi_turn"]
  expected = ref.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
  assert loaded.apply_chat_template(messages) == expected
  assert expected.count(1) == len(messages) + 2  # default system turn + generation prompt; no extra bos


@pytest.mark.slow
def test_fingerprint(ours, reader, tmp_path):
  fp = ours.fingerprint()
  assert re.fullmatch(r"[0-9a-f]{64}", fp)  # a SHA-256 hex digest
  assert Tokenizer.from_gguf(reader).fingerprint() == fp  # stable across builds
  other_eos = copy.copy(ours)
  other_eos.eos_id = 0
  assert other_eos.fingerprint() != fp  # the special ids count, not only the vocabulary
  other = Tokenizer.from_gguf(gguf.GGUFReader(_synthetic_gguf(tmp_path / "s.gguf")))
  assert other.fingerprint() != fp


# ---------------------------------------------------------------------- synthetic GGUFs


def model_gguf_writer(path, arch: str):
  """A `gguf.GGUFWriter` at path with a tiny model's metadata written, for a tokenizer's to follow."""
  import gguf
  writer = gguf.GGUFWriter(str(path), arch)
  for add, value in [
    (writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 8),
    (writer.add_feed_forward_length, 16), (writer.add_head_count, 2), (writer.add_head_count_kv, 2),
    (writer.add_layer_norm_rms_eps, 1e-5),
  ]:  # fmt: skip
    add(value)
  return writer


def _synthetic_gguf(path, model="gpt2", tokens=True, merges=None, pre="llama-bpe", template=None):
  """A tiny byte-level GGUF exercising the converter's branches: control / user-defined tokens,
  a control token spelled outside the byte alphabet, add_bos/add_eos, a known `pre` regex."""
  alphabet = _bytes_to_unicode()
  vocab = [alphabet[b] for b in range(256)] + ["Ġt", "he", "Ġthe", "Ġa", "12"]
  specials = ["<|endoftext|>", "<s>", "</s>", "<think>", "<|eot_id|>", "raw tok"]
  types = [1] * len(vocab) + [1, 1, 3, 4, 3, 3]  # <|endoftext|> and <s> normal: HF still makes them special
  writer = model_gguf_writer(path, "llama")
  writer.add_tokenizer_model(model)
  writer.add_tokenizer_pre(pre)
  if tokens:
    writer.add_token_list(vocab + specials)
    writer.add_token_types(types)
  writer.add_token_merges(merges if merges is not None else ["Ġ t", "h e", "Ġt he", "Ġ a", "1 2"])
  first = len(vocab)
  writer.add_bos_token_id(first + 1)
  writer.add_eos_token_id(first + 2)
  writer.add_add_bos_token(True)
  writer.add_add_eos_token(True)
  if template is not None:
    writer.add_chat_template(template)
  writer.add_tensor("token_embd.weight", np.zeros((len(vocab) + len(specials), 8), dtype=np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


SYNTHETIC_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}{{ m.role }}: "
  "{% generation %}{{ m.content | tojson }}{% endgeneration %}\n{% endfor %}"
)
SYNTHETIC_TEXTS = ["the a 12 <s> x</s><think>hi raw tok <|eot_id|> <|endoftext|>", "", " the\n\n  12345 ünï"]
SYNTHETIC_MESSAGES = [{"role": "user", "content": 'say "hi" <b>'}]


def test_synthetic_gguf_specials_stop_ids_and_chat_template(tmp_path):
  ours = Tokenizer.from_gguf(gguf.GGUFReader(_synthetic_gguf(tmp_path / "syn.gguf", template=SYNTHETIC_TEMPLATE)))
  assert ours.vocab_size == 267 and (ours.bos_id, ours.eos_id) == (262, 263)
  assert ours.stop_ids == (263, 261, 265)  # eos, <|endoftext|>, <|eot_id|>
  for text in SYNTHETIC_TEXTS:
    ids = ours.encode(text)
    assert ids[0] == 262 and ids[-1] == 263
    assert ours.decode(ids, skip_special_tokens=True) == ours.decode(ids[1:-1], skip_special_tokens=True)
  rendered = ours.apply_chat_template(SYNTHETIC_MESSAGES, tokenize=False)
  assert rendered == '<s>user: "say \\"hi\\" <b>"'  # tojson keeps <b> unescaped; trim_blocks eats the \n


@pytest.mark.slow
def test_synthetic_gguf_matches_hf(tmp_path):
  from transformers import AutoTokenizer
  path = _synthetic_gguf(tmp_path / "syn.gguf", template=SYNTHETIC_TEMPLATE)
  ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="syn.gguf")
  ours = Tokenizer.from_gguf(gguf.GGUFReader(path))
  assert ours.vocab_size == len(ref) == 267
  assert (ours.bos_id, ours.eos_id) == (ref.bos_token_id, ref.eos_token_id) == (262, 263)
  for text in SYNTHETIC_TEXTS:
    ids = ref.encode(text)
    assert ours.encode(text) == ids
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
  rendered = ours.apply_chat_template(SYNTHETIC_MESSAGES, tokenize=False)
  assert rendered == ref.apply_chat_template(SYNTHETIC_MESSAGES, tokenize=False, add_generation_prompt=True)
  assert ours.apply_chat_template(SYNTHETIC_MESSAGES) == ref.apply_chat_template(
    SYNTHETIC_MESSAGES, add_generation_prompt=True, return_dict=False
  )


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(model="t5"), "unsupported GGUF tokenizer model 't5'"),
    (dict(tokens=False), "tokenizer.ggml.tokens"),
    (dict(merges=["x y z w"]), "merges"),
    (dict(merges=["Ġ t", "nosuchtoken q"]), "merges"),
  ],
)
def test_bad_gguf_raises(tmp_path, kwargs, match):
  path = _synthetic_gguf(tmp_path / "bad.gguf", **kwargs)
  with pytest.raises(TokenizerError, match=match):
    Tokenizer.from_gguf(gguf.GGUFReader(path))


def test_gguf_without_tokenizer_raises(tmp_path):
  path = str(tmp_path / "empty.gguf")
  writer = gguf.GGUFWriter(path, "llama")
  writer.add_tensor("x", np.zeros(4, dtype=np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(TokenizerError, match="no tokenizer"):
    Tokenizer.from_gguf(gguf.GGUFReader(path))


def test_missing_hf_dir_and_template_raise(tmp_path):
  with pytest.raises(TokenizerError, match="tokenizer.json"):
    Tokenizer.from_hf_dir(tmp_path)
  no_template = Tokenizer.from_gguf(gguf.GGUFReader(_synthetic_gguf(tmp_path / "t.gguf")))
  assert no_template.chat_template is None
  with pytest.raises(TokenizerError, match="no chat template"):
    no_template.apply_chat_template([{"role": "user", "content": "hi"}])
