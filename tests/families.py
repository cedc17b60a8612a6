"""Tiny random checkpoints of every model family specjax loads from an HF directory, written offline with
transformers' own config and model classes (`save_pretrained`), and the same families as tiny specjax configs.

Each family's checkpoint turns on what sets it apart from Llama: Llama 3's RoPE scaling, Qwen 2's QKV biases, Qwen
3's QK-norm, Mistral's sliding window, Gemma 2's soft-capping and alternating windows, Gemma 3's four norms, QK-norm,
per-kind RoPE bases and window pattern. Windows are shorter than the tests' sequences so that they bind.
"""

from __future__ import annotations

import jax
import numpy as np

from specjax.config import FAMILIES, ModelConfig
from specjax.loading import Model
from specjax.model import init_params

WINDOW = 12  # the tiny models' sliding window; test sequences run past it
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
# family -> (transformers config class, model class, options beyond _COMMON)
HF_FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                         attn_logit_softcapping=3.0, final_logit_softcapping=4.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
}


def save_tiny_hf(family: str, path: str, seed: int = 0) -> str:
  """A tiny random model of `family` saved with `save_pretrained` at `path` (no tokenizer). Weights are redrawn
  large (norm weights around their identity) so that logits are O(1) and a missed detail moves them far."""
  import torch
  import transformers
  config_class, model_class, options = HF_FAMILIES[family]
  config = getattr(transformers, config_class)(**_COMMON, **options)
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = getattr(transformers, model_class)(config).eval()
  gemma = family.startswith("gemma")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:  # Gemma stores w of the multiplier 1 + w
        p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.3 * torch.randn_like(p))
  model.save_pretrained(path)
  return path


def hf_model(path: str):
  import torch
  from transformers import AutoModelForCausalLM
  return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(model, ids) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def hf_greedy(model, ids, steps: int) -> list[int]:
  """Greedy continuation by transformers, a full forward per token (no cache, no stop token)."""
  ids = list(ids)
  for _ in range(steps):
    ids.append(int(hf_logits(model, ids)[-1].argmax()))
  return ids[-steps:]


# The same families as tiny specjax configs (no transformers): what the fast tier runs every drafter on.
TINY_FAMILIES = {
    "llama": {},
    "qwen2": {"family": "qwen2", **FAMILIES["qwen2"]},
    "qwen3": {"family": "qwen3", **FAMILIES["qwen3"]},
    "mistral": {"family": "mistral", "sliding_window": 6, "layer_kinds": ("sliding",) * 3},
    "gemma2": {"family": "gemma2", **FAMILIES["gemma2"], "sliding_window": 6, "query_pre_attn_scalar": 24.0,
               "attn_softcap": 3.0, "final_softcap": 4.0, "layer_kinds": ("sliding", "full", "sliding")},
    "gemma3": {"family": "gemma3_text", **FAMILIES["gemma3_text"], "sliding_window": 6, "local_rope_theta": 100.0,
               "layer_kinds": ("sliding", "sliding", "full")},
}


def tiny_family_model(family: str, seed: int = 0) -> Model:
  """A tiny random specjax model of `family` (vocabulary 32, three layers, windows of 6)."""
  config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                       head_dim=16, rope_theta=10000.0, **TINY_FAMILIES[family])
  return Model(config, init_params(config, jax.random.PRNGKey(seed), std=0.3), None, f"tiny-{family}")
