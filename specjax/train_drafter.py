"""Training a drafter by self-distillation on cached target features, the target frozen.

    drafter = specjax.make_drafter("mtp_parallel", model, path=None, token_map=...)   # fresh parameters
    result = train_drafter(model, drafter, FeatureCache.open(train_dir), FeatureCache.open(held_out_dir),
                           workdir="workdirs/mtp", steps=2000, batch_size=8, learning_rate=1e-3)
    result.drafter  # the trained drafter, ready for specjax.generate

Only the drafter's own trainable arrays get gradients and optimizer state (`draft_head.is_trainable`); the
target's parameters enter the loss as frozen inputs. Batches are a pure function of the step (a seeded draw
of sequences), so a killed run restarted with the same arguments resumes from its last orbax checkpoint and
ends with the same parameters. Every `log_every` steps a line goes to `<workdir>/metrics.jsonl`; every
`eval_every` steps the held-out loss and per-depth top-1 agreement with the target's greedy token are added.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from specjax import sharding, train
from specjax.drafters import Drafter, draft_head


@dataclasses.dataclass
class TrainResult:
  drafter: Drafter  # with the trained parameters
  final_eval: dict[str, float]  # held-out metrics after the last step
  train_seconds: float  # wall time of the steps run, over every resumed segment
  steps: int


def feature_index(cache_layers, drafter: Drafter) -> list[int]:
  """Positions of the drafter's feature layers in a cache's `feature_layers` (an error if one is missing)."""
  cache_layers = [int(i) for i in cache_layers]
  wanted = drafter.feature_layers or (None,)
  missing = [i for i in wanted if i not in cache_layers]
  if missing:
    raise ValueError(f"drafter {drafter.name!r} reads target layers {list(wanted)}, but the feature cache holds "
                     f"{cache_layers}: rebuild the cache with those layers")
  return [cache_layers.index(i) for i in wanted]


def default_feature_layers(drafter: Drafter, num_layers: int) -> Drafter:
  """Drafters that read only the last hidden state declare no feature layers; training gives them L-1."""
  if drafter.feature_layers:
    return drafter
  return dataclasses.replace(drafter, feature_layers=(num_layers - 1,))


def check_cache(cache, model) -> None:
  meta = cache.meta
  for field in ("vocab_size", "hidden_size", "num_layers"):
    if meta.get(field) != getattr(model.config, field):
      raise ValueError(f"feature cache {cache.path} was built for a model with {field}={meta.get(field)}, "
                       f"the target has {getattr(model.config, field)}")


def batch_indices(num_sequences: int, batch_size: int, seed: int, step: int) -> np.ndarray:
  """The sequences of one step: a seeded draw without replacement (a pure function of seed and step)."""
  rng = np.random.default_rng([seed, step])
  return np.sort(rng.choice(num_sequences, size=min(batch_size, num_sequences), replace=False))


def _batch(cache, indices, layers) -> dict[str, np.ndarray]:
  b = cache.batch(indices)
  return {"tokens": b["tokens"], "mask": b["mask"], "features": b["features"][:, :, layers],
          "teacher_ids": b["teacher_ids"], "teacher_probs": b["teacher_probs"]}


def training_split(drafter: Drafter, target_params, drafter_params):
  """(trainable, frozen, loss_fn): the drafter's trainable arrays (`draft_head.is_trainable`), everything the loss
  reads but does not train ({"target": target_params, "drafter": the drafter's fixed arrays}), and
  loss_fn(trainable, frozen, batch) -> (loss, metrics) for `train.make_train_step(..., has_aux=True)`."""
  trainable, fixed = train.split_params(drafter_params, lambda path, leaf: draft_head.is_trainable(path))
  options = drafter.options

  def loss_fn(trainable_params, frozen_params, batch):
    params = train.merge_params(trainable_params, frozen_params["drafter"])
    return drafter.loss(frozen_params["target"], params, options, batch)

  return trainable, {"target": target_params, "drafter": fixed}, loss_fn


def train_drafter(model, drafter: Drafter, train_cache, held_out_cache, *, workdir: str, steps: int,
                  batch_size: int = 8, learning_rate: float = 1e-3, warmup_steps: int = 100,
                  weight_decay: float = 0.0, clip_norm: float = 1.0, seed: int = 0, log_every: int = 10,
                  eval_every: int = 200, eval_sequences: int = 64, save_every: int = 100, mesh=None,
                  progress: bool = True) -> TrainResult:
  """Trains `drafter`'s trainable arrays (see the module doc); returns the trained drafter and its metrics."""
  if drafter.loss is None:
    raise ValueError(f"drafter {drafter.name!r} has no loss: it is not trainable")
  check_cache(train_cache, model)
  check_cache(held_out_cache, model)
  full = default_feature_layers(drafter, model.config.num_layers)
  layers = feature_index(train_cache.meta["feature_layers"], full)
  feature_index(held_out_cache.meta["feature_layers"], full)
  os.makedirs(workdir, exist_ok=True)

  target_params = model.params
  drafter_params = drafter.params
  if mesh is not None:
    target_params = sharding.shard_params(target_params, model.config, mesh)
    drafter_params = sharding.shard_tree(drafter_params, drafter.param_specs, mesh)
  trainable, frozen, loss_fn = training_split(drafter, target_params, drafter_params)
  fixed = frozen["drafter"]
  optimizer = train.make_optimizer(learning_rate, min(warmup_steps, steps - 1), steps, weight_decay=weight_decay,
                                   clip_norm=clip_norm)
  state = train.init_train_state(trainable, optimizer, mesh=mesh)
  if mesh is None:
    step_fn = train.make_train_step(loss_fn, optimizer, has_aux=True)
  else:
    step_fn = train.make_train_step(loss_fn, optimizer, mesh, has_aux=True, state_sharding=sharding.sharding_of(state),
                                    frozen_sharding=sharding.sharding_of(frozen))
  eval_loss = jax.jit(loss_fn)
  held_out = np.arange(min(eval_sequences, len(held_out_cache)))
  eval_batches = [held_out[i:i + batch_size] for i in range(0, len(held_out), batch_size)]

  def evaluate(trainable_params) -> dict[str, float]:
    sums: dict[str, float] = {}
    for indices in eval_batches:
      loss, metrics = eval_loss(trainable_params, frozen, _batch(held_out_cache, indices, layers))
      for key, value in {"loss": loss, **metrics}.items():
        sums[key] = sums.get(key, 0.0) + float(value) * len(indices)
    return {f"eval_{k}": v / len(held_out) for k, v in sums.items()}

  metrics_path = os.path.join(workdir, "metrics.jsonl")
  clock_path = os.path.join(workdir, "train_seconds.json")
  clock = {"seconds": 0.0}
  if os.path.exists(clock_path):
    with open(clock_path) as f:
      clock = json.load(f)
  segment_start, segment_base = time.perf_counter(), clock["seconds"]

  def log(record: dict[str, Any]):
    with open(metrics_path, "a") as f:
      f.write(json.dumps(record) + "\n")
    clock["seconds"] = segment_base + time.perf_counter() - segment_start
    tmp = clock_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(clock, f)
    os.replace(tmp, clock_path)

  def on_step(step: int, state: train.TrainState, metrics: dict):
    if step % log_every and step % eval_every and step != steps:
      return
    record = {"step": step, **{k: float(v) for k, v in metrics.items()},
              "seconds": segment_base + time.perf_counter() - segment_start}
    if step % eval_every == 0 or step == steps:
      record.update(evaluate(state.params))
      logging.info("step %d: %s", step, {k: round(v, 4) for k, v in record.items() if k.startswith("eval_")})
    log(record)

  def batch_fn(step: int):
    return _batch(train_cache, batch_indices(len(train_cache), batch_size, seed, step), layers)

  state, _ = train.train(state, frozen, step_fn, batch_fn, num_steps=steps,
                         checkpoint_dir=os.path.join(workdir, "checkpoints"), save_interval_steps=save_every,
                         log_every=log_every, progress=progress, on_step=on_step)
  final = evaluate(state.params)
  params = jax.device_get(train.merge_params(state.params, fixed))
  trained = dataclasses.replace(drafter, params=jax.tree.map(jnp.asarray, params))
  return TrainResult(drafter=trained, final_eval=final, train_seconds=clock["seconds"], steps=int(state.step))
