"""int8 weight-only quantization (specjax/int8.py): codes and a scale per output channel, multiplied through the same
seam as GGUF blocks (`ops.matmul`, `ops.take`), on any platform with jnp. Compiled for TPU topologies in
tests/test_tpu_compile.py (marked tpu_compile)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import specjax
from specjax import int8, leviathan, ops, sharding
from specjax.decoding import decode_params
from specjax.model import is_spec, param_shapes
from tests.conftest import TINY_CONFIG, tiny_model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def models(request):
  """(float32 model, its int8 twin, the int8 twin's values as float32 arrays), head untied and tied."""
  dense = tiny_model(TINY_CONFIG.replace(tie_embeddings=request.param))
  quantized = specjax.Model(dense.config, int8.quantize_params(dense.params), None, f"{dense.name}-int8")
  return dense, quantized, specjax.Model(dense.config, ops.dequantize(quantized.params), None, "dequantized")


def test_codes_span_127_levels_per_output_channel_within_half_a_step():
  w = jax.random.normal(jax.random.PRNGKey(0), (64, 4, 16)) * jnp.arange(1, 65)[None, None, :].reshape(4, 16)
  q = int8.quantize(w)
  assert q.codes.dtype == jnp.int8 and q.codes.shape == w.shape and q.scale.shape == (4, 16)
  assert int(jnp.max(jnp.abs(q.codes))) == 127
  assert bool(jnp.all(jnp.max(jnp.abs(q.codes), axis=0) == 127))  # every channel uses its whole range
  assert float(jnp.max(jnp.abs(q.dequantize() - w) / q.scale)) <= 0.5 + 1e-5
  table = int8.quantize(w.reshape(64, 64), transposed=True)  # an embedding table: a scale per row
  assert table.scale.shape == (64,) and table.matrix_shape == (64, 64)
  np.testing.assert_array_equal(np.asarray(table.T.T.codes), np.asarray(table.codes))
  zero = int8.quantize(jnp.zeros((32, 8)))
  assert bool(jnp.all(zero.scale == 1.0)) and bool(jnp.all(zero.dequantize() == 0))


def test_products_and_gathers_read_the_dequantized_values(models):
  dense, quantized, dequantized = models
  layer, values = quantized.params["layers"][0], dequantized.params["layers"][0]
  x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, TINY_CONFIG.hidden_size))
  for seed, (name, k_dims) in enumerate((("wq", 1), ("wo", 2), ("w_down", 1))):
    w, v = layer[name], values[name]
    k = int(np.prod(v.shape[:k_dims]))
    inputs = jax.random.normal(jax.random.PRNGKey(seed), (3, 5, k))
    got = jax.jit(ops.matmul)(inputs, w.reshape(k, -1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(inputs @ v.reshape(k, -1)), rtol=1e-5, atol=1e-5)
  table, values = quantized.params["embed"], dequantized.params["embed"]
  ids = jnp.asarray([[0, 31, 7], [2, 2, 30]])
  np.testing.assert_array_equal(np.asarray(ops.take(table, ids)), np.asarray(values)[np.asarray(ids)])
  np.testing.assert_allclose(np.asarray(ops.matmul_transposed(x, table)), np.asarray(x @ values.T), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(ops.take(table.T, ids[0], axis=1)), np.asarray(values)[np.asarray(ids[0])].T,
                             rtol=1e-6)


def test_an_int8_model_computes_what_its_dequantized_values_do_and_decodes_losslessly(models):
  """Logits within float rounding of the same values as arrays ((x @ c) * s against x @ (c * s)); greedy decoding, and
  speculative decoding against it, token for token."""
  _, quantized, dequantized = models
  ids = list(range(1, 20))
  got, want = np.asarray(specjax.logits(quantized, ids)), np.asarray(specjax.logits(dequantized, ids))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  prompts = [[3, 5, 7, 3, 5, 7, 3, 5], [9, 1, 4]]
  expected = specjax.generate(quantized, prompts, max_new_tokens=10, stop_ids=())
  assert expected.tokens == specjax.generate(dequantized, prompts, max_new_tokens=10, stop_ids=()).tokens
  out = specjax.generate(quantized, prompts, max_new_tokens=10, stop_ids=(), gamma=3, adaptive=False,
                         drafter=specjax.make_drafter("prompt_lookup", quantized))
  assert out.tokens == expected.tokens


def test_decoding_on_a_cpu_keeps_int8_weights_as_they_are(models):
  """The CPU's packing (float panels, GGUF blocks side by side) leaves int8 weights to their jnp product."""
  _, quantized, _ = models
  layer = decode_params(quantized)["layers"][0]
  assert all(isinstance(layer[name], int8.Int8) for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
  assert "wqkv" not in layer and "w_gate_up" not in layer


def test_int8_weights_store_about_a_quarter_of_float32s_bytes_and_draft_costs_count_them(models):
  dense, quantized, _ = models
  size = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  assert 0.25 < size(quantized.params) / size(dense.params) < 0.3  # codes, scales and float32 norms
  layers = [size(layer) for layer in quantized.params["layers"]]
  head = size(quantized.params["lm_head" if "lm_head" in quantized.params else "embed"])
  norm = size(quantized.params["final_norm"])
  assert leviathan.draft_cost(quantized.params, quantized.config, [0]) == pytest.approx(
      (head + norm + layers[0]) / (head + norm + sum(layers)))


def test_abstract_int8_params_split_the_codes_as_their_matrix_and_the_scales_as_its_channels():
  """`sharding.abstract_params(..., weights="int8")`: codes of each matrix's shape in int8 with its sharding, scales of
  its output axes in the config's dtype with theirs; norms of the config's dtype."""
  config = TINY_CONFIG.replace(dtype="bfloat16", num_heads=8, num_kv_heads=4, head_dim=8)
  mesh = AbstractMesh((2, 4), ("data", "model"))
  specs = jax.tree.map(lambda s: sharding.logical_to_spec(s.axes, s.shape, mesh), int8.declare(param_shapes(config)),
                       is_leaf=is_spec)
  layer = specs["layers"][0]
  assert (layer["wq"].codes, layer["wq"].scale) == (P(None, "model", None), P("model", None))
  assert (layer["wo"].codes, layer["wo"].scale) == (P("model", None, None), P(None))
  assert (layer["w_down"].codes, layer["w_down"].scale) == (P("model", None), P(None))
  assert (layer["w_up"].codes, layer["w_up"].scale) == (P(None, "model"), P("model"))
  assert (specs["embed"].codes, specs["embed"].scale) == (P("model", None), P("model"))
  assert layer["attn_norm"] == P(None)
  abstract = sharding.abstract_params(config, sharding.make_mesh(1, 1), weights="int8")
  wq = abstract["layers"][0]["wq"]
  assert (wq.codes.shape, wq.codes.dtype, wq.scale.shape, wq.scale.dtype) == (
      (64, 8, 8), jnp.int8, (8, 8), jnp.bfloat16)
  assert abstract["embed"].transposed and abstract["layers"][0]["attn_norm"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="weights is one of"):
    sharding.abstract_params(config, sharding.make_mesh(1, 1), weights="int4")


def test_placing_int8_params_on_a_mesh_keeps_their_codes(models):
  _, quantized, _ = models
  placed = sharding.shard_params(quantized.params, quantized.config, sharding.make_mesh(1, 1))
  wq = placed["layers"][0]["wq"]
  assert isinstance(wq, int8.Int8) and wq.codes.dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(wq.codes), np.asarray(quantized.params["layers"][0]["wq"].codes))
