"""Training a drafter by self-distillation on cached target features, the target frozen.

    drafter = specjax.make_drafter("mtp_parallel", model, path=None, token_map=...)   # fresh parameters
    result = train_drafter(model, drafter, FeatureCache.open(train_dir), FeatureCache.open(held_out_dir),
                           workdir="workdirs/mtp", steps=2000, batch_size=8, learning_rate=1e-3)
    result.drafter  # the trained drafter, ready for specjax.generate

Only the drafter's own trainable arrays get gradients and optimizer state (`draft_head.is_trainable`); the
target's parameters enter the loss as frozen inputs. Batches are a pure function of the step (a seeded draw
of sequences), so a killed run restarted with the same arguments resumes from its last orbax checkpoint and
ends with the same parameters.

What a run has seen is counted in answer positions (the masked positions of its batches, the positions the loss
reads), so that drafters with different batch shapes or steps can be trained on one budget:
`steps_for_positions` gives the steps that consume a number of positions, `steps_at_fractions` the steps where
fractions of them are reached (log-spaced evaluation points). Every `log_every` steps a line goes to
`<workdir>/metrics.jsonl` with the positions seen, the training FLOPs and the training wall and CPU seconds so
far (evaluation and compilation apart); at every evaluation step the held-out loss and per-depth top-1 agreement with the target's
greedy token are added, with whatever `evaluate_drafter` measures (e.g. Spec-Bench acceptance) and the seconds the
evaluation took. A resumed run keeps the lines up to its checkpoint and drops the later ones, which it replays;
evaluation steps are always checkpointed, so an evaluation is done again only if the run is killed while it saves.
The training step is compiled ahead of time, and XLA's count of its floating-point operations
(`cost_analysis`) over the positions it consumes gives FLOPs per training position.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Collection

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
  train_seconds: float  # wall time of the steps run, over every resumed segment (evaluation apart)
  steps: int
  train_cpu_seconds: float = 0.0  # the process's CPU time over the same steps (every thread)
  positions: int = 0  # answer positions seen (masked positions of the batches)
  flops_per_step: float = 0.0  # XLA's count for one compiled training step
  compile_seconds: float = 0.0  # compiling the training step, in the last segment
  history: list = dataclasses.field(default_factory=list)  # the metrics.jsonl records of the run

  @property
  def flops_per_position(self) -> float:
    return self.flops_per_step * self.steps / self.positions if self.positions else float("nan")


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


def answer_positions(cache) -> np.ndarray:
  """Answer positions (mask) per sequence of a feature cache."""
  return np.asarray(cache.mask).sum(axis=1).astype(np.int64)


def pool_sequences(cache, pool_positions: int) -> int:
  """How many leading sequences of `cache` hold `pool_positions` answer positions (all of them for 0): two caches
  cut this way offer training the same number of positions."""
  if not pool_positions:
    return len(cache)
  held = np.cumsum(answer_positions(cache))
  if held[-1] < pool_positions:
    raise ValueError(f"feature cache {cache.path} holds {held[-1]:,} answer positions, fewer than the pool of "
                     f"{pool_positions:,} asked for: build it from more conversations")
  return int(np.searchsorted(held, pool_positions)) + 1


def positions_seen(cache, num_sequences: int, batch_size: int, seed: int, steps: int) -> np.ndarray:
  """Answer positions seen after steps 1..steps (cumulative), batches drawn from the first `num_sequences`."""
  per_sequence = answer_positions(cache)[:num_sequences]
  return np.cumsum([per_sequence[batch_indices(num_sequences, batch_size, seed, step)].sum() for step in range(steps)],
                   dtype=np.int64)


def steps_for_positions(cache, num_sequences: int, batch_size: int, seed: int, positions: int) -> int:
  """The fewest steps whose batches hold at least `positions` answer positions."""
  seen, step, per_sequence = 0, 0, answer_positions(cache)[:num_sequences]
  if not per_sequence.any():
    raise ValueError(f"feature cache {cache.path} has no answer positions")
  while seen < positions:
    seen += int(per_sequence[batch_indices(num_sequences, batch_size, seed, step)].sum())
    step += 1
  return step


def steps_at_fractions(seen: np.ndarray, fractions: Collection[float]) -> list[int]:
  """The first step (from 1) at which each fraction of the last count of `seen` is reached, without repeats."""
  total = seen[-1]
  return sorted({int(np.searchsorted(seen, f * total)) + 1 for f in fractions})


def _batch(cache, indices, layers) -> dict[str, np.ndarray]:
  b = cache.batch(indices)
  return {"tokens": b["tokens"], "mask": b["mask"], "features": b["features"][:, :, layers],
          "teacher_ids": b["teacher_ids"], "teacher_probs": b["teacher_probs"]}


def compiled_flops(compiled) -> float:
  """XLA's floating-point operation count of a compiled program (0 when the backend gives none)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # one entry per device program in older jax versions
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", 0.0))


def read_metrics(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _write_records(path: str, records: list[dict[str, Any]]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  os.replace(tmp, path)


def training_split(drafter: Drafter, target_params, drafter_params):
  """(trainable, frozen, loss_fn): the drafter's trainable arrays (`draft_head.is_trainable`), everything the loss
  reads but does not train ({"target": target_params, "drafter": the drafter's fixed arrays}), and
  loss_fn(trainable, frozen, batch) -> (loss, metrics) for `train.make_train_step(..., has_aux=True)`, the drafter's
  loss."""
  trainable, fixed = train.split_params(drafter_params, lambda path, leaf: draft_head.is_trainable(path))
  options = drafter.options

  def loss_fn(trainable_params, frozen_params, batch):
    params = train.merge_params(trainable_params, frozen_params["drafter"])
    return drafter.loss(frozen_params["target"], params, options, batch)

  return trainable, {"target": target_params, "drafter": fixed}, loss_fn


def train_drafter(model, drafter: Drafter, train_cache, held_out_cache, *, workdir: str, steps: int,
                  batch_size: int = 8, learning_rate: float = 1e-3, warmup_steps: int = 100,
                  weight_decay: float = 0.0, clip_norm: float = 1.0, seed: int = 0, log_every: int = 10,
                  eval_every: int = 200, eval_steps: Collection[int] | None = None, eval_sequences: int = 64,
                  save_every: int = 100, num_sequences: int | None = None,
                  evaluate_drafter: Callable[[Drafter], dict[str, Any]] | None = None, mesh=None,
                  progress: bool = True, stop_step: int | None = None) -> TrainResult:
  """Trains `drafter`'s trainable arrays (see the module doc); returns the trained drafter and its metrics.

  Evaluation runs at `eval_steps` (default: every `eval_every` steps) and after the last step; batches are drawn
  from the first `num_sequences` sequences of `train_cache` (default all, see `pool_sequences`); evaluation reports
  the loss and the per-depth top-1. `stop_step`
  ends this call after that step (an evaluation step), the schedule still the one of `steps`: the run so far is the
  full run's first part, its evaluation points the full run's, and calling again with a later `stop_step` (or none)
  resumes it from the checkpoint.
  """
  if drafter.loss is None:
    raise ValueError(f"drafter {drafter.name!r} has no loss: it is not trainable")
  check_cache(train_cache, model)
  check_cache(held_out_cache, model)
  full = default_feature_layers(drafter, model.config.num_layers)
  layers = feature_index(train_cache.meta["feature_layers"], full)
  feature_index(held_out_cache.meta["feature_layers"], full)
  os.makedirs(workdir, exist_ok=True)
  num_sequences = num_sequences or len(train_cache)
  if not 0 < num_sequences <= len(train_cache):
    raise ValueError(f"num_sequences must be in 1..{len(train_cache)}, got {num_sequences}")
  seen = positions_seen(train_cache, num_sequences, batch_size, seed, steps)
  eval_steps = set(range(eval_every, steps + 1, eval_every) if eval_steps is None else eval_steps) | {steps}
  if not all(0 < s <= steps for s in eval_steps):
    raise ValueError(f"evaluation steps must be in 1..{steps}, got {sorted(eval_steps)}")
  stop_step = steps if stop_step is None else int(stop_step)
  if stop_step not in eval_steps:
    raise ValueError(f"stop_step must be an evaluation step {sorted(eval_steps)}, got {stop_step}")

  target_params = model.params
  drafter_params = drafter.params
  if mesh is not None:
    target_params = sharding.shard_params(target_params, model.config, mesh)
    drafter_params = sharding.shard_tree(drafter_params, drafter.param_specs, mesh)
  trainable, frozen, loss_fn = training_split(drafter, target_params, drafter_params)
  fixed = frozen["drafter"]

  def batch_fn(step: int):
    return _batch(train_cache, batch_indices(num_sequences, batch_size, seed, step), layers)

  optimizer = train.make_optimizer(learning_rate, min(warmup_steps, steps - 1), steps, weight_decay=weight_decay,
                                   clip_norm=clip_norm)
  state = train.init_train_state(trainable, optimizer, mesh=mesh)
  if mesh is None:
    step_fn = train.make_train_step(loss_fn, optimizer, has_aux=True)
  else:
    step_fn = train.make_train_step(loss_fn, optimizer, mesh, has_aux=True, state_sharding=sharding.sharding_of(state),
                                    frozen_sharding=sharding.sharding_of(frozen))
  compile_start = time.perf_counter()
  compiled_step = step_fn.lower(state, frozen, batch_fn(0)).compile()  # the executable the steps run
  compile_seconds = time.perf_counter() - compile_start
  flops_per_step = compiled_flops(compiled_step)
  eval_loss = jax.jit(loss_fn)
  held_out = np.arange(min(eval_sequences, len(held_out_cache)))
  eval_batches = [held_out[i:i + batch_size] for i in range(0, len(held_out), batch_size)]

  def with_params(trainable_params) -> Drafter:
    params = jax.device_get(train.merge_params(trainable_params, fixed))
    return dataclasses.replace(drafter, params=jax.tree.map(jnp.asarray, params))

  def evaluate(trainable_params) -> dict[str, Any]:
    sums: dict[str, float] = {}
    for indices in eval_batches:
      loss, metrics = eval_loss(trainable_params, frozen, _batch(held_out_cache, indices, layers))
      for key, value in {"loss": loss, **metrics}.items():
        sums[key] = sums.get(key, 0.0) + float(value) * len(indices)
    result: dict[str, Any] = {f"eval_{k}": v / len(held_out) for k, v in sums.items()}
    if evaluate_drafter is not None:
      result.update(evaluate_drafter(with_params(trainable_params)))
    return result

  metrics_path = os.path.join(workdir, "metrics.jsonl")
  clock = {"train_seconds": 0.0, "train_cpu_seconds": 0.0}
  mark = [0.0, 0.0]  # wall and CPU clocks when training last resumed (after a start or an evaluation)

  def on_start(state: train.TrainState):
    kept = [r for r in read_metrics(metrics_path) if r["step"] <= int(state.step)]
    _write_records(metrics_path, kept)  # the lines past the checkpoint are replayed
    for key in clock:
      clock[key] = kept[-1].get(key, 0.0) if kept else 0.0
    mark[:] = time.perf_counter(), time.process_time()

  def on_step(step: int, state: train.TrainState, metrics: dict):
    if step % log_every and step % save_every and step not in eval_steps:
      return
    metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step: its time is the training's
    wall, cpu = time.perf_counter(), time.process_time()
    clock["train_seconds"] += wall - mark[0]
    clock["train_cpu_seconds"] += cpu - mark[1]
    record = {"step": step, "positions": int(seen[step - 1]), "flops": flops_per_step * step, **metrics, **clock}
    if step in eval_steps:
      record.update(evaluate(state.params))
      record.update(eval_seconds=time.perf_counter() - wall, eval_cpu_seconds=time.process_time() - cpu)
      logging.info("step %d, %d positions: %s", step, record["positions"],
                   {k: round(v, 4) for k, v in record.items() if k.startswith("eval_")})
    with open(metrics_path, "a") as f:
      f.write(json.dumps(record) + "\n")
    mark[:] = time.perf_counter(), time.process_time()

  state, _ = train.train(state, frozen, compiled_step, batch_fn, num_steps=stop_step,
                         checkpoint_dir=os.path.join(workdir, "checkpoints"), save_interval_steps=save_every,
                         save_steps=eval_steps, log_every=log_every, progress=progress, on_step=on_step,
                         on_start=on_start)
  history = read_metrics(metrics_path)
  final = {k: v for k, v in history[-1].items() if k.startswith("eval_") and k not in ("eval_seconds",
                                                                                       "eval_cpu_seconds")}
  return TrainResult(drafter=with_params(state.params), final_eval=final, train_seconds=clock["train_seconds"],
                     steps=int(state.step), train_cpu_seconds=clock["train_cpu_seconds"],
                     positions=int(seen[int(state.step) - 1]),
                     flops_per_step=flops_per_step, compile_seconds=compile_seconds, history=history)
