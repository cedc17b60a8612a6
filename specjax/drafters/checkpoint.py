"""Trained drafter checkpoints: one safetensors file per drafter, its options and target in the metadata.

A drafter checkpoint holds the drafter's own trainable arrays (flattened as "heads/0/w"-style keys), plus
any integer arrays it needs (a truncated vocabulary's token map), and JSON metadata:

  format    "specjax-drafter/1"
  drafter   the drafter's name ("mtp_parallel", ...)
  options   the options that rebuild its parameter declaration (number of heads, vocabulary size, ...)
  target    the target model it was trained for: name and the shape fields a mismatch would break
  card      free-form training provenance (command, data, steps, seed, wall time, measured figures)

Writes are atomic (a temporary file renamed into place). Loading checks the format, the drafter name,
the target's shape fields and every array's shape against the declaration, so a checkpoint made for another
model or another drafter is a clear `CheckpointError` naming both sides, never a silent misfit.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_dtypes
import numpy as np

from specjax.config import ModelConfig
from specjax.loading import CheckpointError, save_safetensors
from specjax.model import is_spec

FORMAT = "specjax-drafter/1"
TARGET_FIELDS = ("hidden_size", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size")
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def target_signature(config: ModelConfig, name: str | None = None) -> dict:
  """The target fields a drafter checkpoint depends on."""
  return {"name": name, **{f: int(getattr(config, f)) for f in TARGET_FIELDS}}


def flatten(tree: Any) -> dict[str, Any]:
  """{"a/0/b": leaf} for a pytree of dicts and lists."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)
  return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in flat}


def save(path: str, *, drafter: str, params: Any, options: dict, target: dict, card: dict | None = None,
         dtype: str = "bfloat16") -> str:
  """Writes params (floating arrays cast to `dtype`; integer arrays kept) atomically to `path`."""
  tensors = {}
  for key, value in flatten(params).items():
    value = np.asarray(value)
    tensors[key] = value.astype(_DTYPES[dtype]) if np.issubdtype(value.dtype, np.floating) else value
  metadata = {"format": FORMAT, "drafter": drafter, "options": json.dumps(options, sort_keys=True),
              "target": json.dumps(target, sort_keys=True), "card": json.dumps(card or {}, sort_keys=True)}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  return save_safetensors(path, tensors, metadata)


def read_header(path: str) -> dict:
  """The metadata (options, target and card decoded from JSON); CheckpointError when unreadable."""
  from safetensors import safe_open
  if not os.path.isfile(path):
    raise CheckpointError(f"drafter checkpoint {path} does not exist")
  try:
    with safe_open(path, "np") as f:
      metadata = dict(f.metadata() or {})
  except Exception as e:  # safetensors raises assorted errors on damaged headers
    raise CheckpointError(f"{path}: corrupt or truncated drafter checkpoint ({type(e).__name__}: {e})") from e
  if metadata.get("format") != FORMAT:
    raise CheckpointError(f"{path} is not a specjax drafter checkpoint (format {metadata.get('format')!r}, "
                          f"expected {FORMAT!r})")
  try:
    return {"drafter": metadata["drafter"], **{k: json.loads(metadata[k]) for k in ("options", "target", "card")}}
  except (KeyError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: damaged drafter checkpoint metadata ({e})") from e


def check_target(header: dict, config: ModelConfig, model_name: str | None, path: str) -> None:
  """Raises unless the checkpoint was made for a model of this shape."""
  saved = header["target"]
  wanted = target_signature(config, model_name)
  differ = [f for f in TARGET_FIELDS if saved.get(f) != wanted[f]]
  if differ:
    fields = ", ".join(f"{f} {saved.get(f)} vs {wanted[f]}" for f in differ)
    raise CheckpointError(f"{path} was trained for target {saved.get('name')!r}, not {model_name!r}: {fields} "
                          "(checkpoint vs model)")


def load(path: str, *, drafter: str, specs: Any, dtype: str) -> Any:
  """The parameter tree of `specs`' structure read from `path`, floating arrays cast to `dtype`."""
  from safetensors import safe_open
  header = read_header(path)
  if header["drafter"] != drafter:
    raise CheckpointError(f"{path} holds a {header['drafter']!r} drafter, not {drafter!r}")
  flat_specs, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
  leaves = []
  try:
    with safe_open(path, "np") as f:
      keys = set(f.keys())
      wanted = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat_specs]
      if set(wanted) != keys:
        raise CheckpointError(f"{path}: arrays {sorted(keys ^ set(wanted))[:6]} differ from the drafter's "
                              "declaration (another version or options?)")
      for key, (_, spec) in zip(wanted, flat_specs):
        value = f.get_tensor(key)
        if tuple(value.shape) != tuple(spec.shape):
          raise CheckpointError(f"{path}: {key} has shape {tuple(value.shape)}, the drafter declares "
                                f"{tuple(spec.shape)}")
        leaves.append(value.astype(dtype) if np.issubdtype(value.dtype, np.floating)
                      or value.dtype == ml_dtypes.bfloat16 else value)
  except CheckpointError:
    raise
  except Exception as e:  # truncated data sections surface as assorted errors
    raise CheckpointError(f"{path}: corrupt or truncated drafter checkpoint ({type(e).__name__}: {e})") from e
  return jax.tree_util.tree_unflatten(treedef, leaves)
