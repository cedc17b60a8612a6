"""Training building blocks: losses, optimizer, a jit-compiled (optionally sharded) step, checkpoints, a loop.

What gets trained here is a *subset* of a parameter pytree (MTP heads, early-exit adapters, a draft model,
or a few layers of the target) while the rest stays frozen. `split_params` cuts a pytree in two of the
same structure, with None where a leaf belongs to the other half; only the trainable half gets gradients
and optimizer state, and `merge_params` puts them back together inside the loss.

A typical run:

  optimizer = make_optimizer(3e-4, warmup_steps=100, total_steps=2000)
  trainable, frozen = split_params(params, lambda path, _: path.startswith("lm_head"))
  state = init_train_state(trainable, optimizer)
  step = make_train_step(lm_loss(config), optimizer)
  state, history = train(state, frozen, step, batch_at_step, num_steps=2000, checkpoint_dir="/tmp/run")

On a mesh, shard the parameters first (`sharding.shard_params`), pass `mesh` to `init_train_state`, and
give `make_train_step` the shardings of the state and the frozen half (`sharding.sharding_of`).

Resuming is exact: checkpoints hold the whole TrainState (step, trainable params, optimizer state) and
`batch_fn(step)` gives the batch of a step, so a killed run restarted with the same arguments replays
the same steps and ends with the same parameters.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from specjax import sharding
from specjax.config import ModelConfig
from specjax.loading import CheckpointError
from specjax.model import Params, forward, init_cache

# ----------------------------------------------------------------------------------------------- losses


def masked_mean(values: jax.Array, mask: jax.Array | None) -> jax.Array:
  """sum(values * mask) / max(sum(mask), 1); a plain mean without a mask."""
  if mask is None:
    return jnp.mean(values)
  mask = mask.astype(values.dtype)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Mean over unmasked positions of -log softmax(logits)[label]. logits [..., V], labels/mask [...]."""
  losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  return masked_mean(losses, mask)


def next_token_loss(logits: jax.Array, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Language-modelling loss: position t's logits [B, T, V] predict tokens[:, t + 1].

  mask [B, T] marks the tokens that count as *targets* (e.g. 0 on padding and on the prompt).
  """
  return cross_entropy(logits[:, :-1], tokens[:, 1:], None if mask is None else mask[:, 1:])


def distillation_loss(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array | None = None, *,
                      temperature: float = 1.0, kind: str = "kl") -> jax.Array:
  """Distillation to a teacher's distribution at temperature tau (Hinton et al., 2015).

  With p = softmax(teacher / tau) and q = softmax(student / tau), per position
    kl:            tau^2 * sum_v p_v (log p_v - log q_v)   (0 when the student matches the teacher)
    cross_entropy: tau^2 * -sum_v p_v log q_v              (= kl + tau^2 * H(p); same gradient)
  The tau^2 factor keeps gradient magnitudes comparable across temperatures. The teacher gets no
  gradient. Logits [..., V]; mask [...].
  """
  student = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  teacher = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32) / temperature, axis=-1)
  if kind == "kl":
    losses = optax.losses.kl_divergence_with_log_targets(student, teacher)
  elif kind == "cross_entropy":
    losses = optax.losses.softmax_cross_entropy(student, jnp.exp(teacher))
  else:
    raise ValueError(f"kind must be 'kl' or 'cross_entropy', got {kind!r}")
  return temperature ** 2 * masked_mean(losses, mask)


def lm_loss(config: ModelConfig) -> Callable:
  """loss_fn(trainable, frozen, batch) for the whole decoder on batch {"tokens" [B, T], "mask" [B, T]?}."""

  def loss_fn(trainable: Params, frozen: Params, batch: dict[str, jax.Array]) -> jax.Array:
    params = merge_params(trainable, frozen)
    tokens = batch["tokens"]
    cache = init_cache(config, tokens.shape[0], tokens.shape[1])
    out = forward(params, tokens, cache, jnp.zeros(tokens.shape[0], jnp.int32), config)
    return next_token_loss(out.logits, tokens, batch.get("mask"))

  return loss_fn


# -------------------------------------------------------------------------------- trainable / frozen


def split_params(params: Params, trainable: Callable[[str, jax.Array], bool] | Any) -> tuple[Params, Params]:
  """Splits a pytree into (trainable, frozen) halves of the same structure, None where the other half owns.

  `trainable` is a predicate on ("layers/3/wq"-style path, leaf), or a pytree of bools like `params`.
  """
  if callable(trainable):
    mask = jax.tree_util.tree_map_with_path(
        lambda path, x: bool(trainable(jax.tree_util.keystr(path, simple=True, separator="/"), x)), params)
  else:
    mask = trainable
  picked = jax.tree.map(lambda m, x: x if m else None, mask, params)
  rest = jax.tree.map(lambda m, x: None if m else x, mask, params)
  if not jax.tree.leaves(picked):
    raise ValueError("no parameter is trainable: the predicate/mask selected nothing")
  return picked, rest


def merge_params(trainable: Params, frozen: Params) -> Params:
  """Inverse of `split_params`; frozen=None means everything is trainable."""
  if frozen is None:
    return trainable
  return jax.tree.map(lambda a, b: b if a is None else a, trainable, frozen, is_leaf=lambda x: x is None)


# ---------------------------------------------------------------------------------- optimizer, state


def make_schedule(learning_rate: float, warmup_steps: int, total_steps: int, end_ratio: float = 0.0):
  """Linear warmup 0 -> learning_rate over warmup_steps, then cosine decay to end_ratio * learning_rate
  at total_steps: lr(t) = end + (peak - end) * (1 + cos(pi (t - warmup) / (total - warmup))) / 2."""
  if not 0 <= warmup_steps < total_steps:
    raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}")
  return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps, total_steps,
                                            end_value=end_ratio * learning_rate)


def make_optimizer(learning_rate: float, warmup_steps: int, total_steps: int, weight_decay: float = 0.0,
                   clip_norm: float | None = 1.0) -> optax.GradientTransformation:
  """clip_by_global_norm(clip_norm), then AdamW on the warmup-cosine schedule.

  Weight decay applies to matrices only (ndim >= 2), not to norm scales.
  """
  adamw = optax.adamw(make_schedule(learning_rate, warmup_steps, total_steps), weight_decay=weight_decay,
                      mask=lambda params: jax.tree.map(lambda x: x.ndim >= 2, params))
  return optax.chain(optax.clip_by_global_norm(clip_norm), adamw) if clip_norm else adamw


@struct.dataclass
class TrainState:
  """Everything a checkpoint holds; frozen parameters live outside (they come from the base model)."""
  step: jax.Array  # scalar int32: optimizer steps taken
  params: Params  # the trainable half (None where frozen)
  opt_state: optax.OptState


def init_train_state(trainable: Params, optimizer: optax.GradientTransformation,
                     mesh: Mesh | None = None) -> TrainState:
  """Step 0 state. On a mesh, optimizer moments take the sharding of their parameters (replicated when a
  parameter is not on the mesh), step counters are replicated."""
  state = TrainState(step=jnp.zeros((), jnp.int32), params=trainable, opt_state=optimizer.init(trainable))
  if mesh is None:
    return jax.device_put(state, may_alias=False)  # own copies: train steps donate the state's buffers
  return jax.device_put(state, train_state_sharding(state, optimizer, mesh), may_alias=False)


def train_state_sharding(state: TrainState, optimizer: optax.GradientTransformation, mesh: Mesh) -> TrainState:
  """The NamedSharding of every array of `state` (arrays or `jax.ShapeDtypeStruct`s) on `mesh`: optimizer moments
  take the sharding of their parameters (replicated when a parameter is not on the mesh), step counters are
  replicated."""
  replicated = sharding.replicated(mesh)
  param_sharding = jax.tree.map(
      lambda x: x.sharding if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh else replicated,
      state.params)
  opt_sharding = optax.tree_map_params(optimizer, lambda _, s: s, state.opt_state, param_sharding,
                                       transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=param_sharding, opt_state=opt_sharding)


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, mesh: Mesh | None = None, *,
                    state_sharding: Any = None, frozen_sharding: Any = None,
                    rules: sharding.ShardingRules = sharding.DEFAULT_RULES, has_aux: bool = False,
                    donate: bool = True) -> Callable:
  """One compiled step(state, frozen, batch) -> (state, metrics).

  loss_fn(trainable, frozen, batch) returns a scalar loss, or (loss, dict of metrics) with has_aux.
  metrics: {"loss", "grad_norm", **aux} as device scalars (no host sync).
  With a mesh: batch leaves are split over the data axis by their leading dimension; state and frozen
  params take `state_sharding` / `frozen_sharding` (pytrees or prefixes of NamedSharding, e.g.
  `sharding.sharding_of(state)`; default replicated) and the new state keeps `state_sharding`.
  The state is donated: its buffers are reused for the new state.
  """

  def loss_and_aux(trainable, frozen, batch):
    out = loss_fn(trainable, frozen, batch)
    return out if has_aux else (out, {})

  def step(state: TrainState, frozen: Params, batch: Any):
    (loss, aux), grads = jax.value_and_grad(loss_and_aux, has_aux=True)(state.params, frozen, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  donate_argnums = (0,) if donate else ()
  if mesh is None:
    return jax.jit(step, donate_argnums=donate_argnums)
  replicated = sharding.replicated(mesh)
  state_sharding = replicated if state_sharding is None else state_sharding
  frozen_sharding = replicated if frozen_sharding is None else frozen_sharding
  return jax.jit(step, in_shardings=(state_sharding, frozen_sharding, sharding.batch_sharding(mesh, rules)),
                 out_shardings=(state_sharding, replicated), donate_argnums=donate_argnums)


# -------------------------------------------------------------------------------------- checkpoints


def checkpoint_manager(directory: str, *, save_interval_steps: int = 100,
                       max_to_keep: int | None = 3) -> ocp.CheckpointManager:
  """An orbax manager saving every `save_interval_steps` steps and keeping the latest `max_to_keep`.

  Orbax writes each step into a temporary directory and renames it when complete, so a run killed
  mid-save leaves no half-written step behind (leftover temporaries are removed on the next start).
  Saves are asynchronous; use the manager as a context manager (or call close()) to wait for them.
  """
  options = ocp.CheckpointManagerOptions(
      save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(save_interval_steps),
      preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
      cleanup_tmp_directories=True)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def restore_or_init(manager: ocp.CheckpointManager, state: TrainState) -> TrainState:
  """The latest checkpoint restored onto `state`'s structure, shapes and shardings; `state` if none.

  Raises CheckpointError when the latest checkpoint cannot be read (corrupt or truncated files, or a
  different parameter tree / optimizer); delete that step's directory to resume from an earlier one.
  """
  step = manager.latest_step()
  if step is None:
    return state
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  path = os.path.join(str(manager.directory), str(step))
  try:
    restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    # orbax restores a subset of a checkpoint, or fills leaves it lacks with None, without failing.
    saved_arrays = len(jax.tree.leaves(manager.item_metadata(step).tree))
    if jax.tree.structure(restored) != jax.tree.structure(state) or saved_arrays != len(jax.tree.leaves(state)):
      raise ValueError(f"the checkpoint holds {saved_arrays} arrays in a different tree than the state's "
                       f"{len(jax.tree.leaves(state))}: {jax.tree.structure(restored)}")
    restored_step = int(restored.step)
  except Exception as err:  # orbax/tensorstore raise many kinds; all mean "this step is unusable"
    earlier = [s for s in manager.all_steps() if s != step]
    raise CheckpointError(
        f"cannot restore the checkpoint at {path} ({type(err).__name__}: {str(err)[:500]}). It is corrupt or "
        f"truncated, or was written for a different parameter tree or optimizer. Delete {path} to resume from "
        f"an earlier step {sorted(earlier)}, or use a new checkpoint directory.") from err
  if restored_step != step:
    raise CheckpointError(f"checkpoint {path} holds a state at step {restored_step}, not {step}")
  return restored


# -------------------------------------------------------------------------------------------- loop


def train(state: TrainState, frozen: Params, train_step: Callable, batch_fn: Callable[[int], Any], *,
          num_steps: int, checkpoint_dir: str | None = None, save_interval_steps: int = 100,
          max_to_keep: int | None = 3, log_every: int = 10, progress: bool = True,
          on_step: Callable[[int, TrainState, dict], None] | None = None,
          on_start: Callable[[TrainState], None] | None = None, save_steps: Collection[int] = ()
          ) -> tuple[TrainState, dict[str, np.ndarray]]:
  """Runs train_step until state.step == num_steps, resuming from `checkpoint_dir`'s latest step.

  batch_fn(step) gives the batch of a step (a pure function of the step, so a resumed run sees the same
  data). The final step and the steps in `save_steps` are always saved, besides every `save_interval_steps`.
  Returns the final state and each metric over the steps run in this call ({"step": [...], "loss": [...], ...}).
  `on_start(state)` runs once with the restored (or initial) state, before the first step; `on_step(step, state,
  metrics)` runs after every step (steps counted from 1, metrics as device arrays): for evaluation and logging,
  before the step's checkpoint.
  """
  manager = checkpoint_manager(checkpoint_dir, save_interval_steps=save_interval_steps,
                               max_to_keep=max_to_keep) if checkpoint_dir else None
  try:
    if manager is not None:
      state = restore_or_init(manager, state)
    start = int(state.step)
    if on_start is not None:
      on_start(state)
    history = []
    bar = tqdm(range(start, num_steps), initial=start, total=num_steps, disable=not progress, desc="train")
    for step in bar:
      state, metrics = train_step(state, frozen, batch_fn(step))
      history.append(metrics)
      if on_step is not None:
        on_step(step + 1, state, metrics)
      if manager is not None:
        saved = manager.save(step + 1, args=ocp.args.StandardSave(state))
        if (step + 1 == num_steps or step + 1 in save_steps) and not saved:
          manager.save(step + 1, args=ocp.args.StandardSave(state), force=True)
      if progress and (step + 1) % log_every == 0:
        bar.set_postfix(loss=f"{float(metrics['loss']):.4f}")  # a host sync every log_every steps only
  finally:
    if manager is not None:
      manager.close()  # waits for in-flight async saves, also when the loop raised
  history = jax.device_get(history)
  out = {"step": np.arange(start + 1, start + 1 + len(history))}
  for key in (history[0] if history else {}):
    out[key] = np.array([m[key] for m in history])
  return state, out
