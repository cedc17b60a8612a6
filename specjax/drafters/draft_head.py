"""What trained drafters share: the (optionally truncated) output head, the distillation loss, checkpoints.

Truncated draft vocabulary (FR-Spec, Zhao et al. 2025; EAGLE-3's draft vocabulary): a drafter may score only
the V' tokens of `token_map` (the most frequent greedy tokens of the target over the training data). Its
logits are `RMSNorm(h) @ W[:, token_map]` with the target's final norm and (frozen, shared) LM head W, and
verification still runs over the full vocabulary: the draft distribution q is zero outside the map, so
speculative sampling stays exact (a token the draft cannot propose is still produced by the residual
norm(max(0, p - q))). The columns W[:, token_map] are copied once when the drafter is built (`head`), so a
draft step reads V' x D weights, not the full V x D.

Training is self-distillation: the loss at a position is the cross-entropy between the drafter's
distribution and the target's next-token distribution there, given as its top-K tokens
(`specjax.data.features`), renormalised over the tokens the draft vocabulary can express.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax import ops
from specjax.config import ModelConfig
from specjax.drafters import checkpoint
from specjax.loading import CheckpointError, EMBEDDED_MODELS
from specjax.model import ParamSpec, output_projection, rms_norm, softcap_logits


# EAGLE's fusion of a token with the feature before it, W [RMSNorm(emb); RMSNorm(h)]: the sequential module's input
# and the block drafter's anchor. Its arrays, with a leading axis of `stack` copies where a drafter stacks them.
FUSION = ("fc", "emb_norm", "hidden_norm")


def fusion_specs(d: int, stack: int | None = None) -> dict:
  lead, axes = ((), ()) if stack is None else ((stack,), ("stack",))
  return {"fc": ParamSpec(lead + (2 * d, d), axes + ("embed", "embed")),
          "emb_norm": ParamSpec(lead + (d,), axes + ("norm",)), "hidden_norm": ParamSpec(lead + (d,), axes + ("norm",))}


def fuse(params, token_emb: jax.Array, hidden: jax.Array, config: ModelConfig) -> jax.Array:
  """W [RMSNorm(emb); RMSNorm(h)] [..., D] of token embeddings and features [..., D]."""
  eps = config.rms_norm_eps
  both = jnp.concatenate([rms_norm(token_emb, params["emb_norm"], eps), rms_norm(hidden, params["hidden_norm"], eps)],
                         -1)
  return ops.matmul(both, params["fc"])


def fresh_fusion(d: int, dtype, seed: int, stack: int | None = None) -> dict:
  """W starts as [small random; identity] (the fusion first passes the feature on), its norms at one."""
  lead = () if stack is None else (stack,)
  fc = jnp.concatenate([0.02 * jax.random.normal(jax.random.PRNGKey(seed), lead + (d, d)),
                        jnp.broadcast_to(jnp.eye(d), lead + (d, d))], axis=-2)
  return {"fc": fc.astype(dtype), "emb_norm": jnp.ones(lead + (d,), dtype), "hidden_norm": jnp.ones(lead + (d,), dtype)}


def head_specs(config: ModelConfig, draft_vocab: int | None) -> dict:
  """The token map and copied head columns of a truncated vocabulary (nothing for the full one)."""
  if draft_vocab is None:
    return {}
  return {"token_map": ParamSpec((draft_vocab,), ("vocab",)),
          "head": ParamSpec((config.hidden_size, draft_vocab), ("embed", "vocab"))}


def head_columns(target_params, config: ModelConfig, token_map) -> jax.Array:
  """W[:, token_map] [D, V'] of the target's output projection."""
  token_map = jnp.asarray(token_map, jnp.int32)
  if config.tie_embeddings:
    return ops.take(target_params["embed"], token_map, axis=0).T
  return ops.take(target_params["lm_head"], token_map, axis=1)


def logits(target_params, params, hidden: jax.Array, config: ModelConfig) -> jax.Array:
  """float32 draft logits [..., V'] (or [..., V]) of hidden states [..., D] (before the final norm)."""
  h = rms_norm(hidden, target_params["final_norm"], config.rms_norm_eps)
  if "head" in params:  # [D, V'], or packed for decoding (specjax.decoding.decode_draft_params)
    return softcap_logits(ops.matmul(h, params["head"], preferred_element_type=jnp.float32), config)
  return output_projection(target_params, h, config)


def token_ids(params, draft_index: jax.Array) -> jax.Array:
  """Token ids of draft-vocabulary indices (the identity for the full vocabulary)."""
  return params["token_map"][draft_index] if "token_map" in params else draft_index.astype(jnp.int32)


def distill_loss(draft_logits: jax.Array, teacher_ids: jax.Array, teacher_probs: jax.Array, valid: jax.Array,
                 params, vocab_size: int):
  """(mean loss, top-1 agreement) over valid positions: the soft cross-entropy against the target's top-K
  distribution renormalised over the tokens the draft vocabulary holds (KL up to a constant; HASS's harmonized top-K
  distillation).

  draft_logits [..., V']; teacher_ids/probs [..., K] (the target's top-K next-token distribution);
  valid [...]. Top-1 agreement: the draft's argmax token equals the target's greedy token (teacher_ids[..., 0]).
  Measured against two other losses at equal positions (results/train_budget, its options table): the acceptance
  bound itself (-log sum_k min(p_k, q_k), LK losses) and the greedy token alone (hard labels); neither raised Spec-Bench
  tokens per target forward, and both were removed.
  """
  log_q = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
  if "token_map" in params:
    token_map = params["token_map"]
    index_of = jnp.full((vocab_size,), -1, jnp.int32).at[token_map].set(jnp.arange(token_map.shape[0]))
    index = index_of[teacher_ids]
  else:
    index = teacher_ids
  reachable = index >= 0
  log_q_teacher = jnp.take_along_axis(log_q, jnp.maximum(index, 0), axis=-1)  # [..., K]
  p = jnp.where(reachable, teacher_probs.astype(jnp.float32), 0.0)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-9)
  per_position = -jnp.sum(p * log_q_teacher, axis=-1)
  valid = valid & jnp.any(reachable, axis=-1)
  weight = valid.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(weight), 1.0)
  top1 = token_ids(params, jnp.argmax(draft_logits, axis=-1)) == teacher_ids[..., 0]
  return jnp.sum(per_position * weight) / count, jnp.sum(top1 * weight) / count


def shifted(x: jax.Array, k: int, fill=0) -> jax.Array:
  """x[:, t + k] at position t along axis 1 (`fill` past the end)."""
  if k == 0:
    return x
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, k)
  return jnp.pad(x[:, k:], pad, constant_values=fill)


def shifted_back(x: jax.Array, k: int) -> jax.Array:
  """x[:, t - k] at position t along axis 1 (zeros before the start)."""
  if k == 0:
    return x
  pad = [(0, 0)] * x.ndim
  pad[1] = (k, 0)
  return jnp.pad(x[:, :-k], pad)


# ----------------------------------------------------------------------------------------- checkpoints


def canonical_model_name(model) -> str | None:
  """The embedded name of `model` (a Model or a name: "smollm2-135m"), or None for models loaded from a path."""
  name = str(model if isinstance(model, str) else getattr(model, "name", "")).lower()
  if name in EMBEDDED_MODELS:
    package_file = EMBEDDED_MODELS[name]
    return min(k for k, v in EMBEDDED_MODELS.items() if v == package_file)
  return None


def shipped_checkpoint(model, drafter: str, hint: str = "pass path=<checkpoint.safetensors>, or path=None for "
                       "freshly initialised parameters to train") -> str:
  """Path of the checkpoint shipped inside specjax for this model (a Model or its name) and drafter;
  CheckpointError (ending with `hint`, what to do instead) if none."""
  root = pathlib.Path(str(importlib.resources.files("specjax"))) / "checkpoints"
  name = canonical_model_name(model)
  path = root / str(name) / f"{drafter}.safetensors"
  if name is None or not path.is_file():
    shipped = sorted(str(p.relative_to(root)) for p in root.glob("*/*.safetensors"))
    raise CheckpointError(f"no shipped {drafter!r} checkpoint for model {getattr(model, 'name', model)!r} "
                          f"(shipped: {shipped or 'none'}); {hint}")
  return str(path)


FIXED = ("token_map", "head")  # arrays a drafter carries but training never changes ("head" is derived)


def is_trainable(path: str) -> bool:
  """Training updates every array of a drafter but its token map and copied head columns."""
  return path.split("/")[0] not in FIXED


def save(drafter, path: str, model, card: dict | None = None, dtype: str = "bfloat16") -> str:
  """Writes a trained drafter's checkpoint (everything but the derived head columns)."""
  params = {k: v for k, v in drafter.params.items() if k != "head"}
  return checkpoint.save(path, drafter=drafter.name, params=params, options=drafter.options.saved(),
                         target=checkpoint.target_signature(model.config, canonical_model_name(model) or model.name),
                         card=card, dtype=dtype)


def load(model, name: str, path: str, saved_specs_of, options_from, **shipped_hint) -> tuple:
  """(options, params) from a checkpoint at `path` ("default": the shipped one), checked against `model`.

  saved_specs_of(options) declares the saved arrays; options_from(saved_options_dict) rebuilds the options.
  """
  path = shipped_checkpoint(model, name, **shipped_hint) if path == "default" else str(path)
  header = checkpoint.read_header(path)
  if header["drafter"] != name:
    raise CheckpointError(f"{path} holds a {header['drafter']!r} drafter, not {name!r}")
  checkpoint.check_target(header, model.config, canonical_model_name(model) or getattr(model, "name", None), path)
  try:
    options = options_from(header["options"])
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"{path}: options {header['options']} do not describe a {name!r} drafter ({e})") from e
  params = checkpoint.load(path, drafter=name, specs=saved_specs_of(options), dtype=model.config.dtype)
  return options, jax.tree.map(jnp.asarray, params)


def as_token_map(token_map, vocab_size: int) -> np.ndarray:
  """Validates a token map: distinct ids in [0, vocab_size)."""
  token_map = np.asarray(token_map, np.int32).reshape(-1)
  if token_map.size == 0 or token_map.min() < 0 or token_map.max() >= vocab_size:
    raise ValueError(f"token_map must hold ids in [0, {vocab_size}), got {token_map.size} ids")
  if np.unique(token_map).size != token_map.size:
    raise ValueError("token_map has repeated ids")
  return token_map


# ----------------------------------------------------------------------------------- measured rank accuracy


def ranks_path(checkpoint_path: str) -> str:
  """Where a checkpoint's measured rank accuracy lives: beside it, <name>.ranks.json."""
  return os.path.splitext(checkpoint_path)[0] + ".ranks.json"


def save_rank_accuracy(checkpoint_path: str, accuracy, source: str) -> str:
  """Writes `accuracy` [K, R] beside the checkpoint (`ranks_path`), with the data it was measured on."""
  path = ranks_path(checkpoint_path)
  with open(path + ".tmp", "w") as f:
    json.dump({"rank_accuracy": np.asarray(accuracy, np.float64).round(6).tolist(), "measured_on": source}, f,
              indent=1)
  os.replace(path + ".tmp", path)  # atomic: a killed write leaves the old file
  return path


def stored_rank_accuracy(model, name: str, path: str | None, rank_accuracy, depth: int):
  """A drafter's per-(depth, rank) accuracy as a tuple of tuples: `rank_accuracy` as given, else what was measured
  beside its checkpoint (`ranks_path`; `path` "default": the shipped one), else None (trees grown). `depth`: the
  distributions a round drafts (parallel heads, block slots), one row of ranks each."""
  if rank_accuracy is None and path is not None:
    stored = ranks_path(shipped_checkpoint(model, name) if path == "default" else str(path))
    if os.path.exists(stored):
      with open(stored) as f:
        rank_accuracy = json.load(f)["rank_accuracy"]
  if rank_accuracy is None:
    return None
  rank_accuracy = tuple(tuple(float(a) for a in row) for row in rank_accuracy)
  if len(rank_accuracy) != depth or len({len(row) for row in rank_accuracy}) != 1:
    raise ValueError(f"rank_accuracy holds a row of ranks per draft depth ({depth}), got "
                     f"{[len(row) for row in rank_accuracy]}")
  return rank_accuracy
