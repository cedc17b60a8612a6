"""Meshes and sharding rules; sharded greedy generation equals single-device generation token for token.

Multi-device checks run once, in a subprocess with 8 CPU devices (see tests/multidevice.py), and each
test below asserts one property of its result.
"""

from __future__ import annotations

import logging

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from specjax import sharding
from specjax.config import ModelConfig
from specjax.model import is_spec, param_shapes
from tests.multidevice import run_with_devices

# SmolLM2-135M's shapes: 9 query heads over 3 KV heads, neither divisible by a model axis of 4.
SMOLLM2_CONFIG = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                             num_heads=9, num_kv_heads=3, head_dim=64)
MESHES = [(8, 1), (2, 4), (1, 8)]
DRAFTERS = ["draft_model", "layer_skip", "prompt_lookup", "mtp_parallel", "mtp_sequential", "layer_skip_adapter",
            "draft_model_distilled"]
# Every drafter on the 2x4 mesh. Drafters with parameters of their own (placed by their declared axes) also on one
# single-axis mesh each, two per mesh: each kind of placement meets each kind of axis once.
SINGLE_AXIS = {(8, 1): ["mtp_sequential", "draft_model_distilled"], (1, 8): ["mtp_parallel", "layer_skip_adapter"]}

SNIPPET = """
import json
import numpy as np
import jax
from specjax import sharding
from specjax.config import ModelConfig
from specjax.generate import generate
from specjax.loading import Model
from specjax.model import init_params

def tiny_model(num_heads, num_kv_heads, vocab_size):
  config = ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16)
  # std 0.2: logits spread far apart, so argmax is not decided by rounding differences.
  return Model(config, init_params(config, jax.random.PRNGKey(0), std=0.2), None, "tiny")

rng = np.random.default_rng(0)
prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(2, 14, size=8)]
result = {"num_devices": jax.device_count(), "gqa": {}}

def spec(array):
  return [list(a) if isinstance(a, tuple) else a for a in array.sharding.spec]

model = tiny_model(num_heads=8, num_kv_heads=4, vocab_size=256)
reference = generate(model, prompts, max_new_tokens=12).tokens
for data, model_axis in %(meshes)s:
  mesh = sharding.make_mesh(data, model_axis)
  sharded = sharding.shard_model(model, mesh)
  first = generate(sharded, prompts, max_new_tokens=12, mesh=mesh)
  second = generate(sharded, prompts, max_new_tokens=12, mesh=mesh)
  layer = sharded.params["layers"][0]
  result["gqa"][f"{data}x{model_axis}"] = {
      "equal": first.tokens == reference, "equal_again": second.tokens == reference,
      "compiled_first": first.stats["compile_seconds"] > 0, "recompiled": second.stats["compile_seconds"] > 0,
      "specs": {name: spec(layer[name]) for name in ("wq", "wk", "wo", "w_gate", "w_down")}
               | {"embed": spec(sharded.params["embed"])},
      "cache": list(sharding.cache_sharding(model.config, mesh, batch_size=8, max_len=128).spec)}

# Speculative decoding: the single-device greedy tokens, one compile per shape. Every drafter on the mesh with both
# axes, with adaptive drafting (several verify widths in one program); on the data-only and model-only meshes two
# drafters each that bring parameters of their own (placed by their declared axes) or an adapter, with fixed gamma (a
# fixed-gamma program compiles in about three fifths of the time). Each program here compiles for 8 devices.
import specjax
draft = Model(model.config.replace(num_layers=1), init_params(model.config.replace(num_layers=1),
              jax.random.PRNGKey(1), std=0.2), None, "tiny-draft")
drafters = {"draft_model": dict(draft=draft), "layer_skip": dict(exit_layer=1), "prompt_lookup": {},
            "mtp_parallel": dict(path=None, num_heads=3, token_map=list(range(0, 256, 2))),
            "mtp_sequential": dict(path=None, depth=3),
            "layer_skip_adapter": dict(adapter="fresh", exit_layer=1, token_map=list(range(0, 256, 2))),
            "draft_model_distilled": dict(draft="fresh", num_layers=1)}
kinds = {"layer_skip_adapter": "layer_skip", "draft_model_distilled": "draft_model"}  # test id -> drafter name
result["speculative"] = {}
for data, model_axis in %(meshes)s:
  mesh = sharding.make_mesh(data, model_axis)
  sharded = sharding.shard_model(model, mesh)
  adaptive = (data, model_axis) == (2, 4)
  for name, options in drafters.items():
    if not adaptive and name not in %(single_axis)s.get((data, model_axis), ()):
      continue
    drafter = specjax.make_drafter(kinds.get(name, name), sharded, **options)
    first = generate(sharded, prompts, max_new_tokens=12, drafter=drafter, gamma=3, mesh=mesh, adaptive=adaptive)
    second = generate(sharded, prompts, max_new_tokens=12, drafter=drafter, gamma=3, mesh=mesh, adaptive=adaptive)
    result["speculative"][f"{data}x{model_axis}/{name}"] = {
        "equal": first.tokens == reference and second.tokens == reference,
        "compiled_first": first.stats["compile_seconds"] > 0, "recompiled": second.stats["compile_seconds"] > 0}

# A drafter trained on the 2x4 mesh ends where single-device training ends (tests/test_train.py checks the training
# step itself on every mesh).
import tempfile
from specjax.data.features import build_feature_cache
from specjax.train_drafter import train_drafter
seqs = [(np.asarray(rng.integers(0, 256, size=32), np.int32), np.ones(32, bool)) for _ in range(32)]
with tempfile.TemporaryDirectory() as tmp:
  cache = build_feature_cache(model, seqs, tmp + "/cache", seq_len=32, feature_layers=(1,), top_k=4, batch_size=8)
  trained = {}
  for mesh_shape in (None, (2, 4)):
    mesh = None if mesh_shape is None else sharding.make_mesh(*mesh_shape)
    fresh = specjax.make_drafter("mtp_sequential", model, path=None, depth=2, token_map=list(range(0, 256, 2)))
    run = train_drafter(model, fresh, cache, cache, workdir=f"{tmp}/{mesh_shape}", steps=3, batch_size=8,
                        warmup_steps=1, eval_every=3, eval_sequences=8, mesh=mesh, progress=False)
    trained[str(mesh_shape)] = (jax.device_get(run.drafter.params), run.final_eval["eval_loss"])
  base_params, base_loss = trained["None"]
  result["train_on_mesh"] = {
      key: {"loss_diff": abs(loss - base_loss),
            "max_param_diff": max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                                  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(base_params)))}
      for key, (params, loss) in trained.items() if key != "None"}

smol_like = tiny_model(num_heads=9, num_kv_heads=3, vocab_size=256)
mesh = sharding.make_mesh(2, 4)
sharded = sharding.shard_model(smol_like, mesh)
result["smollm2_heads"] = {
    "equal": (generate(sharded, prompts, max_new_tokens=12, mesh=mesh).tokens
              == generate(smol_like, prompts, max_new_tokens=12).tokens),
    "wq": spec(sharded.params["layers"][0]["wq"]), "w_up": spec(sharded.params["layers"][0]["w_up"])}

try:
  generate(model, prompts[:3], max_new_tokens=4, mesh=sharding.make_mesh(8, 1))
  result["indivisible_batch_error"] = None
except ValueError as err:
  result["indivisible_batch_error"] = str(err)
try:
  sharding.make_mesh(3, 2)
  result["bad_mesh_error"] = None
except ValueError as err:
  result["bad_mesh_error"] = str(err)
result["auto_data"] = dict(sharding.make_mesh(-1, 2).shape)
print("RESULT", json.dumps(result))
""" % {"meshes": MESHES, "single_axis": SINGLE_AXIS}


@pytest.fixture(scope="module")
def sharded_runs():
  return run_with_devices(SNIPPET, num_devices=8)


# ------------------------------------------------------------------------------ in-process, 1 device


def test_make_mesh_rejects_wrong_device_count():
  with pytest.raises(ValueError, match="data=2 x model=1 = 2 devices, but there are 1"):
    sharding.make_mesh(data=2, devices=jax.devices()[:1])
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 1, "model": 1}


def test_default_rules_shard_heads_mlp_vocab_over_model_and_batch_over_data():
  mesh = AbstractMesh((2, 4), ("data", "model"))
  config = SMOLLM2_CONFIG.replace(num_heads=8, num_kv_heads=4)
  specs = jax.tree.map(lambda s: sharding.logical_to_spec(s.axes, s.shape, mesh), param_shapes(config),
                       is_leaf=is_spec)
  layer = specs["layers"][0]
  assert layer["wq"] == P(None, "model", None)
  assert layer["wk"] == layer["wv"] == P(None, "model", None)
  assert layer["wo"] == P("model", None, None)
  assert layer["w_gate"] == layer["w_up"] == P(None, "model")
  assert layer["w_down"] == P("model", None)
  assert layer["attn_norm"] == P(None)
  assert specs["embed"] == P("model", None)
  assert sharding.logical_to_spec(("batch", "cache_seq", "kv_heads", "head_dim"), (8, 128, 4, 64), mesh) == \
      P("data", None, "model", None)


def test_smollm2_heads_fall_back_to_replicated_with_one_warning(caplog):
  sharding._warn_replicated.cache_clear()
  mesh = AbstractMesh((2, 4), ("data", "model"))
  with caplog.at_level(logging.WARNING):
    specs = jax.tree.map(lambda s: sharding.logical_to_spec(s.axes, s.shape, mesh),
                         param_shapes(SMOLLM2_CONFIG), is_leaf=is_spec)
  layer = specs["layers"][0]
  assert layer["wq"] == layer["wo"] == P(None, None, None)  # 9 heads over 4
  assert layer["wk"] == P(None, None, None)  # 3 KV heads over 4
  assert layer["w_up"] == P(None, "model")  # 1536 = 4 * 384 still splits
  assert specs["embed"] == P("model", None)
  warnings = [r.getMessage() for r in caplog.records if "replicating" in r.getMessage()]
  assert len(warnings) == 2, warnings  # one per (axis, size), not one per layer
  assert any("'heads' of size 9" in w for w in warnings) and any("'kv_heads' of size 3" in w for w in warnings)


def test_custom_rules_are_one_mapping():
  mesh = AbstractMesh((2, 4), ("data", "model"))
  rules = sharding.ShardingRules(mlp=None, embed="data")  # e.g. 2-D weight sharding
  assert sharding.logical_to_spec(("embed", "mlp"), (576, 1536), mesh, rules) == P("data", None)
  # a mesh axis may shard one dimension only: vocab takes "model", embed keeps "data"
  assert sharding.logical_to_spec(("vocab", "embed"), (49152, 576), mesh, rules) == P("model", "data")


# ---------------------------------------------------------------------------- subprocess, 8 devices


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [f"{d}x{m}" for d, m in MESHES])
def test_sharded_greedy_generate_equals_single_device(sharded_runs, mesh):
  result, _ = sharded_runs
  assert result["num_devices"] == 8
  run = result["gqa"][mesh]
  assert run["equal"] and run["equal_again"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [f"{d}x{m}" for d, m in MESHES])
def test_sharded_generate_compiles_once_per_shape(sharded_runs, mesh):
  run = sharded_runs[0]["gqa"][mesh]
  assert run["compiled_first"] and not run["recompiled"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, drafter", [(f"{d}x{m}", name) for d, m in MESHES for name in DRAFTERS
                                           if (d, m) == (2, 4) or name in SINGLE_AXIS.get((d, m), ())])
def test_sharded_speculative_generate_equals_single_device(sharded_runs, mesh, drafter):
  run = sharded_runs[0]["speculative"][f"{mesh}/{drafter}"]
  assert run["equal"] and run["compiled_first"] and not run["recompiled"]


@pytest.mark.slow
def test_drafter_trained_on_a_mesh_matches_single_device_training(sharded_runs):
  run = sharded_runs[0]["train_on_mesh"]["(2, 4)"]
  assert run["loss_diff"] < 1e-4 and run["max_param_diff"] < 1e-4, run


@pytest.mark.slow
def test_sharded_params_and_cache_follow_the_rules(sharded_runs):
  runs = sharded_runs[0]["gqa"]
  assert runs["2x4"]["specs"]["wq"] == [None, "model", None]
  assert runs["2x4"]["specs"]["wk"] == [None, "model", None]  # 4 KV heads over model=4
  assert runs["1x8"]["specs"]["wk"] == [None, None, None]  # 4 KV heads over model=8: replicated
  assert runs["1x8"]["specs"]["wq"] == [None, "model", None]  # 8 query heads over model=8
  assert runs["2x4"]["specs"]["w_down"] == ["model", None]
  assert runs["2x4"]["specs"]["embed"] == ["model", None]
  assert runs["8x1"]["specs"]["wq"] == [None, None, None]
  assert runs["2x4"]["cache"] == ["data", None, "model", None]
  assert runs["8x1"]["cache"] == ["data", None, None, None]


@pytest.mark.slow
def test_smollm2_head_layout_on_model_4_falls_back_and_still_matches(sharded_runs):
  result, stderr = sharded_runs
  run = result["smollm2_heads"]
  assert run["equal"]
  assert run["wq"] == [None, None, None] and run["w_up"] == [None, "model"]
  assert "logical axis 'heads' of size 9 is not divisible" in stderr
  assert "logical axis 'kv_heads' of size 3 is not divisible" in stderr


@pytest.mark.slow
def test_batch_not_divisible_by_data_axis_is_a_clear_error(sharded_runs):
  message = sharded_runs[0]["indivisible_batch_error"]
  assert message is not None and "batch size 3 is not divisible" in message and "make_mesh(data=1" in message


@pytest.mark.slow
def test_make_mesh_device_count_checks(sharded_runs):
  result = sharded_runs[0]
  assert result["bad_mesh_error"] is not None and "data * model == 8" in result["bad_mesh_error"]
  assert result["auto_data"] == {"data": 4, "model": 2}
