"""Compiling for TPU topologies without a TPU (experiments/compile_for.py, configs/compile_tpu.py).

The tests marked `tpu_compile` run the TPU compiler (libtpu) on abstract devices, in a command of their own:
`pip install -e '.[tpu]' && python -m pytest tests/test_tpu_compile.py -m tpu_compile -q` (README, Tests; CI runs
it after the whole suite).
Without `-m tpu_compile` they are deselected (conftest.py), and selected without libtpu they fail with the install
command. The rest check the grid, the projection's arithmetic, the model shapes and the published run without it.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import compile_tpu
from experiments import compile_for, projection
from specjax import sharding
from specjax.config import MODEL_SHAPES, shaped_config

RESULTS = os.path.join(os.path.dirname(__file__), "..", "results", "tpu_compile", "results.json")


@pytest.fixture(scope="module")
def libtpu():
  if importlib.util.find_spec("libtpu") is None:
    pytest.fail("the tpu_compile tests compile for TPU topologies with libtpu: pip install -e '.[tpu]'")


def small_shapes(config, target):
  """SmolLM2's shapes and config's drafters on `target`, at a short prompt and cache (compiling takes as long)."""
  config.batch_size, config.prompt_len, config.cache_len = 4, 64, 256
  return compile_for.model_shapes(shaped_config("smollm2-135m", config.dtype), 8192, target, config,
                                  projection.measured_acceptance(config.acceptance))


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_the_speculative_program_compiled_for_a_v5e_slice_holds_no_cpu_custom_call(libtpu):
  """generate's speculative program (SmolLM2 in bf16, the parallel MTP heads, adaptive drafting), with the sharding
  rules on a (data, model) mesh of v5e:2x4's abstract devices: the TPU compiler builds it, and neither the lowered
  nor the compiled program calls specjax's CPU kernels. Lowered for this host's CPU, the same program calls the
  attention kernel: its shapes are ones the kernel takes, so only the platform keeps it out of the TPU's."""
  config = compile_tpu.get_config()
  on_cpu = compile_for.Target("cpu", sharding.make_mesh(1, 1), 0.0, 1.0, 1.0)
  (lowering,) = compile_for.generate_programs(small_shapes(config, on_cpu), config, "speculative", ("mtp_parallel",))
  assert "specjax_decode_attention" in lowering.lower().as_text()
  (lowering,) = compile_for.generate_programs(small_shapes(config, compile_for.tpu_target("v5e:2x4", 2, 4)), config,
                                              "speculative", ("mtp_parallel",))
  lowered = lowering.lower()
  assert "specjax_" not in lowered.as_text()
  compiled = lowered.compile()
  assert "specjax_" not in compiled.as_text()
  memory = compiled.memory_analysis()
  assert 0 < memory.argument_size_in_bytes < compile_for.CHIPS["v5e"].hbm_bytes


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_a_tree_drafting_speculative_program_compiled_for_a_v5e_slice_holds_no_cpu_custom_call(libtpu):
  """generate(..., tree_nodes=16)'s program (rounds of the parallel MTP heads' chains or trees, a tree verified
  under a tree mask, as the policy chooses) for a v5e:2x4 slice: compiled by the TPU compiler without a call of
  specjax's CPU kernels, which the same program lowered for this host's CPU makes (the cache part of the tree's
  attention). Two of SmolLM2's layers: the kernels' choice is per program, not per layer, and compiling stays short."""
  config = compile_tpu.get_config()
  config.batch_size, config.prompt_len, config.cache_len = 4, 64, 256
  config.drafters = tuple(d for d in config.drafters if d["name"] == "mtp_parallel")
  two_layers = dataclasses.replace(shaped_config("smollm2-135m", config.dtype), num_layers=2)

  def tree_program(target):
    shapes = compile_for.model_shapes(two_layers, 8192, target, config,
                                      projection.measured_acceptance(config.acceptance))
    chain, tree = compile_for.generate_programs(shapes, config, "speculative", ("mtp_parallel",), tree_nodes=(16,))
    assert (chain.tree_nodes, tree.tree_nodes, tree.static["policy"].tree_nodes) == (None, 16, 16)
    return tree
  on_cpu = compile_for.Target("cpu", sharding.make_mesh(1, 1), 0.0, 1.0, 1.0)
  assert "specjax_decode_attention" in tree_program(on_cpu).lower().as_text()
  lowered = tree_program(compile_for.tpu_target("v5e:2x4", 2, 4)).lower()
  assert "specjax_" not in lowered.as_text()
  compiled = lowered.compile()
  assert "specjax_" not in compiled.as_text()
  assert 0 < compiled.memory_analysis().argument_size_in_bytes < compile_for.CHIPS["v5e"].hbm_bytes


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_a_gemma_speculative_program_compiled_for_a_v5e_slice_holds_no_cpu_custom_call(libtpu):
  """generate's speculative program for a Gemma-3-270M-shaped target (GeGLU, QK norms, four norms a layer, a
  262,144-token vocabulary, one KV head) cut to one sliding and one full layer, with the sequential MTP module
  drafting over the families config's truncated vocabulary: lowered for this host's CPU it calls the attention kernel
  (its sliding layer's too), and for v5e:2x4 the TPU compiler builds it with no call of specjax's CPU kernels."""
  config = compile_tpu.get_config("families")
  config.batch_size, config.prompt_len, config.cache_len = 4, 64, 256
  config.drafters = tuple(d for d in config.drafters if d["name"] == "mtp_sequential")
  gemma = shaped_config("gemma3-270m", config.dtype)
  two_layers = dataclasses.replace(gemma, num_layers=2, layer_kinds=("sliding", "full"))
  draft_vocab = next(m["draft_vocab"] for m in config.models if m["name"] == "gemma3-270m")

  def program(target):
    shapes = compile_for.model_shapes(two_layers, draft_vocab, target, config,
                                      projection.measured_acceptance(config.acceptance))
    (chain,) = compile_for.generate_programs(shapes, config, "speculative", ("mtp_sequential",))
    return chain
  on_cpu = compile_for.Target("cpu", sharding.make_mesh(1, 1), 0.0, 1.0, 1.0)
  assert "specjax_decode_attention" in program(on_cpu).lower().as_text()
  lowered = program(compile_for.tpu_target("v5e:2x4", 2, 4)).lower()
  assert "specjax_" not in lowered.as_text()
  compiled = lowered.compile()
  assert "specjax_" not in compiled.as_text()
  assert 0 < compiled.memory_analysis().argument_size_in_bytes < compile_for.CHIPS["v5e"].hbm_bytes


def int8_records(shape: str, layers: int | None = None) -> list[dict]:
  """The int8 grid's decode step and verification (and prompt lookup's draft) of one target shape, with bf16 and with
  int8 weights, compiled for v5e:2x4 at a short prompt and cache; `layers`: the shape cut to that many layers."""
  config = compile_tpu.get_config("int8")
  config.batch_size, config.prompt_len, config.cache_len = 4, 64, 256
  config.models = tuple(m for m in config.models if m.get("shape", m["name"]) == shape)
  config.runs = (dict(config.runs[0], models=tuple(m["name"] for m in config.models), programs=("steps",)),)
  model_configs = {}
  if layers:
    cut = dataclasses.replace(shaped_config(shape, config.dtype), num_layers=layers)
    cut = dataclasses.replace(cut, layer_kinds=cut.layer_kinds[:layers]) if cut.layer_kinds else cut
    model_configs = {m["name"]: cut for m in config.models}
  return compile_for.compile_all(config, progress=lambda line: None, model_configs=model_configs)


def check_int8_against_bf16(records: list[dict]) -> None:
  """Every program compiled without a call of specjax's CPU kernels; each int8 decode step and verification holds
  fewer bytes per chip than its bf16 twin, its arguments (weights and cache) too; results.md's table pairs them."""
  assert records and all(r["status"] == "compiled" and r["cpu_kernel_calls"] == 0 for r in records)
  by = {(r["weights"], r["program"], r["drafter"]): r for r in records}
  for program in ("decode_step", "verify_5"):
    dense, quantized = by["bfloat16", program, None], by["int8", program, None]
    assert quantized["bytes_per_device"] < dense["bytes_per_device"]
    assert quantized["memory"]["arguments"] < dense["memory"]["arguments"]
  table = "\n".join(compile_for.weights_table(records))
  assert "## int8 weights against the config's dtype" in table and "| decode_step |" in table


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_int8_decode_and_verification_for_a_v5e_slice_hold_no_cpu_custom_call_and_less_than_bf16(libtpu):
  """SmolLM2-shaped (30 layers, a tied head): int8 codes and bf16 scales in the decode step and the verification
  compiled for v5e:2x4; lowered for this host's CPU the same int8 step calls the attention kernel, so only the
  platform keeps the kernels out of the TPU's program (and no CPU product kernel ever takes int8 weights)."""
  check_int8_against_bf16(int8_records("smollm2-135m"))
  config = compile_tpu.get_config("int8")
  config.batch_size, config.prompt_len, config.cache_len = 4, 64, 256
  on_cpu = compile_for.Target("cpu", sharding.make_mesh(1, 1), 0.0, 1.0, 1.0)
  shapes = compile_for.model_shapes(shaped_config("smollm2-135m", config.dtype), 8192, on_cpu, config,
                                    projection.measured_acceptance(config.acceptance), weights="int8")
  decode = compile_for.step_programs(shapes, config, ("prompt_lookup",))[0]
  text = decode.lower().as_text()
  assert decode.name == "decode_step" and "specjax_decode_attention" in text and "specjax_quantized" not in text


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_int8_decode_and_verification_of_a_qwen3_8b_shape_for_a_v5e_slice_hold_no_cpu_custom_call(libtpu):
  """Qwen3-8B-shaped (QK norms, an untied head of 151,936 columns) cut to two layers: the int8 programs compile for
  v5e:2x4 without a CPU kernel and with fewer bytes per chip than bf16's."""
  check_int8_against_bf16(int8_records("qwen3-8b", layers=2))


def test_the_int8_grid_compiles_each_target_with_bf16_and_with_int8_weights():
  config = compile_tpu.get_config("int8")
  grid = compile_for.blocks(config)
  models = {m["name"]: m for m in config.models}
  shapes = [shape for shape, _ in compile_tpu.INT8_SHAPES]
  assert sorted(models) == sorted(shapes + [f"{shape} int8" for shape in shapes])
  assert all(models[f"{shape} int8"] == {"name": f"{shape} int8", "shape": shape, "weights": "int8",
                                         "draft_vocab": models[shape]["draft_vocab"]} for shape in shapes)
  assert {(m, t[0], p) for m, t, p, _, _ in grid} == {(m, "v5e:2x4", p) for m in models
                                                       for p in ("autoregressive", "steps")}
  assert {d for _, _, _, drafters, _ in grid for d in drafters} == {"prompt_lookup"}


def test_the_int8_table_pairs_each_int8_program_with_its_twin_of_the_same_shape():
  def record(model, shape, weights, program, gib, arguments):
    return {"model": model, "shape": shape, "weights": weights, "topology": "v5e:2x4", "kind": "steps",
            "program": program, "drafter": None, "tree_nodes": None, "status": "compiled",
            "bytes_per_device": gib * 2**30, "memory": {"arguments": arguments * 2**30}, "bytes_accessed": 2e9 * gib,
            "cpu_kernel_calls": 0}
  records = [record("m", "m", "bfloat16", "decode_step", 2.0, 1.5),
             record("m int8", "m", "int8", "decode_step", 1.0, 0.75),
             record("m int8", "m", "int8", "verify_5", 1.0, 0.75)]  # no bf16 twin: not in the table
  lines = compile_for.weights_table(records)
  assert lines[-1] == "| m int8 | v5e:2x4 | decode_step | 2.00 | 1.00 | 0.50 | 1.50 | 0.75 | 4.00 | 2.00 | 0 |"
  assert sum(line.startswith("| m int8") for line in lines) == 1
  assert compile_for.weights_table(records[:1]) == []


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_a_program_larger_than_the_chips_memory_is_reported_as_not_fitting(libtpu, tiny_config):
  # One layer, and an embedding of 2^22 x 2048 bf16 (16 GiB) on a single v5e chip (16 GiB of HBM).
  huge = dataclasses.replace(tiny_config, vocab_size=2**22, hidden_size=2048, intermediate_size=512, num_layers=1,
                             num_heads=32, num_kv_heads=8, head_dim=64, dtype="bfloat16")
  config = compile_tpu.get_config()
  config.models = ({"name": "huge", "draft_vocab": 128},)
  config.topologies = (("v5e:1x1", 1, 1),)
  config.batch_size, config.prompt_len, config.cache_len = 1, 32, 128
  config.drafters = ()
  config.runs = ({"models": ("huge",), "topologies": ("v5e:1x1",), "programs": ("prefill",)},)
  records = compile_for.compile_all(config, progress=lambda line: None, model_configs={"huge": huge})
  assert [r["status"] for r in records] == ["does_not_fit"]
  assert "RESOURCE_EXHAUSTED" in records[0]["error"] or "memory" in records[0]["error"]
  # A rerun keeps the records a stopped run made (compile_for.compile_log) instead of compiling again.
  kept = dict(records[0], status="kept")
  again = compile_for.compile_all(config, progress=lambda line: None, model_configs={"huge": huge},
                                  done={compile_for.record_key(kept): kept})
  assert again == [kept]


def test_a_rerun_keeps_the_records_of_a_stopped_run_of_the_same_config(tmp_path):
  config, log = compile_tpu.get_config(), str(tmp_path / "records.jsonl")
  assert compile_for.compile_log(log, config).entries == []  # a new log, headed by the config
  record = {"model": "m", "topology": "v5e:2x4", "kind": "steps", "program": "decode_step", "drafter": None,
            "tree_nodes": None, "status": "compiled"}
  compile_for.compile_log(log, config).append(record)
  with open(log, "a") as f:
    f.write('{"model": "m", "topol')  # the second record cut by a kill
  kept = compile_for.compile_log(log, config)
  assert kept.entries == [record]
  kept.append(dict(record, program="prefill"))  # after the cut line was dropped, not joined to it
  assert [r["program"] for r in compile_for.compile_log(log, config).entries] == ["decode_step", "prefill"]
  config.runs = config.runs[:1]  # another grid of programs built alike: the records are kept
  assert len(compile_for.compile_log(log, config).entries) == 2
  config.batch_size = 4  # programs built otherwise: the log starts again, the old one moved aside
  assert compile_for.compile_log(log, config).entries == []
  assert compile_for.compile_log(log, config).entries == []
  stale, = tmp_path.glob("records.jsonl.*.stale")
  assert len(stale.read_text().splitlines()) == 3


def test_a_resume_ignores_the_grid_and_a_projection_again_ignores_where_acceptance_is_read():
  old = json.loads(json.dumps(compile_tpu.get_config().to_dict()))
  new = copy.deepcopy(old)
  new["runs"] = new["runs"][:1]
  new["acceptance"] = "elsewhere/results.json"
  new["drafters"][0]["acceptance_of"] = "another_method"
  name = new["drafters"][0]["name"]
  assert compile_for.config_differences(old, new) == ["acceptance", "runs", f"drafters.{name}"]
  # a resume keeps the acceptance (a drafter's gamma, so its programs, come from it); a reprojection keeps the grid
  assert compile_for.config_differences(old, new, compile_for.GRID_KEYS) == ["acceptance", f"drafters.{name}"]
  assert compile_for.config_differences(old, new, compile_for.ACCEPTANCE_KEYS,
                                        compile_for.DRAFTER_ACCEPTANCE_KEYS) == ["runs"]


@pytest.mark.tpu_compile
def test_a_topology_gives_its_devices_and_the_chips_published_figures(libtpu):
  target = compile_for.tpu_target("v2:2x2", 2, 4)  # Colab's v2-8: 4 chips of 2 TensorCores, one device each
  assert dict(target.mesh.shape) == {"data": 2, "model": 4}
  assert target.hbm_bytes == 8 * 2**30 and target.bf16_flops_per_second == 23e12
  single = compile_for.tpu_target("v5e:1x1", 1, 1)
  assert single.mesh.size == 1 and single.hbm_bytes_per_second == 819e9
  with pytest.raises(ValueError, match="expected <generation>"):
    compile_for.tpu_target("v9z:2x4", 2, 4)


def test_the_cover_grid_has_every_program_on_every_topology_and_every_model():
  config = compile_tpu.get_config("cover")
  grid = compile_for.blocks(config)
  topologies = {t[0] for t in config.topologies}
  drafters = tuple(d["name"] for d in config.drafters)
  # Every program a user runs (the projection's step programs are the default grid's, on every topology too).
  assert {(t[0], p) for _, t, p, _, _ in grid} == {(t, p) for t in topologies for p in compile_tpu.USER_PROGRAMS}
  assert set(compile_tpu.USER_PROGRAMS) == set(compile_for.PROGRAMS) - {"steps"}
  assert {m for m, _, _, _, _ in grid} == {m["name"] for m in config.models}
  assert all(d == drafters for _, _, _, d, _ in grid)
  # Trees where a program has them (speculative, steps), none elsewhere: of one size everywhere, every size for
  # SmolLM2's speculative program on v5e:2x4.
  sizes = {(m, t[0], p): nodes for m, t, p, _, nodes in grid}
  assert all(nodes == () for (_, _, p), nodes in sizes.items() if p not in compile_for.TREE_PROGRAMS)
  assert all(nodes == tuple(config.tree_nodes[:1]) for key, nodes in sizes.items()
             if key[2] in compile_for.TREE_PROGRAMS and key != ("smollm2-135m", "v5e:2x4", "speculative"))
  assert sizes["smollm2-135m", "v5e:2x4", "speculative"] == tuple(config.tree_nodes)
  assert len(grid) == len({(m, t, p) for m, t, p, _, _ in grid})


def test_missing_programs_names_each_program_a_user_runs_that_no_record_built():
  config = compile_tpu.get_config("small")  # SmolLM2 on v5e:2x4: prompt lookup and the sequential module, trees of 16
  keys = [("prefill", None, None), ("autoregressive", None, None), ("speculative", "prompt_lookup", None),
          ("speculative", "mtp_sequential", None), ("speculative", "prompt_lookup", 16),
          ("speculative", "mtp_sequential", 16)]
  records = [{"model": "smollm2-135m", "topology": "v5e:2x4", "kind": kind, "drafter": drafter, "tree_nodes": nodes,
              "status": "compiled"} for kind, drafter, nodes in keys]
  records.append(dict(records[0], kind="steps", program="decode_step"))  # the projection's: not counted
  assert compile_for.missing_programs(config, records) == []
  records[5]["status"] = "failed"
  records[2]["status"] = "does_not_fit"  # built, and too large for the chip: a finding, not a gap
  assert compile_for.missing_programs(config, records[1:]) == [
      "smollm2-135m v5e:2x4 prefill", "smollm2-135m v5e:2x4 speculative mtp_sequential tree 16"]
  # The published default run built every program a user runs that its grid asks for.
  with open(RESULTS) as f:
    published = json.load(f)
  assert compile_for.missing_programs(ml_collections.ConfigDict(published["config"]), published["records"]) == []
  # A config from before trees (no `tree_nodes`) asks for no trees.
  before = {k: v for k, v in config.to_dict().items() if k != "tree_nodes"}
  before["runs"] = [{k: v for k, v in block.items() if k != "tree_nodes"} for block in before["runs"]]
  chains = [r for r in records[1:] if not r["tree_nodes"]]
  assert compile_for.missing_programs(ml_collections.ConfigDict(before), chains) == ["smollm2-135m v5e:2x4 prefill"]


def test_the_default_grid_projects_every_drafter_on_every_topology():
  config = compile_tpu.get_config()
  grid = compile_for.blocks(config)
  drafters = tuple(d["name"] for d in config.drafters)
  steps = {t[0] for m, t, p, d, _ in grid if p == "steps" and m == "smollm2-135m" and d == drafters}
  assert steps == {t[0] for t in config.topologies}
  assert ("llama-3.1-8b", ("v5e:2x4", 2, 4), "speculative", ("mtp_sequential",), ()) in grid
  # The trees of the projection's model on the projection's topology.
  trees = {(m, t[0]): nodes for m, t, p, _, nodes in grid if p == "steps" and nodes}
  assert trees == {(projection.MODEL, projection.TOPOLOGY): tuple(config.tree_nodes)}
  assert len(compile_for.blocks(compile_tpu.get_config("full"))) == 3 * len(config.topologies) * len(
      compile_for.PROGRAMS)
  assert compile_for.blocks(compile_tpu.get_config("small"))
  assert {t for _, (t, _, _), _, _, _ in compile_for.blocks(compile_tpu.get_config("gpu"))} <= {
      f"{gpu}:{shape}" for gpu in compile_for.GPUS for shape in ("1x1x1", "1x1x8")}


def test_a_block_naming_an_unknown_program_is_an_error():
  config = compile_tpu.get_config()
  config.runs = ({"models": ("smollm2-135m",), "topologies": ("v5e:2x4",), "programs": ("decode",)},)
  with pytest.raises(ValueError, match="unknown programs"):
    compile_for.blocks(config)


def step_record(program, drafter, flops, bytes_accessed, tree_nodes=None):
  return {"kind": "steps", "status": "compiled", "model": "m", "topology": "v5e:2x4", "program": program,
          "drafter": drafter, "tree_nodes": tree_nodes, "flops": flops, "bytes_accessed": bytes_accessed,
          "projected_seconds": max(bytes_accessed / 819e9, flops / 197e12)}  # v5e's roofline


def test_the_projection_is_tau_decode_steps_over_a_round_of_draft_verify_and_update():
  config = compile_tpu.get_config()
  config.drafters = ({"name": "heads", "acceptance_of": "heads"}, {"name": "loop", "acceptance_of": "loop"})
  records = [step_record("decode_step", None, 1e9, 819e6),  # 1 ms, memory-bound
             step_record("verify_5", None, 394e12, 819e6),  # 2 s: compute-bound (394 TFLOP at 197 TFLOP/s)
             step_record("propose_4", "heads", 0, 1638e6),
             step_record("update", "heads", 0, 819e6),
             step_record("propose_1", "loop", 0, 819e6)]
  acceptance = {"heads": {"gamma": 4, "tau": 3.0}, "loop": {"gamma": 4, "tau": 2.0}}
  by_drafter = {p["drafter"]: p for p in compile_for.projections(records, config, acceptance)}
  # heads: its whole proposal (2 ms), verify (2 s), update (1 ms); tau 3 decode steps of 1 ms each.
  assert by_drafter["heads"]["projected_speedup"] == pytest.approx(3 * 1e-3 / (2e-3 + 2.0 + 1e-3))
  # loop: a drafter that drafts in a loop is counted by one step, gamma times (4 ms); no update: it keeps no state.
  assert by_drafter["loop"]["draft_seconds"] == pytest.approx(4e-3)
  assert by_drafter["loop"]["projected_speedup"] == pytest.approx(2 * 1e-3 / (4e-3 + 2.0))


def test_a_round_is_projected_at_each_method_drafting_with_it_from_several_acceptance_files(tmp_path):
  """A drafter's round with the acceptance of a shipped checkpoint's method and of a method trained on the budget,
  from two runs' results.json (the first file wins where both have a method)."""
  def run_file(name, methods):
    path = tmp_path / name
    path.write_text(json.dumps({"summary": {"methods": {m: {"gamma": 4, "mean_accepted": tau}
                                                        for m, tau in methods.items()}}}))
    return str(path)
  files = (run_file("budget.json", {"budget_heads": 2.5, "heads": 9.0}), run_file("shipped.json", {"heads": 2.0}))
  acceptance = projection.measured_acceptance(files)
  assert (acceptance["heads"]["tau"], acceptance["budget_heads"]["tau"]) == (9.0, 2.5)
  assert projection.measured_acceptance(files[1])["heads"]["tau"] == 2.0
  config = compile_tpu.get_config()
  config.drafters = ({"name": "heads", "acceptance_of": ("heads", "budget_heads")},)
  records = [step_record("decode_step", None, 0, 819e6), step_record("verify_5", None, 0, 1638e6),
             step_record("propose_4", "heads", 0, 819e6), step_record("update", "heads", 0, 819e6)]
  rows = compile_for.projections(records, config, {"heads": {"gamma": 4, "tau": 2.0},
                                                   "budget_heads": {"gamma": 4, "tau": 2.5}})
  assert [(p["drafter"], p["acceptance_of"], p["projected_speedup"]) for p in rows] == [
      ("heads", "heads", pytest.approx(2.0 / 4)), ("heads", "budget_heads", pytest.approx(2.5 / 4))]
  costs = {p["acceptance_of"]: {**projection.round_costs(4, p["decode_step_seconds"], p["draft_seconds"],
                                                         p["verify_seconds"], p["update_seconds"]), "tree_nodes": None}
           for p in rows}
  method = {"gamma": 4, "tree_nodes": None, "mean_accepted": 2.5, "adaptive": False}
  assert projection.project(method, costs, "budget_heads") == pytest.approx(2.5 / 4)


def test_a_trees_projection_takes_its_tau_from_a_run_of_trees_and_without_one_gives_its_break_even_tau():
  config = compile_tpu.get_config()
  config.drafters = ({"name": "heads", "acceptance_of": "heads"},)
  records = [step_record("decode_step", None, 0, 819e6),  # 1 ms
             step_record("verify_5", None, 0, 1638e6),  # 2 ms
             step_record("verify_tree_17", None, 0, 2457e6, tree_nodes=16),  # 3 ms
             step_record("propose_4", "heads", 0, 819e6),
             step_record("propose_tree_16", "heads", 0, 1638e6, tree_nodes=16),  # 2 ms
             step_record("update", "heads", 0, 819e6)]  # 1 ms, after a chain's round and a tree's (both 4 deep)
  acceptance = {"heads": {"gamma": 4, "tau": 2.0, "tree_nodes": None}}

  def tree_row(trees_acceptance):
    rows = compile_for.projections(records, config, acceptance, trees_acceptance)
    assert [(p["drafter"], p["tree_nodes"]) for p in rows] == [("heads", None), ("heads", 16)]
    assert rows[0]["projected_speedup"] == pytest.approx(2.0 / (1 + 2 + 1))
    return rows[1]
  unmeasured = tree_row(None)  # no run of configs/trees.py: its costs, no tau, no speedup
  assert unmeasured["acceptance_of"] == "heads_tree16" and unmeasured["gamma"] == config.gamma
  assert (unmeasured["tau"], unmeasured["projected_speedup"]) == (None, None)
  assert unmeasured["break_even_tau"] == pytest.approx(2 + 3 + 1)  # its round in decode steps
  measured = tree_row({"heads_tree16": {"gamma": 4, "tau": 3.6, "tree_nodes": 16}})
  assert measured["projected_speedup"] == pytest.approx(3.6 / 6)
  assert projection.speedup(3.6, projection.round_costs(4, 1e-3, 2e-3, 3e-3, 1e-3)) == pytest.approx(3.6 / 6)
  # A tree of another depth is another round: not projected with this one's tau.
  assert tree_row({"heads_tree16": {"gamma": 3, "tau": 3.6, "tree_nodes": 16}})["projected_speedup"] is None


def test_a_methods_projection_needs_its_own_tree_size():
  costs = {"heads_tree16": {**projection.round_costs(4, 1e-3, 2e-3, 3e-3, 1e-3), "tree_nodes": 16}}
  method = {"gamma": 4, "tree_nodes": 16, "mean_accepted": 3.0, "adaptive": False}
  assert projection.project(method, costs, "heads_tree16") == pytest.approx(3.0 / 6)
  assert projection.project(dict(method, tree_nodes=32), costs, "heads_tree16") is None
  assert projection.project(dict(method, tree_nodes=None), costs, "heads_tree16") is None


def test_a_run_writes_its_results_tables_plot_and_run_record(tmp_path, monkeypatch):
  config = compile_tpu.get_config()
  config.drafters = ({"name": "heads", "drafter": "mtp_parallel", "acceptance_of": "mtp_parallel"},)
  config.topologies = (("v5e:2x4", 2, 4),)
  config.models = ({"name": "m", "draft_vocab": 8},)
  config.runs = ({"models": ("m",), "topologies": ("v5e:2x4",), "programs": ("speculative", "train", "steps")},)
  program = {"kind": "speculative", "status": "compiled", "model": "m", "topology": "v5e:2x4", "mesh": [2, 4],
             "program": "speculative", "drafter": "heads", "seconds": 30.0, "cpu_seconds": 20.0,
             "memory": {"arguments": 2**30, "outputs": 0, "temporaries": 2**30, "code": 0, "aliased": 0},
             "bytes_per_device": 2**31, "hbm_fraction": 0.125, "flops": 1e9, "bytes_accessed": 1e9}
  too_big = dict(program, drafter=None, program="train", kind="train", status="does_not_fit",
                 error="RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
  config.tree_acceptance = str(tmp_path / "no_trees_run.json")
  steps = [dict(step_record(*args), mesh=[2, 4], seconds=1.0, cpu_seconds=1.0, memory=program["memory"])
           for args in (("decode_step", None, 1e9, 819e6), ("verify_5", None, 1e9, 819e6),
                        ("propose_4", "heads", 0, 81.9e6), ("verify_tree_17", None, 1e9, 1638e6, 16),
                        ("propose_tree_16", "heads", 0, 819e6, 16))]
  monkeypatch.setattr(compile_for, "compile_all", lambda config, log=None, done=None: [program, too_big] + steps)
  v5e = compile_for.CHIPS["v5e"]
  monkeypatch.setattr(compile_for, "target", lambda topology, data, model: compile_for.Target(
      topology, sharding.make_mesh(1, 1), v5e.hbm_bytes, v5e.hbm_bytes_per_second, v5e.bf16_flops_per_second))
  results = compile_for.run(config, str(tmp_path), command="python -m experiments.compile_for --config=x")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["RUN.md", "compile_tpu.png", "results.json", "results.md"]
  table, run_md = (tmp_path / "results.md").read_text(), (tmp_path / "RUN.md").read_text()
  assert "| m | v5e:2x4 | 2 x 4 | speculative heads | compiled | 30.0 | 2.00 | 12% |" in table
  assert "train: does_not_fit: `RESOURCE_EXHAUSTED" in table
  assert "| m | v5e:2x4 | heads | tree 16 | – (4) | 1000 | 1000 | 2000 | 0 | 3.00 | – |" in table
  assert f"No tree's tau is measured ({config.tree_acceptance} does not exist)" in table
  tau = projection.measured_acceptance(config.acceptance)["mtp_parallel"]["tau"]
  assert results["projections"][0]["projected_speedup"] == pytest.approx(tau * 1e-3 / (0.1e-3 + 1e-3))
  assert "python -m experiments.compile_for --config=x" in run_md
  assert "6 compiled, 1 do not fit in HBM, 0 failed; 65 s compiling, " in table
  assert (f" s in the last of the sittings it resumed over (RUN.md). bf16, batch {config.batch_size}, cache "
          f"{config.cache_len} positions") in compile_for.markdown(dict(results, resumed_records=2))
  assert "7 programs: 6 compiled, 1 do not fit in HBM, 0 failed." in run_md
  # a run resumed from a stopped run's records: wall and CPU time are its last sitting's; the compile times are all
  assert ("7 programs: 6 compiled, 1 do not fit in HBM, 0 failed (2 of them compiled before a restart: their time is "
          "not in the wall and CPU time above; the compile times of all 7 sum to 1.1 min).") in compile_for.run_md(
              dict(results, resumed_records=2))
  assert ("- coverage: 2 programs a user runs that the grid asks for were not built: m v5e:2x4 speculative heads "
          "tree 16, m v5e:2x4 speculative heads tree 32.") in run_md
  # A run of configs/trees.py measured afterwards: --render projects the tree from the compiled costs again.
  with open(config.tree_acceptance, "w") as f:
    json.dump({"summary": {"methods": {"mtp_parallel_tree16": {"gamma": 4, "mean_accepted": 3.0, "tree_nodes": 16}}}},
              f)
  again = compile_for.reproject(str(tmp_path))
  tree = [p for p in again["projections"] if p["tree_nodes"] == 16]
  assert len(tree) == 1 and tree[0]["projected_speedup"] == pytest.approx(3.0 / tree[0]["break_even_tau"])
  assert again["records"] == results["records"] and "projections derived again" in (tmp_path / "RUN.md").read_text()
  assert json.loads((tmp_path / "results.json").read_text())["projections"] == again["projections"]
  # A newly measured method drafting with the heads' round: projected from the same costs, at its own tau.
  measured = copy.deepcopy(config)
  measured.drafters = (dict(config.drafters[0], acceptance_of=("mtp_parallel", "mtp_sequential")),)
  chains = [p for p in compile_for.reproject(str(tmp_path), measured)["projections"] if not p["tree_nodes"]]
  assert [p["acceptance_of"] for p in chains] == ["mtp_parallel", "mtp_sequential"]
  assert chains[1]["projected_speedup"] == pytest.approx(
      projection.measured_acceptance(config.acceptance)["mtp_sequential"]["tau"] / chains[0]["break_even_tau"])
  other = copy.deepcopy(measured)
  other.batch_size = 16
  with pytest.raises(ValueError, match=r"compiled with another config \(it differs in \['batch_size'\]"):
    compile_for.reproject(str(tmp_path), other)
  other = copy.deepcopy(measured)
  other.drafters = (dict(measured.drafters[0], options={"num_heads": 2}),)
  with pytest.raises(ValueError, match=r"it differs in \['drafters.heads'\]"):
    compile_for.reproject(str(tmp_path), other)


def test_the_acceptance_comes_from_a_fixed_gamma_run():
  acceptance = projection.measured_acceptance(compile_tpu.get_config().acceptance)
  assert acceptance["mtp_sequential"]["gamma"] == 4 and 1.0 < acceptance["mtp_sequential"]["tau"] < 5.0
  assert acceptance["layer_skip_best_set"]["gamma"] == 2
  assert "autoregressive" not in acceptance


def test_the_llama_shapes_have_their_published_parameter_counts():
  assert shaped_config("llama-3.2-1b").num_params == pytest.approx(1.236e9, rel=1e-3)
  assert shaped_config("llama-3.1-8b").num_params == pytest.approx(8.030e9, rel=1e-3)
  with pytest.raises(ValueError, match="unknown model shape"):
    shaped_config("llama-9")


def test_the_gemma_and_qwen_shapes_have_their_published_parameter_counts_and_options():
  # Google's model cards: Gemma-3-270M is 170M embedding and 100M transformer parameters; Gemma-3-1B ~1.0B; the text
  # model of Gemma-3-4B 3.88B (4.3B with its 417M vision encoder). Qwen's: Qwen3-8B 8.2B, 6.95B of them outside the
  # embeddings.
  gemma270, gemma1, gemma4, qwen = (shaped_config(n) for n in ("gemma3-270m", "gemma-3-1b", "gemma-3-4b", "qwen3-8b"))
  assert gemma270.num_params == pytest.approx(268e6, rel=5e-3)
  assert gemma270.vocab_size * gemma270.hidden_size == pytest.approx(170e6, rel=2e-2)
  assert gemma1.num_params == pytest.approx(1.0e9, rel=5e-3)
  assert gemma4.num_params == pytest.approx(3.88e9, rel=5e-3)
  assert qwen.num_params == pytest.approx(8.19e9, rel=1e-3)
  assert qwen.num_params - 2 * qwen.vocab_size * qwen.hidden_size == pytest.approx(6.95e9, rel=1e-3)
  # Gemma 3: five sliding layers to a full one, a window of 512 (1024 for 4B), RoPE base 1e4 on sliding layers, linear
  # scaling by 8 on 4B's full ones; Qwen 3: QK norms, every layer full, untied head.
  for gemma in (gemma270, gemma1, gemma4):
    assert (gemma.family, gemma.activation, gemma.qk_norm, gemma.post_norms) == ("gemma3_text", "gelu_tanh", True, True)
    assert gemma.layer_kinds[:6] == ("sliding",) * 5 + ("full",) and gemma.local_rope_theta == 1e4
  assert (gemma270.sliding_window, gemma1.sliding_window, gemma4.sliding_window) == (512, 512, 1024)
  assert gemma4.rope_scaling_dict == {"rope_type": "linear", "factor": 8.0}
  assert (qwen.family, qwen.qk_norm, qwen.layer_kinds, qwen.tie_embeddings) == ("qwen3", True, None, False)


def test_the_families_grid_compiles_the_decoding_programs_of_gemma_and_qwen_on_v5e():
  config = compile_tpu.get_config("families")
  grid = compile_for.blocks(config)
  names = ("gemma3-270m", "gemma-3-1b", "gemma-3-4b", "qwen3-8b")
  assert {(m, t[0]) for m, t, _, _, _ in grid} == {(m, "v5e:2x4") for m in names}
  assert set(names) <= set(MODEL_SHAPES)
  speculative = {m: (d, nodes) for m, _, p, d, nodes in grid if p == "speculative"}
  assert speculative == {m: (("layer_skip", "mtp_sequential"), (16,)) for m in names}
  assert {p for m, _, p, _, _ in grid if m == "gemma3-270m"} == {"prefill", "autoregressive", "speculative",
                                                                   "train_drafter"}
  # Trained drafters draft over a truncated vocabulary: 1 in 8 of Gemma 3's tokens.
  assert all(m["draft_vocab"] == 32768 for m in config.models)


@pytest.mark.slow
def test_the_smollm2_shape_is_the_shipped_models_config(smollm2):
  shaped = shaped_config("smollm2-135m")
  assert shaped == dataclasses.replace(smollm2.config, rms_norm_eps=shaped.rms_norm_eps)
  assert shaped.rms_norm_eps == pytest.approx(smollm2.config.rms_norm_eps)


def test_abstract_params_carry_the_shardings_of_the_rules(tiny_config):
  mesh = sharding.make_mesh(1, 1)
  config = tiny_config
  abstract = sharding.abstract_params(config, mesh)
  expected = sharding.param_shardings(config, mesh)
  assert jax.tree.structure(abstract) == jax.tree.structure(expected)
  leaves = jax.tree.leaves(abstract)
  assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.float32 for x in leaves)
  assert [x.sharding for x in leaves] == jax.tree.leaves(expected)
  assert sum(int(np.prod(x.shape)) for x in leaves) == config.num_params


def test_the_published_run_is_of_the_default_config_and_compiled_every_program():
  """results/tpu_compile/ (docs/scaling.md's memory per chip; its own results.md's projections): every program of
  the default grid compiled, and each drafter projected on every topology its steps were compiled for."""
  with open(RESULTS) as f:
    results = json.load(f)
  config = compile_tpu.get_config()
  assert {(r["model"], r["topology"], r["kind"]) for r in results["records"]} == {
      (m, t[0], p) for m, t, p, _, _ in compile_for.blocks(config)}
  assert [r for r in results["records"] if r["status"] != "compiled"] == []
  projected = {(p["model"], p["topology"], p["drafter"]) for p in results["projections"]}
  for model, (topology, _, _), program, drafters, _ in compile_for.blocks(config):
    if program == "steps":
      assert {(model, topology, d) for d in drafters} <= projected
  # Drafters that draft in a loop are counted by one step; parallel heads and the sequential module (its later steps
  # under jax.lax.cond) as a whole proposal.
  counted = {p["drafter"]: p["draft_counted"] for p in results["projections"]}
  assert counted["mtp_parallel"] == counted["mtp_sequential"] == "propose(gamma)"
  assert counted["draft_model"] == counted["layer_skip"] == "gamma x propose(1)"


def test_the_published_run_projects_the_trees_of_the_default_config():
  """results/tpu_compile/ has a projection row, with its round's costs, for each drafter at each tree size of the
  default grid's step programs (every drafter drafts trees)."""
  with open(RESULTS) as f:
    results = json.load(f)
  config = compile_tpu.get_config()
  wanted = {(m, t, d, n) for m, (t, _, _), p, drafters, nodes in compile_for.blocks(config) if p == "steps"
            for d in drafters for n in nodes}
  assert wanted
  trees = {(p["model"], p["topology"], p["drafter"], p["tree_nodes"]): p for p in results["projections"]
           if p.get("tree_nodes")}
  assert wanted <= set(trees), ("results/tpu_compile predates the default config's tree programs: python -m "
                                "experiments.compile_for --config=configs/compile_tpu.py --workdir=results/tpu_compile")
  for p in trees.values():
    assert p["break_even_tau"] == pytest.approx(p["round_seconds"] / p["decode_step_seconds"])
