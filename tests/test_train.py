"""Training building blocks: losses, schedule, frozen subsets, exact resume from orbax checkpoints, sharding."""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import train as T
from specjax.loading import CheckpointError
from specjax.model import init_params
from tests.multidevice import run_with_devices
from tests.task_drafters import VOCAB

NUM_STEPS = 12


def is_trainable(path: str, _) -> bool:
  """Train the top layer and the head; the embedding and layer 0 stay frozen (a drafter-style split)."""
  return not (path.startswith("embed") or path.startswith("layers/0/"))


def batch_at(step: int) -> dict[str, np.ndarray]:
  tokens = np.random.default_rng(step).integers(0, VOCAB, (4, 16)).astype(np.int32)
  mask = np.ones_like(tokens)
  mask[:, :4] = 0  # a "prompt" that is not trained on
  return {"tokens": tokens, "mask": mask}


@pytest.fixture(scope="module")
def setup(tiny_config):
  """One optimizer and one compiled step shared by the tests below (compiling is the slow part)."""
  params = init_params(tiny_config, jax.random.PRNGKey(0), std=0.1)
  optimizer = T.make_optimizer(1e-2, warmup_steps=2, total_steps=NUM_STEPS, weight_decay=0.1)
  step = T.make_train_step(T.lm_loss(tiny_config), optimizer)
  return params, optimizer, step


def fresh_state(setup):
  params, optimizer, _ = setup
  trainable, frozen = T.split_params(params, is_trainable)
  return T.init_train_state(trainable, optimizer), frozen


# ------------------------------------------------------------------------------------------ losses


def test_cross_entropy_is_masked_mean_of_negative_log_likelihood():
  logits = jnp.log(jnp.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
  labels = jnp.array([0, 1])
  assert np.isclose(T.cross_entropy(logits, labels), -(np.log(0.5) + np.log(0.8)) / 2, atol=1e-6)
  assert np.isclose(T.cross_entropy(logits, labels, jnp.array([0, 1])), -np.log(0.8), atol=1e-6)


def test_next_token_loss_predicts_the_following_token():
  tokens = jnp.array([[3, 1, 4, 1, 5]])
  # position t puts all its mass on tokens[t + 1]: zero loss; shifted the wrong way it would be ~23
  logits = 30.0 * jax.nn.one_hot(jnp.array([[1, 4, 1, 5, 0]]), 8)
  assert T.next_token_loss(logits, tokens) < 1e-6
  uniform = jnp.zeros((1, 5, 8))
  assert np.isclose(T.next_token_loss(uniform, tokens, jnp.array([[0, 0, 1, 1, 1]])), np.log(8), atol=1e-6)


def test_distillation_kl_and_cross_entropy_match_their_definitions():
  rng = np.random.default_rng(0)
  student, teacher = rng.normal(size=(2, 3, 10)), rng.normal(size=(2, 3, 10))
  tau = 2.0
  p = np.exp(teacher / tau) / np.exp(teacher / tau).sum(-1, keepdims=True)
  log_q = student / tau - np.log(np.exp(student / tau).sum(-1, keepdims=True))
  kl = tau ** 2 * np.mean(np.sum(p * (np.log(p) - log_q), -1))
  ce = tau ** 2 * np.mean(-np.sum(p * log_q, -1))
  assert np.isclose(T.distillation_loss(student, teacher, temperature=tau), kl, rtol=1e-5)
  assert np.isclose(T.distillation_loss(student, teacher, temperature=tau, kind="cross_entropy"), ce, rtol=1e-5)
  assert T.distillation_loss(teacher, teacher, temperature=tau) < 1e-6
  mask = np.array([[1, 0, 0], [0, 0, 0]])
  only_first = tau ** 2 * np.sum(p[0, 0] * (np.log(p[0, 0]) - log_q[0, 0]))
  assert np.isclose(T.distillation_loss(student, teacher, mask, temperature=tau), only_first, rtol=1e-5)
  # the teacher gets no gradient
  grad = jax.grad(lambda t: T.distillation_loss(student, t))(jnp.asarray(teacher))
  assert not np.any(np.asarray(grad))


def test_warmup_cosine_schedule_values():
  schedule = T.make_schedule(2.0, warmup_steps=10, total_steps=110, end_ratio=0.1)
  expected = {0: 0.0, 5: 1.0, 10: 2.0, 60: 0.2 + 1.8 * 0.5, 110: 0.2, 200: 0.2}
  for step, value in expected.items():
    assert np.isclose(schedule(step), value, atol=1e-6), step
  with pytest.raises(ValueError, match="warmup_steps < total_steps"):
    T.make_schedule(1.0, warmup_steps=10, total_steps=10)


# ------------------------------------------------------------------------------- trainable / frozen


def test_split_and_merge_params_round_trip(setup):
  params = setup[0]
  trainable, frozen = T.split_params(params, is_trainable)
  assert trainable["embed"] is None and frozen["embed"] is params["embed"]
  assert trainable["layers"][0]["wq"] is None and trainable["layers"][1]["wq"] is params["layers"][1]["wq"]
  assert len(jax.tree.leaves(trainable)) + len(jax.tree.leaves(frozen)) == len(jax.tree.leaves(params))
  merged = T.merge_params(trainable, frozen)
  assert jax.tree.structure(merged) == jax.tree.structure(params)
  assert all(a is b for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params)))
  with pytest.raises(ValueError, match="selected nothing"):
    T.split_params(params, lambda path, _: False)


def test_frozen_params_unchanged_and_without_optimizer_state(setup):
  params, _, step = setup
  state, frozen = fresh_state(setup)
  before = jax.device_get(frozen)
  trainable_before = jax.device_get(state.params)
  for i in range(3):
    state, _ = step(state, frozen, batch_at(i))
  merged = T.merge_params(state.params, frozen)
  np.testing.assert_array_equal(merged["embed"], before["embed"])
  for name, value in before["layers"][0].items():
    np.testing.assert_array_equal(merged["layers"][0][name], value)
  assert not np.allclose(merged["layers"][1]["wq"], trainable_before["layers"][1]["wq"])
  assert not np.allclose(merged["lm_head"], trainable_before["lm_head"])
  # Adam moments exist for trainable leaves only (mu and nu: two per trainable array)
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim >= 1]
  assert len(moments) == 2 * len(jax.tree.leaves(state.params))
  assert int(state.step) == 3


def test_loss_decreases_on_a_memorization_task(setup):
  _, _, step = setup
  state, frozen = fresh_state(setup)
  losses = []
  for _ in range(NUM_STEPS):
    state, metrics = step(state, frozen, batch_at(0))  # the same batch every step
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.6 * losses[0], losses
  assert np.isfinite(float(metrics["grad_norm"]))


# ------------------------------------------------------------------------------------- checkpoints


class Killed(Exception):
  pass


def test_killed_run_resumes_to_the_same_parameters(setup, tmp_path):
  _, _, step = setup
  kwargs = dict(num_steps=NUM_STEPS, save_interval_steps=4, max_to_keep=2, progress=False)
  state, frozen = fresh_state(setup)
  uninterrupted, history = T.train(state, frozen, step, batch_at, checkpoint_dir=str(tmp_path / "a"), **kwargs)

  def killed_at_10(i):
    if i == 10:
      raise Killed  # steps 0..9 done, last checkpoint at step 8
    return batch_at(i)

  state, frozen = fresh_state(setup)
  with pytest.raises(Killed):
    T.train(state, frozen, step, killed_at_10, checkpoint_dir=str(tmp_path / "b"), **kwargs)
  assert sorted(os.listdir(tmp_path / "b")) == ["4", "8"]
  state, frozen = fresh_state(setup)
  resumed, resumed_history = T.train(state, frozen, step, batch_at, checkpoint_dir=str(tmp_path / "b"), **kwargs)

  assert int(resumed.step) == int(uninterrupted.step) == NUM_STEPS
  np.testing.assert_array_equal(resumed_history["step"], [9, 10, 11, 12])
  np.testing.assert_array_equal(resumed_history["loss"], history["loss"][8:])
  for a, b in zip(jax.tree.leaves(jax.device_get(resumed)), jax.tree.leaves(jax.device_get(uninterrupted))):
    np.testing.assert_array_equal(a, b)
  assert sorted(os.listdir(tmp_path / "b"), key=int) == ["8", "12"]  # keep-last-2
  # a finished run resumed again does nothing
  state, frozen = fresh_state(setup)
  again, again_history = T.train(state, frozen, step, batch_at, checkpoint_dir=str(tmp_path / "b"), **kwargs)
  assert len(again_history["step"]) == 0 and int(again.step) == NUM_STEPS


@pytest.mark.parametrize("damage", ["truncated_data", "fewer_trainable", "more_trainable"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's aborted async reads
def test_unreadable_checkpoint_is_a_clear_error(setup, tmp_path, damage):
  _, optimizer, step = setup
  state, frozen = fresh_state(setup)
  T.train(state, frozen, step, batch_at, num_steps=4, checkpoint_dir=str(tmp_path), save_interval_steps=2,
          progress=False)
  state, frozen = fresh_state(setup)
  if damage == "truncated_data":
    files = [f for f in glob.glob(str(tmp_path / "4" / "**" / "d" / "*"), recursive=True) if os.path.isfile(f)]
    assert files
    for f in files:
      os.truncate(f, os.path.getsize(f) // 2)
  else:  # a state for another trainable subset (orbax alone would restore it silently)
    params = T.merge_params(state.params, frozen)
    subset = (lambda path, _: path == "lm_head") if damage == "fewer_trainable" else (lambda path, _: True)
    trainable, frozen = T.split_params(params, subset)
    state = T.init_train_state(trainable, optimizer)
  with pytest.raises(CheckpointError, match=r"cannot restore the checkpoint at .*4 .*Delete .*earlier step \[2\]"):
    T.train(state, frozen, step, batch_at, num_steps=6, checkpoint_dir=str(tmp_path), progress=False)


# ------------------------------------------------------------------------------ sharded, 8 devices

SNIPPET = """
import json
import numpy as np
import jax
from specjax import sharding, train as T
from specjax.config import ModelConfig
from specjax.model import init_params

config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                     num_kv_heads=4, head_dim=8, tie_embeddings=False)
params = init_params(config, jax.random.PRNGKey(0), std=0.1)
optimizer = T.make_optimizer(1e-2, warmup_steps=1, total_steps=10, weight_decay=0.1)
batches = [{"tokens": np.random.default_rng(i).integers(0, 256, (8, 16)).astype(np.int32)} for i in range(3)]
frozen_embed = lambda path, _: path != "embed"

def run(mesh):
  p = params if mesh is None else sharding.shard_params(params, config, mesh)
  trainable, frozen = T.split_params(p, frozen_embed)
  state = T.init_train_state(trainable, optimizer, mesh)
  kwargs = {} if mesh is None else dict(state_sharding=sharding.sharding_of(state),
                                        frozen_sharding=sharding.sharding_of(frozen))
  step = T.make_train_step(T.lm_loss(config), optimizer, mesh, **kwargs)
  losses = []
  for batch in batches:
    state, metrics = step(state, frozen, batch)
    losses.append(float(metrics["loss"]))
  wq = state.params["layers"][0]["wq"]
  mu_wq = state.opt_state[1][0].mu["layers"][0]["wq"]
  spec = lambda x: [a for a in x.sharding.spec] if hasattr(x.sharding, "spec") else None
  return {"losses": losses, "wq": spec(wq), "mu_wq": spec(mu_wq),
          "final_wq": np.asarray(jax.device_get(wq)).ravel()[:64].tolist()}

result = {"single": run(None)}
for data, model_axis in [(8, 1), (2, 4), (1, 8)]:
  result[f"{data}x{model_axis}"] = run(sharding.make_mesh(data, model_axis))
print("RESULT", json.dumps(result))
"""


@pytest.fixture(scope="module")
def sharded_training():
  return run_with_devices(SNIPPET, num_devices=8)[0]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8x1", "2x4", "1x8"])
def test_sharded_train_step_losses_equal_single_device(sharded_training, mesh):
  single, sharded = sharded_training["single"], sharded_training[mesh]
  np.testing.assert_allclose(sharded["losses"], single["losses"], atol=1e-5, rtol=0)
  assert single["losses"][-1] < single["losses"][0]
  np.testing.assert_allclose(sharded["final_wq"], single["final_wq"], atol=1e-5)


@pytest.mark.slow
def test_sharded_train_state_keeps_parameter_shardings(sharded_training):
  assert sharded_training["2x4"]["wq"] == [None, "model", None]
  assert sharded_training["2x4"]["mu_wq"] == [None, "model", None]  # Adam moments follow their parameter
  assert sharded_training["1x8"]["wq"] == [None, "model", None]
  assert sharded_training["8x1"]["wq"] == [None, None, None]
