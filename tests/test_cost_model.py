"""The analytic cost model (experiments/cost_model.py) counts what a reader counts by hand, and its validation is what
the measurement files and the model give today."""

from __future__ import annotations

import json
import math
import os

import pytest

import jax

from experiments import cost_model as cm
from experiments import costs, projection
from specjax.config import shaped_config
from specjax.model import layer_shapes

ROOT = cm.ROOT
SMOLLM2 = shaped_config("smollm2-135m")  # float32
GEMMA = shaped_config("gemma3-270m")


def _matrix_params_per_layer(config) -> int:
  return sum(math.prod(s.shape) for s in layer_shapes(config).values() if len(s.shape) >= 2 and "embed" in s.axes)


def test_a_target_step_reads_every_weight_once_and_of_the_embedding_only_its_rows():
  s = cm.Setting(SMOLLM2, whole_cache=False)
  step = cm.target(s, 1)
  assert step.weight_bytes == SMOLLM2.num_params * 4 + SMOLLM2.hidden_size * 4  # the tied head reads the table
  assert step.products == 7 * 30 + 1
  head = cm.head(s, SMOLLM2.vocab_size, 1).weight_bytes
  assert round(head / step.weight_bytes, 2) == 0.21  # SmolLM2's LM head: 576 x 49,152 of 134.5M weights
  gemma = cm.target(cm.Setting(GEMMA), 1)
  assert round(cm.head(cm.Setting(GEMMA), GEMMA.vocab_size, 1).weight_bytes / gemma.weight_bytes, 2) == 0.63
  llama = shaped_config("llama-3.1-8b", "bfloat16")  # an untied head: the embedding table itself is not read
  d, v = llama.hidden_size, llama.vocab_size
  assert cm.target(cm.Setting(llama), 1).weight_bytes == (llama.num_params - v * d) * 2 + d * 2


def _kv_bytes_per_position(config) -> int:
  return 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # float32


def test_the_cache_read_is_the_slots_in_use_on_the_cpu_and_the_whole_buffer_on_an_accelerator():
  for config, positions in ((SMOLLM2, 145), (GEMMA, 1120)):  # Gemma: 15 sliding layers read at most 512 slots
    per_layer = _kv_bytes_per_position(config) / config.num_layers
    read = sum(per_layer * min(positions, config.window(i) or positions) for i in range(config.num_layers))
    cpu = cm.target(cm.Setting(config, cache_len=1280, positions=positions, whole_cache=False), 1)
    assert cpu.cache_bytes == pytest.approx(read + _kv_bytes_per_position(config))
    accelerator = cm.target(cm.Setting(config, cache_len=1280, positions=positions), 5)
    assert accelerator.cache_bytes == (1280 + 5) * _kv_bytes_per_position(config)


def test_one_devices_step_bytes_are_the_weights_a_step_reads_and_the_cache_in_use(tiny):
  """The roofline of the experiments' runs and benchmarks (`step_bytes`: the count at one device of this CPU) by
  hand from a model's parameters: every array once but the untied embedding table, of which the gathered rows."""
  config = tiny.config
  assert not config.tie_embeddings
  weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(tiny.params)) - tiny.params["embed"].nbytes
  row = _kv_bytes_per_position(config)
  for rows, tokens in ((1, 1), (2, 1), (2, 5)):
    assert cm.step_bytes(config, 100, rows, tokens) == weights + rows * tokens * config.hidden_size * 4 + rows * (
        100 + tokens) * row
  r = cm.step_bytes(config, 100, 1, 5) / cm.step_bytes(config, 100)
  assert 1 < r < 1.1  # a verification reads what a 1-token step reads, and writes 4 more rows
  at_mesh = cm.target(cm.Setting(config, batch=2, positions=100, whole_cache=False, data=1, model=1), 1)
  assert cm.step_bytes(config, 100, 2) == at_mesh.weight_bytes + at_mesh.cache_bytes


def test_the_lm_heads_share_is_the_head_pass_over_the_step():
  """publish's README answer quotes `head_share`: the `head` pass's weights over a 1-token step's."""
  for config in (SMOLLM2, GEMMA, shaped_config("llama-3.1-8b", "bfloat16")):
    s = cm.one_device(config, 1)
    assert cm.head_share(config) == cm.head(s, config.vocab_size, 1).weight_bytes / cm.target(s, 1).weight_bytes
  d, v = SMOLLM2.hidden_size, SMOLLM2.vocab_size
  assert cm.head_share(SMOLLM2) == pytest.approx((d * v + d) / (SMOLLM2.num_params + d))  # tied: the table is read
  assert round(cm.head_share(SMOLLM2), 2) == 0.21 and round(cm.head_share(GEMMA), 2) == 0.63


def test_the_flops_are_the_products_and_the_attention_by_hand():
  s = cm.Setting(SMOLLM2, cache_len=256, positions=145, whole_cache=False)
  products = 30 * _matrix_params_per_layer(SMOLLM2) + SMOLLM2.vocab_size * SMOLLM2.hidden_size
  attention = 4 * SMOLLM2.num_heads * SMOLLM2.head_dim * 145 * 30
  assert cm.target(s, 1).flops == 2 * products + attention
  assert cm.target(s, 5).flops == 5 * (2 * products + attention)


def test_collectives_are_none_on_one_device_and_grow_with_the_model_axis():
  one = cm.Setting(GEMMA, batch=8)
  recipes = cm.projected_drafters(GEMMA, 32768)
  assert cm.target(one, 5).sent_bytes == 0
  assert all(cm.propose(one, d, 4).sent_bytes == cm.update(one, d, 4).sent_bytes == 0 for _, d in recipes.values())
  d, itemsize, layers = GEMMA.hidden_size, 4, GEMMA.num_layers
  for model in (2, 4):
    s = cm.Setting(GEMMA, batch=8, data=2, model=model)
    rows, tokens = 4, 5
    all_reduce = 2 * (model - 1) / model * rows * tokens * d * itemsize
    # Gemma's 4 heads and its MLP split: two all-reduces a layer, one after the embedding gather; the argmax over the
    # split vocabulary gathers a (max, index) pair per shard.
    expected = (2 * layers + 1) * all_reduce + (model - 1) * rows * tokens * 8
    assert cm.target(s, tokens).sent_bytes == pytest.approx(expected)
  # SmolLM2's 9 query heads do not divide 4: its attention stays whole, so only the MLP's all-reduce is left
  smol = cm.Setting(SMOLLM2, batch=8, data=2, model=4)
  per_layer = cm.layers(smol, [0], 1).sent_bytes
  assert per_layer == pytest.approx(smol.all_reduce(1))


def test_the_overhead_moves_c_and_r_as_the_formula_says():
  """With a memory-bound step t = bytes / B + N o: c = (b_d / B + N_d o) / (b_t / B + N_t o), which the fitted o moves
  from the bytes' ratio toward the products' ratio; r stays 1 plus its extra bytes, and moves toward 1."""
  s = cm.Setting(shaped_config("smollm2-135m", "bfloat16"), cache_len=256, positions=145)
  draft = cm.measured_drafters(s.config)["budget_draft"]
  device = cm.Device("d", 1e12, 1e18)
  step, verify, proposal = cm.target(s, 1), cm.target(s, 5), cm.propose(s, draft, 4)
  moved = []
  for extra in (0.0, 1e-3, 1.0):
    fitted = cm.fit_overhead(device, (step.weight_bytes + step.cache_bytes) / 1e12 + extra, step)
    o = fitted.overhead_seconds
    assert o == pytest.approx(extra / step.products)
    c = cm.seconds(proposal, fitted) / 4 / cm.seconds(step, fitted)
    expected = ((proposal.weight_bytes + proposal.cache_bytes) / 1e12 + proposal.products * o) / 4 / (
        (step.weight_bytes + step.cache_bytes) / 1e12 + step.products * o)
    assert c == pytest.approx(expected)
    r = cm.seconds(verify, fitted) / cm.seconds(step, fitted)
    moved.append((c, r))
  assert moved[0][0] == pytest.approx((proposal.weight_bytes + proposal.cache_bytes) / 4 /
                                      (step.weight_bytes + step.cache_bytes))
  assert moved[-1][0] == pytest.approx(proposal.products / 4 / step.products, rel=1e-3)
  assert moved[0][1] > moved[1][1] > moved[2][1] > 1.0
  # an overhead the step's own terms already exceed is not negative
  assert cm.fit_overhead(device, 0.0, step).overhead_seconds == 0.0


def test_a_drafters_programs_count_its_own_work():
  s = cm.Setting(SMOLLM2, cache_len=256, positions=145)
  d, v, vocab = SMOLLM2.hidden_size, SMOLLM2.vocab_size, 8192
  heads = cm.propose(s, cm.mtp_parallel(4, vocab), 4)  # 4 residual blocks, the truncated head once over 4 rows
  assert heads.weight_bytes == (4 * d * d + 4 * d + d + d * vocab) * 4
  assert heads.products == 2 and heads.flops == 2 * (4 * d * d) + 2 * 4 * d * vocab
  exit24 = cm.propose(s, cm.layer_skip(SMOLLM2, exit_layer=24), 4)  # 24 layers and the whole head, 4 times
  assert exit24.products == 4 * (24 * 7 + 1)
  assert cm.propose(s, cm.prompt_lookup(), 4).weight_bytes == 0
  eagle3 = cm.mtp_sequential(SMOLLM2, 4, recurrent=True, eagle3=True, draft_vocab=vocab)
  chain = cm.mtp_sequential(SMOLLM2, 4, recurrent=False, eagle3=False, draft_vocab=vocab)
  assert cm.update(s, eagle3, 4).products == 1 + 1 + 7  # the 3D -> D projection, the input product, the block
  assert cm.update(s, chain, 4).products == 1 + 7 + 3 * 3  # module 1 whole; modules 2-4 write keys and values
  draft = cm.draft_model(SMOLLM2, 4, vocab)
  assert draft.layers == (0, 10, 19, 29)
  own = cm.propose(s, draft, 4)
  assert own.products == 4 * (4 * 7 + 1)
  assert v > vocab and own.weight_bytes < 4 * cm.target(s, 1).weight_bytes


def test_the_validation_is_what_the_files_and_the_model_give():
  """Every row of results/cost_model/results.json: the measured value read again from its file, the predicted one
  computed again, the error and the verdict from those (a stale file or a changed model fails here)."""
  with open(os.path.join(ROOT, cm.OUT, "results.json")) as f:
    results = json.load(f)
  rows = []
  for run in cm.CPU_RUNS:
    rows += cm.validate_cpu(run, results["rates"])[0]
  for path in cm.H200_RUNS:
    rows += cm.validate_h200(path)[0]
  assert len(rows) == len(results["validation"])
  for again, row in zip(rows, results["validation"]):
    assert (again["device"], again["method"], again["quantity"]) == (row["device"], row["method"], row["quantity"])
    assert again["measured"] == row["measured"]
    assert again["predicted"] == pytest.approx(row["predicted"], rel=1e-9)
    assert row["error"] == pytest.approx(row["predicted"] / row["measured"] - 1)
    assert row["within"] == (abs(row["predicted"] - row["measured"]) <= max(0.2 * abs(row["measured"]), 0.01))
  budget = json.load(open(os.path.join(ROOT, "results", "compare_drafters-budget", "results.json")))["costs"]
  row = next(r for r in results["validation"] if r["method"] == "budget_draft" and r["quantity"] == "c"
             and r["source"].endswith("compare_drafters-budget/results.json"))
  assert row["measured"] == budget["methods"]["budget_draft"]["draft_cost"]


def test_tree_costs_grow_with_their_nodes():
  """A tree's verification grows with its nodes (the target over N + 1 tokens, the path moved), prompt lookup's
  proposal with its branches; a model drafter's proposal expands min(8, V') nodes per depth whatever N."""
  s = cm.Setting(SMOLLM2, batch=8, cache_len=4096, positions=1024, data=2, model=4)
  verify = [cm.verify_tree(s, n, 4) for n in (7, 16, 32)]
  assert all(a.flops < b.flops and a.cache_bytes < b.cache_bytes for a, b in zip(verify, verify[1:]))
  assert verify[0].flops > cm.target(s, 5).flops  # a tree of 7 nodes verifies 8 tokens, a chain of 4 five
  moved = verify[1].cache_bytes - cm.target(s, 17).cache_bytes  # the accepted path: 5 slots read and written a layer
  assert moved == 30 * 2 * 4 * 5 * cm.per_slot(s)
  lookup = [cm.propose_tree(s, cm.prompt_lookup(), 4, n).cache_bytes for n in (4, 16, 32)]
  assert lookup == [cm.propose(s, cm.prompt_lookup(), 4).cache_bytes * k for k in (1, 4, 8)]
  draft = cm.draft_model(SMOLLM2, 4, 8192)
  grown = cm.propose_tree(s, draft, 4, 16)
  assert grown == cm.propose_tree(s, draft, 4, 32)  # 8 nodes expanded per depth, whatever the tree keeps
  assert grown.products == cm.propose(s, draft, 4).products  # a forward per depth, as the chain's
  assert grown.flops > cm.propose(s, draft, 4).flops  # over 8 nodes a row, not one
  assert cm.update(s, draft, 4, tree=True).products == 4 * 7  # its nodes wrote no cache: the path is read after
  assert cm.update(s, draft, 4).products == 0
  device = cm.tpu("v5e:2x4")
  rounds = [cm.round_seconds(s, draft, 4, device, n) for n in (None, 16, 32)]
  assert rounds[0]["verify_seconds"] < rounds[1]["verify_seconds"] < rounds[2]["verify_seconds"]


def test_a_block_drafts_gamma_tokens_in_one_forward():
  """specjax/drafters/block.py: the pending token's anchor (one product), one forward of its blocks over [pending,
  mask x gamma], the head over gamma slots: every weight read once whatever gamma (c falls as 1 / gamma), where a
  chain reads its weights per token."""
  s = cm.Setting(SMOLLM2, cache_len=256, positions=145)
  one, two = cm.block_drafter(SMOLLM2, 1, 8192), cm.block_drafter(SMOLLM2, 2, 8192)
  assert one.features == 3  # EAGLE-3's three feature layers
  at = {g: cm.propose(s, one, g) for g in (1, 2, 4)}
  assert at[4].products == 1 + 7 + 1  # the anchor's, one block's 7 products and the head's, once
  assert at[1].weight_bytes == pytest.approx(at[4].weight_bytes, rel=1e-3)  # + 3 rows of the head's gather, no more
  assert cm.propose(s, two, 4).products == 1 + 2 * 7 + 1
  d = SMOLLM2.hidden_size
  assert at[4].flops > at[1].flops  # 5 positions a block, the head over 4 slots
  chain = cm.mtp_sequential(SMOLLM2, 4, recurrent=True, eagle3=True, draft_vocab=8192)
  assert cm.propose(s, chain, 4).products == 1 + 3 * (1 + 7 + 1)  # the head, then 3 module steps
  assert cm.propose_tree(s, one, 4, 16) == at[4]  # a tree from the same slots' distributions
  update = cm.update(s, two, 4)  # W_f over 3 layers' features, each block's keys and values of 5 positions
  assert update.products == 1 + 2 * 2 and update.weight_bytes == (3 * d * d + 2 * 2 * d * 192) * 4
  device = cm.Device("d", 1e12, 1e18)
  costs = [cm.seconds(cm.propose(s, one, g), device) / g for g in (1, 2, 4)]
  assert costs[0] > 1.9 * costs[1] > 3.6 * costs[2]


def test_the_projection_reads_the_cost_models_rounds_chains_and_trees():
  costs_of = projection.read()  # the consumers' default: the cost model's file, smollm2-135m, v5e:2x4, batch 8
  assert next(iter(costs_of.values()))["source"] == f"{projection.COSTS_FILE} (smollm2-135m, v5e:2x4, batch 8)"
  with open(os.path.join(ROOT, projection.COSTS_FILE)) as f:
    projected = json.load(f)["projections"]
  mine = [p for p in projected if (p["model"], p["topology"], p["batch"]) == ("smollm2-135m", "v5e:2x4", 8)]
  assert {p["acceptance_of"] for p in mine} == set(costs_of)
  for p in mine:
    cost = costs_of[p["acceptance_of"]]
    assert cost["tree_nodes"] == p["tree_nodes"] and cost["gamma"] == p["gamma"]
    assert projection.break_even_tau(cost) == pytest.approx(p["break_even_tau"])
    if p["tau"] is not None:
      assert projection.speedup(p["tau"], cost) == pytest.approx(p["projected_speedup"])
  trees = {name: c for name, c in costs_of.items() if c["tree_nodes"]}
  # configs/compile_tpu.py's drafters' trees, of its sizes and of those configs/trees.py measured
  assert {"mtp_sequential_tree16", "mtp_sequential_tree32", "mtp_sequential_tree7", "budget_deepseek_tree16",
          "prompt_lookup_tree8", "draft_model_tree32"} <= set(trees)
  assert costs_of["draft_model_tree16"]["verify_cost"] < costs_of["draft_model_tree32"]["verify_cost"]
  with pytest.raises(ValueError, match="projects no drafter"):
    projection.read(model="smollm2-135m", topology="v5e:2x4", batch=3)


def test_the_flop_rate_is_measured_beside_the_bandwidth():
  assert 0 < costs.measure_flop_rate((8, 16, 8), repeats=2) < 1e16
