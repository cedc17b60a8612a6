"""Writing a specjax model as an HF Llama directory: the inverse of `specjax.loading`'s HF loader.

    save_hf(model, "workdirs/smollm2-135m-draft")   # config.json, model.safetensors, tokenizer files

HF's `LlamaForCausalLM.from_pretrained(dir)` and `specjax.load(dir)` both read the result. Weights go back to
torch's [out, in] layout under HF's names; Q/K stay in the rotate-half RoPE layout specjax already uses (the
GGUF loader undid llama.cpp's interleaving on the way in, so nothing is permuted here). The tokenizer is
written as `tokenizer.json` (the `tokenizers` backend as is), `tokenizer_config.json` (named special tokens)
and `chat_template.jinja`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from specjax import ops
from specjax.config import ModelConfig
from specjax.loading import Model, save_safetensors

# The fields a Llama config has; any other field away from its default is a family option this export does not write.
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "rope_theta", "rms_norm_eps", "tie_embeddings", "max_position_embeddings", "rope_scaling",
                 "rope_freq_factors", "dtype")

_DTYPES = {"float32": np.float32, "float16": np.float16}


def hf_config(model: Model, dtype: str = "float32") -> dict:
  """config.json of a `LlamaForCausalLM` with `model`'s shapes (the inverse of `ModelConfig.from_hf`)."""
  c = model.config
  llama = ModelConfig(**{f: getattr(c, f) for f in _SHAPE_FIELDS})
  if c != llama:
    differs = sorted(f.name for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(llama, f.name))
    raise ValueError(f"a {c.family} model ({', '.join(differs)} differ from Llama's) cannot be written as an HF Llama "
                     "directory")
  if c.rope_freq_factors is not None:
    raise ValueError("per-frequency RoPE factors (a GGUF rope_freqs tensor) have no HF config field; "
                     "this model cannot be written as an HF Llama directory")
  config = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
      "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
      "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
      "rope_theta": c.rope_theta, "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
      "tie_word_embeddings": c.tie_embeddings, "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
  }
  tokenizer = model.tokenizer
  if tokenizer is not None:
    config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
  return config


def hf_weights(model: Model, dtype: str = "float32") -> dict[str, np.ndarray]:
  """HF tensor names -> torch-layout arrays (the inverse of `specjax.loading._to_params`)."""
  c, p = model.config, ops.dequantize(model.params)
  d = c.hidden_size

  def array(x):
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(_DTYPES[dtype]))

  weights = {"model.embed_tokens.weight": array(p["embed"]), "model.norm.weight": array(p["final_norm"])}
  for i, layer in enumerate(p["layers"]):
    prefix = f"model.layers.{i}."
    weights.update({
        prefix + "input_layernorm.weight": array(layer["attn_norm"]),
        prefix + "self_attn.q_proj.weight": array(np.asarray(layer["wq"]).reshape(d, -1).T),
        prefix + "self_attn.k_proj.weight": array(np.asarray(layer["wk"]).reshape(d, -1).T),
        prefix + "self_attn.v_proj.weight": array(np.asarray(layer["wv"]).reshape(d, -1).T),
        prefix + "self_attn.o_proj.weight": array(np.asarray(layer["wo"]).reshape(-1, d).T),
        prefix + "post_attention_layernorm.weight": array(layer["mlp_norm"]),
        prefix + "mlp.gate_proj.weight": array(np.asarray(layer["w_gate"]).T),
        prefix + "mlp.up_proj.weight": array(np.asarray(layer["w_up"]).T),
        prefix + "mlp.down_proj.weight": array(np.asarray(layer["w_down"]).T),
    })
  if not c.tie_embeddings:
    weights["lm_head.weight"] = array(np.asarray(p["lm_head"]).T)
  return weights


def save_tokenizer(tokenizer, path: str) -> None:
  """tokenizer.json, tokenizer_config.json and chat_template.jinja, which `Tokenizer.from_hf_dir` and HF read."""
  tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            **tokenizer.special_tokens}
  if tokenizer.chat_template:
    config["chat_template"] = tokenizer.chat_template
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
      f.write(tokenizer.chat_template)
  with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)


def save_hf(model: Model, path: str, dtype: str = "float32") -> str:
  """Writes `model` as an HF Llama directory at `path` (created; existing files of the same names replaced).

  A model without a tokenizer gets no tokenizer files (HF and specjax then load weights only).
  """
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config(model, dtype), f, indent=2)
  save_safetensors(os.path.join(path, "model.safetensors"), hf_weights(model, dtype), {"format": "pt"})
  if model.tokenizer is not None:
    save_tokenizer(model.tokenizer, path)
  return path
