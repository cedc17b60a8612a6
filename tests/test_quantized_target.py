"""Speculative decoding on a quantized target (`specjax.load(..., quantized=True)`: the GGUF's blocks, multiplied by
the CPU kernels): every drafter family is lossless against the quantized target's own autoregressive decoding,
speculative sampling follows its distribution, what a step costs is priced by the bytes it stores, and an experiment
runs every method on it.

The targets are tiny: `tiny` with its matrices quantized by gguf's own quantizer to a mix of the types it quantizes
(tests/test_quantized.py `quantize_model`), and the tiny GGUF of tests/test_quantized.py (K-quants, a tied Q8_0
table, an F16 matrix dequantized at load). Drafters are fresh, with random parameters, as in tests/test_families.py.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

import specjax
from configs import compare_drafters
from experiments import cost_model, run
from specjax import leviathan, speculative
from specjax.drafters import draft_head
from specjax.backends import cpu
from tests.task_drafters import perturbed, tiered
from tests.test_families import DRAFTERS, TREES, _prompts
from tests.test_quantized import quantize_model, write_quantized_gguf
from tests.test_sampling_lossless import (SAMPLES, SETTINGS, always_accept, chi_square_pvalue, exact_joint,
                                          small_vocabulary_model, speculative_samples)

# One matrix of each kind of block gguf quantizes, each layer's products of several kinds (none fuse).
MIXED = {"wq": "Q4_0", "wk": "Q5_0", "wv": "Q8_0", "wo": "Q4_1", "w_gate": "Q4_1", "w_up": "Q4_0", "w_down": "Q8_0",
         "embed": "Q8_0", "lm_head": "Q4_1"}


@pytest.fixture(scope="module")
def quantized_tiny(tiny):
  return quantize_model(tiny, MIXED)


@pytest.fixture(scope="module")
def quantized_gguf_model(tmp_path_factory):
  path = write_quantized_gguf(tmp_path_factory.mktemp("quantized_target") / "tiny.gguf")
  with pytest.warns(UserWarning, match="dequantized to float32"):
    return specjax.load(path, quantized=True)


_REFERENCES: dict[str, list[list[int]]] = {}


def _autoregressive(model) -> list[list[int]]:
  """The quantized target's own greedy tokens for the prompts: the reference every drafter must equal."""
  if model.name not in _REFERENCES:
    _REFERENCES[model.name] = specjax.generate(model, _prompts(), max_new_tokens=14).tokens
  return _REFERENCES[model.name]


def _check_lossless(model, name, options, tree_nodes=None):
  drafter = specjax.make_drafter(name, model, **options)
  if drafter.params:
    drafter = perturbed(drafter, scale=0.2)
  out = specjax.generate(model, _prompts(), max_new_tokens=14, drafter=drafter, gamma=3, adaptive=False,
                         tree_nodes=tree_nodes)
  assert out.tokens == _autoregressive(model)
  assert sum(out.stats["proposed_per_row"]) > 0  # it drafted


def test_the_tiny_target_holds_every_matrix_as_blocks(quantized_tiny):
  layer = quantized_tiny.params["layers"][0]
  assert {name: layer[name].kind for name in MIXED if name in layer} == {
      name: "Q8_0" if kind == "Q5_0" else kind for name, kind in MIXED.items() if name in layer}
  assert quantized_tiny.params["embed"].transposed and quantized_tiny.params["lm_head"].kind == "Q4_1"


# In the fast tier, the drafter that reads most of the quantized target (the sequential module: its hidden states,
# embedding and head's columns; layer skip on a quantized target is tests/test_quantized.py's); the rest slow.
FAST = ("mtp_sequential",)
CHAIN_CASES = tiered(sorted(DRAFTERS), FAST)


@pytest.mark.parametrize("drafter", CHAIN_CASES)
def test_greedy_speculative_decoding_on_a_quantized_target_equals_its_autoregressive_decoding(drafter,
                                                                                              quantized_tiny):
  """Chains of 3 drafts, ragged rows: the drafters read the quantized target (its cache, its hidden states, its
  head's columns; a draft model's or adapter's layers initialised from its dequantized layers)."""
  _check_lossless(quantized_tiny, *DRAFTERS[drafter])


TREE_CASES = [pytest.param("mtp_sequential")] + [pytest.param(d, marks=pytest.mark.slow) for d in sorted(TREES)
                                                 if d != "mtp_sequential"]


@pytest.mark.parametrize("drafter", TREE_CASES)
def test_tree_speculative_decoding_on_a_quantized_target_equals_its_autoregressive_decoding(drafter, quantized_tiny):
  """A tree of nodes verified in one forward under the tree mask (a verification of 7 rows a batch row: the product
  kernel's rows, as a chain's are)."""
  _check_lossless(quantized_tiny, *DRAFTERS[drafter], tree_nodes=TREES[drafter])


# The tiny GGUF has 2 layers and 300 tokens: early exits after its first layer, a 1-layer draft, a truncated
# vocabulary of 100 of its tokens.
GGUF_TOKEN_MAP = list(range(0, 300, 3))
GGUF_DRAFTERS = {
    "exit_adapter": ("layer_skip", dict(adapter="fresh", exit_layer=1, mlp=True, token_map=GGUF_TOKEN_MAP)),
    "mtp_parallel": ("mtp_parallel", dict(path=None, num_heads=3, token_map=GGUF_TOKEN_MAP)),
    "mtp_sequential": ("mtp_sequential", dict(path=None, depth=3, token_map=GGUF_TOKEN_MAP)),
    "draft_model": ("draft_model", dict(draft="fresh", num_layers=1, token_map=GGUF_TOKEN_MAP)),
    "block": ("block", dict(path=None, block_size=4, token_map=GGUF_TOKEN_MAP)),
}


@pytest.mark.slow
@pytest.mark.parametrize("drafter", sorted(GGUF_DRAFTERS))
def test_greedy_speculative_decoding_on_a_k_quant_gguf_target_equals_its_autoregressive_decoding(drafter,
                                                                                                 quantized_gguf_model):
  """The trained drafters' families on a GGUF's own blocks (Q4_K, Q6_K, Q5_0 read as Q8_0, Q4_1, Q4_0, a tied Q8_0
  table, and a matrix of another type dequantized): tests/test_quantized.py has layer skip and prompt lookup."""
  _check_lossless(quantized_gguf_model, *GGUF_DRAFTERS[drafter])


# ------------------------------------------------------------------------------------- sampling

@pytest.fixture(scope="module")
def quantized_small_vocabulary(tiny_config):
  """The chi-square tests' target (a vocabulary of 16) quantized to Q4_0, and their independent float32 draft."""
  target = quantize_model(small_vocabulary_model(tiny_config, 0, 3), "Q4_0")
  return target, small_vocabulary_model(tiny_config, 7, 1)


@pytest.mark.slow
@pytest.mark.parametrize("verifier", ["speculative_verify", "always_accept"])
def test_speculative_sampling_on_a_quantized_target_follows_its_distribution(verifier, quantized_small_vocabulary,
                                                                            monkeypatch):
  """20k samples of the first three tokens (the prefill's, then a round of adaptive drafting by an independent
  float32 draft model) against the quantized target's exact joint: a chi-square test that passes, and that fails when
  the verifier accepts every draft (tests/test_sampling_lossless.py's planted bug)."""
  target, draft = quantized_small_vocabulary
  assert isinstance(target.params["layers"][0]["wq"], cpu.Quantized)
  sampling = SETTINGS[0]
  joint = exact_joint(target, sampling)
  if verifier == "speculative_verify":
    samples, stats = speculative_samples(target, draft, sampling)
    assert sum(stats["accepted_per_row"]) >= 300 and sum(stats["rejections_per_row"]) >= 300
    assert chi_square_pvalue(samples, joint) > 1e-3
    return
  monkeypatch.setattr(speculative, "speculative_verify", always_accept)
  speculative._speculative_program.clear()  # retrace with the broken rule
  try:
    samples, _ = speculative_samples(target, draft, sampling, samples=SAMPLES // 4)
  finally:
    monkeypatch.undo()
    speculative._speculative_program.clear()
  assert chi_square_pvalue(samples, joint) < 1e-6


# ------------------------------------------------------------------------------------- bytes and experiments

def _stored(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_a_quantized_targets_draft_costs_and_step_bytes_count_the_bytes_it_stores(quantized_tiny, tiny):
  """Layer skip's c (leviathan.draft_cost) is the share of the stored bytes a draft step reads: the blocks and their
  scales, not the float32 values they stand for; the roofline's bytes (cost_model.step_bytes) likewise."""
  params, config = quantized_tiny.params, quantized_tiny.config
  head, layers = _stored(params["lm_head"]) + _stored(params["final_norm"]), [_stored(x) for x in params["layers"]]
  assert leviathan.draft_cost(params, config, [0, 1]) == pytest.approx((head + sum(layers[:2])) /
                                                                       (head + sum(layers)))
  # A truncated head's columns are gathered as float32 (`draft_head.head_columns`): priced as the drafter holds them.
  columns = draft_head.head_columns(params, config, jnp.arange(8))
  assert columns.dtype == jnp.float32
  assert leviathan.draft_cost(params, config, [], head_columns=8) == pytest.approx(
      (columns.nbytes + _stored(params["final_norm"])) / (head + sum(layers)))
  assert _stored(params) < 0.4 * _stored(tiny.params)  # 4.5 to 8.5 bits a weight against 32
  stored = cost_model.step_bytes(config, 100, params=params)
  assert stored < 0.45 * cost_model.step_bytes(config, 100)
  cache = stored - cost_model.stored_weight_bytes(params, config)  # the same KV cache as the float32 model's
  assert cache == pytest.approx(cost_model.step_bytes(config, 100, params=tiny.params)
                                - cost_model.stored_weight_bytes(tiny.params, config))


@pytest.mark.slow  # an experiment end to end (the fast tier runs one in tests/test_experiments.py)
def test_an_experiment_on_a_quantized_target_checks_every_method_against_its_autoregressive_decoding(
    quantized_tiny, tmp_path, monkeypatch):
  """`config.quantized` loads the target with its blocks (`specjax.load(..., quantized=True)`); the baseline decodes
  that target, every drafter is checked against it, the costs' bytes are its stored bytes, and the report says so."""
  from tests.conftest import word_tokenizer
  target = specjax.Model(quantized_tiny.config, quantized_tiny.params, word_tokenizer(), "tiny-chat-quantized")
  loaded = []

  def load(name, dtype="float32", quantized=False):
    loaded.append((name, dtype, quantized))
    return target
  monkeypatch.setattr(run.specjax, "load", load)
  monkeypatch.setattr(run.projection, "read", lambda: {})
  config = compare_drafters.get_config("small")
  config.update(model="tiny-gguf", quantized=True, control=False, warmup=False, max_new_tokens=10, gamma=3, repeats=1,
                methods=({"name": "autoregressive"}, {"name": "prompt_lookup", "drafter": "prompt_lookup"},
                         {"name": "heads", "drafter": "mtp_parallel", "options": {"path": None, "num_heads": 3}}))
  config.prompts.categories, config.prompts.per_category = ("qa",), 2
  config.costs.repeats = 1
  results = run.run(config, str(tmp_path), name="quantized")
  assert loaded == [("tiny-gguf", "float32", True)]
  summary = results["summary"]
  assert summary["all_lossless"] is True and summary["lossless_failures"] == []
  costs = results["costs"]
  assert costs["target_step_bytes"] == pytest.approx(cost_model.step_bytes(
      target.config, costs["context_tokens"], params=target.params))
  text = (tmp_path / "results.md").read_text()
  assert "(quantized (GGUF blocks)), prompts: 2" in text
  assert "MB of weights as stored (the GGUF blocks and their scales) and KV cache" in text
  assert json.loads((tmp_path / "results.json").read_text())["config"]["quantized"] is True
