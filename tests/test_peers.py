"""Peers in the experiment runner: HF transformers decodes the same weights greedily token for token like specjax,
its speculative modes' acceptance is counted from its forward passes, llama.cpp is left out with a printed
reason where it is not installed, and configs/bench_peers.py loads."""

from __future__ import annotations

import dataclasses
import json
import os

import ml_collections
import numpy as np
import pytest

import specjax
from configs import bench_peers, quickstart
from experiments import peers, report, run
from specjax import export
from specjax.drafters import draft_head, draft_model

STOP = (2,)


@pytest.fixture(scope="module")
def tiny_hf(tiny_hf_llama_dir):
  """The tiny random HF Llama (untied, GQA) as specjax loads it, and a fresh 1-layer distilled draft of it
  exported as an HF Llama directory (untrained: it drafts, the target mostly rejects)."""
  model = specjax.load(tiny_hf_llama_dir)
  drafter = specjax.make_drafter("draft_model", model, draft="fresh", num_layers=1)
  return model, export.save_hf(draft_model.as_model(model, drafter), tiny_hf_llama_dir + "-draft1")


def _prompts(model) -> list[list[int]]:
  rng = np.random.default_rng(0)
  repeated = rng.integers(3, model.config.vocab_size, 10).tolist()
  return [repeated * 3, rng.integers(3, model.config.vocab_size, 17).tolist()]  # a copy-friendly one, a plain one


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_autoregressive", "hf_prompt_lookup", "hf_assisted"])
def test_hf_peer_greedy_equals_specjax_on_the_same_weights(name, tiny_hf, tiny_hf_llama_dir):
  model, draft_dir = tiny_hf
  prompts = _prompts(model)
  reference = specjax.generate(model, prompts, max_new_tokens=12, stop_ids=STOP)
  options = {"draft": draft_dir} if name == "hf_assisted" else {}
  peer = peers.make(name, model, tiny_hf_llama_dir, gamma=3, temperature=0.0, stop_ids=STOP, threads=1, **options)
  out = peer.generate(prompts, max_new_tokens=12)
  assert out.tokens == reference.tokens
  assert report.agreement(out.tokens, reference.tokens) == [1.0, 1.0]
  stats = out.stats
  assert stats["new_tokens"] == sum(map(len, reference.tokens)) and stats["compile_seconds"] == 0.0
  if name == "hf_autoregressive":  # one forward per token; no drafts
    assert stats["target_calls"] == stats["new_tokens"] and stats["mean_accepted"] == 1.0
    assert stats["acceptance_rate"] is None and stats["proposed"] == 0
  else:
    assert 0 < stats["target_calls"] <= stats["new_tokens"]
    assert stats["proposed"] > 0 and 0.0 <= stats["acceptance_rate"] <= 1.0 and 0.0 <= stats["alpha"] <= 1.0
    assert stats["accepted"] == stats["new_tokens"] - stats["target_calls"]  # every forward adds accepted + 1
  if name != "hf_autoregressive":  # at most gamma drafts per forward (fewer near max_new_tokens)
    assert stats["proposed"] <= 3 * stats["target_calls"]


def test_trace_counts_follow_the_committed_sequence():
  # Prompt of 8; the first forward verifies 3 drafts with the prompt and accepts 2 (commits 3 tokens); the next
  # reads the newest token with 3 drafts and accepts all (4 tokens); the last rejects its 2 drafts (1 token).
  forwards = [peers.Forward(past=0, inputs=11), peers.Forward(past=10, inputs=4), peers.Forward(past=14, inputs=3)]
  counts = peers.trace_counts(forwards, prompt_len=8, new_tokens=8)
  assert counts == {"target_calls": 3, "proposed": 8, "accepted": 5, "rejections": 2, "from_rounds": 5}
  # Autoregressive: a prefill, then one token read per forward.
  plain = [peers.Forward(past=0, inputs=5)] + [peers.Forward(past=5 + i, inputs=1) for i in range(3)]
  assert peers.trace_counts(plain, prompt_len=5, new_tokens=4) == {
      "target_calls": 4, "proposed": 0, "accepted": 0, "rejections": 0, "from_rounds": 3}


def test_agreement_is_the_prefix_before_the_first_divergence():
  assert report.agreement([[1, 2, 3, 4], [5, 6], [7, 8, 9]], [[1, 2, 0, 4], [5, 6], [7, 8]]) == [0.5, 1.0, 2 / 3]


@pytest.mark.slow
def test_hf_assisted_exports_a_specjax_distilled_draft_checkpoint(tiny_hf, tiny_hf_llama_dir, tmp_path):
  model, _ = tiny_hf
  drafter = specjax.make_drafter("draft_model", model, draft="fresh", init_layers=(0, 2))
  path = draft_head.save(drafter, str(tmp_path / "draft_model.safetensors"), model, dtype="float32")
  peer = peers.make("hf_assisted", model, tiny_hf_llama_dir, gamma=2, temperature=0.0, stop_ids=STOP, threads=1,
                    draft=path)
  assert peer.generate_kwargs["assistant_model"].config.num_hidden_layers == 2
  prompts = _prompts(model)
  out = peer.generate(prompts, max_new_tokens=10)
  assert out.tokens == specjax.generate(model, prompts, max_new_tokens=10, stop_ids=STOP).tokens
  assert out.stats["accepted"] > 0  # two of the target's three layers draft well enough to be accepted sometimes


@pytest.mark.slow
def test_hf_assisted_without_its_draft_directory_says_how_to_make_one(tiny_hf, tiny_hf_llama_dir, tmp_path):
  model, _ = tiny_hf
  with pytest.raises(FileNotFoundError, match="no HF draft model directory at .*configs/train_draft.py"):
    peers.make("hf_assisted", model, tiny_hf_llama_dir, gamma=3, temperature=0.0, draft=str(tmp_path / "none"))


@pytest.mark.slow
@pytest.mark.parametrize("name, kwargs, error, message", [
    ("hf_autoregressive", {"temperature": 0.7}, ValueError, "decodes greedily"),
    ("hf_prompt_lookup", {"ngram": 3}, TypeError, r"takes options \['max_matching_ngram_size'"),
    ("vllm", {}, ValueError, "unknown peer 'vllm'"),
])
def test_peer_rejects_bad_input(name, kwargs, error, message, tiny_hf, tiny_hf_llama_dir):
  model, _ = tiny_hf
  kwargs = {"gamma": 3, "temperature": 0.0, **kwargs}
  with pytest.raises(error, match=message):
    peers.make(name, model, tiny_hf_llama_dir, **kwargs)


@pytest.mark.parametrize("methods, message", [
    (({"name": "ar"}, {"name": "x", "peer": "hf_autoregressive", "drafter": "prompt_lookup"}), "not both"),
    (({"name": "ar"}, {"name": "x", "peer": "vllm"}), "unknown peer 'vllm'"),
    (({"name": "hf", "peer": "hf_autoregressive"},), "needs an autoregressive baseline"),
])
def test_make_methods_rejects_bad_peer_specs(methods, message):
  config = quickstart.get_config()
  config.methods = methods
  with pytest.raises(ValueError, match=message):
    run.make_methods(config, model=None)  # fails before building anything


@pytest.fixture(scope="module")
def tiny_chat_dir(tiny_chat, tmp_path_factory) -> str:
  """The tiny model with a word-level tokenizer (so the runner can render Spec-Bench prompts), as an HF directory."""
  return export.save_hf(tiny_chat, str(tmp_path_factory.mktemp("tiny_chat")))


@pytest.mark.slow
def test_runner_times_peers_and_reports_their_agreement(tiny_chat_dir, tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(peers, "llamacpp_installed", lambda: False)  # as where llama-cpp-python is not installed
  config = quickstart.get_config()
  config.control = False
  config.model = tiny_chat_dir
  config.max_new_tokens = 5
  config.prompts.categories = ("qa", "humanities")
  config.methods = ({"name": "autoregressive"},
                    {"name": "hf_autoregressive", "peer": "hf_autoregressive", "options": {"threads": 1}},
                    {"name": "llamacpp_autoregressive", "peer": "llamacpp_autoregressive", "options": {}})
  results = run.run(config, str(tmp_path), name="peers")

  assert "leaving out llamacpp_autoregressive: llama-cpp-python is not installed" in capsys.readouterr().out
  left_out = json.loads((tmp_path / "results.json").read_text())["summary"]["unavailable_peers"]
  assert list(left_out) == ["llamacpp_autoregressive"] and "not installed" in left_out["llamacpp_autoregressive"]
  assert "Peers left out: llamacpp_autoregressive (llama-cpp-python is not installed" in (
      tmp_path / "results.md").read_text()
  summary = json.loads((tmp_path / "results.json").read_text())["summary"]["methods"]
  assert list(summary) == ["autoregressive", "hf_autoregressive"]
  assert summary["autoregressive"]["lossless"] is True and summary["hf_autoregressive"]["lossless"] is None
  assert summary["autoregressive"]["agreement"] == summary["autoregressive"]["equal_rows"] == 1.0
  # float32 HF on the same random weights: the same greedy tokens.
  assert summary["hf_autoregressive"]["agreement"] == summary["hf_autoregressive"]["equal_rows"] == 1.0
  outputs = {(o["method"], o["question_id"]): o for o in results["outputs"]}
  for (method, question), o in outputs.items():
    assert o["tokens"] == outputs[("autoregressive", question)]["tokens"] and o["agreement"] == 1.0
  assert [(r["batch"], r["method"]) for r in results["records"]] == [
      (b, m) for b in (0, 1) for m in ("autoregressive", "hf_autoregressive")]
  table = (tmp_path / "results.md").read_text()
  assert "| hf_autoregressive |" in table and "| method | equal rows | tokens until first divergence |" in table


@pytest.mark.slow
def test_a_peer_that_disagrees_is_reported_not_failed(tiny_chat_dir, tmp_path, monkeypatch):
  """llama.cpp's quantized kernels flip near ties: a peer's greedy tokens may differ from specjax's. That is its
  agreement, not a lossless failure, and the run completes."""
  generate = peers.HFPeer.generate

  def flipped(self, prompts, max_new_tokens):  # the last token of every row changed
    out = generate(self, prompts, max_new_tokens)
    return dataclasses.replace(out, tokens=[row[:-1] + [row[-1] + 1] for row in out.tokens])
  monkeypatch.setattr(peers.HFPeer, "generate", flipped)
  config = quickstart.get_config()
  config.control = False
  config.model = tiny_chat_dir
  config.max_new_tokens = 4
  config.prompts.categories = ("qa",)
  config.methods = ({"name": "autoregressive"},
                    {"name": "hf_autoregressive", "peer": "hf_autoregressive", "options": {"threads": 1}})
  results = run.run(config, str(tmp_path), name="peers")
  summary = results["summary"]
  assert summary["all_lossless"] is True and not summary["lossless_failures"]
  assert summary["methods"]["hf_autoregressive"]["equal_rows"] == 0.0
  assert 0.0 <= summary["methods"]["hf_autoregressive"]["agreement"] < 1.0
  assert all(r["matches_baseline"] is None for r in results["records"] if r["method"] == "hf_autoregressive")
  assert "LOSSLESS CHECK FAILED" not in (tmp_path / "results.md").read_text()


def _peer_config(path: str, maker: str, monkeypatch) -> ml_collections.ConfigDict:
  """A run of autoregressive decoding and a llama.cpp peer whose process `maker` builds (tests/peer_processes.py)."""
  monkeypatch.setattr(peers, "LLAMACPP_MAKER", maker)
  monkeypatch.setattr(peers, "llamacpp_installed", lambda: True)  # the test's peer processes need no llama.cpp
  config = quickstart.get_config()
  config.update(control=False, model=path, max_new_tokens=3, repeats=1)
  config.costs.enabled = False
  config.prompts.categories = ("qa", "humanities")
  config.methods = ({"name": "autoregressive"}, {"name": "llama", "peer": "llamacpp_autoregressive"})
  return config


def test_a_peer_whose_process_dies_is_reported_and_the_run_goes_on(tiny_chat, tmp_path, monkeypatch):
  gguf = tmp_path / "model.gguf"
  gguf.write_bytes(b"")
  # Its process answers the warmup and batch 0, then dies on batch 1 as a llama.cpp built for another CPU does.
  config = _peer_config(str(gguf), "tests.peer_processes:dies_on_third_decode", monkeypatch)
  results = run.run(config, str(tmp_path / "run"), model=tiny_chat, name="peers")
  summary = results["summary"]
  assert summary["failed_peers"] == {"llama": "llamacpp_autoregressive: its process was killed by SIGILL"}
  assert summary["peers"] == {"llama": {"library": "echo", "threads": 1}}  # the build it timed
  assert [(r["batch"], r["method"]) for r in results["records"]] == [
      (0, "autoregressive"), (0, "llama"), (1, "autoregressive")]
  assert summary["methods"]["llama"]["batches"] == 1 and summary["all_lossless"] is True
  text = (tmp_path / "run" / "results.md").read_text()
  assert "Peers that failed (timed until then, left out from then on): llama (llamacpp_autoregressive: its process " \
         "was killed by SIGILL)." in text and "llama ran library echo, threads 1." in text


@pytest.mark.parametrize("maker, into, reason", [
    ("tests.peer_processes:dies_at_start", "failed", "llamacpp_autoregressive: its process was killed by SIGILL"),
    ("tests.peer_processes:not_installed", "unavailable", "llama-cpp-python is not installed (in the test's peer "
                                                          "process)")])
def test_a_peer_whose_process_cannot_start_is_left_out_with_why(maker, into, reason, tiny_chat, tmp_path,
                                                                monkeypatch):
  gguf = tmp_path / "model.gguf"
  gguf.write_bytes(b"")
  found = {"failed": {}, "unavailable": {}}
  methods = run.make_methods(_peer_config(str(gguf), maker, monkeypatch), tiny_chat, found["unavailable"],
                             found["failed"])
  assert [m.name for m in methods] == ["autoregressive"]
  assert found == {into: {"llama": reason}, **{k: {} for k in found if k != into}}


def test_llamacpp_is_built_for_the_features_the_cpu_lists_and_never_amx():
  args = lambda flags: dict(a.removeprefix("-D").split("=") for a in peers.llamacpp_cmake_args(flags).split())
  xeon = args("fpu avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16".split())
  epyc = args("fpu avx avx2 fma f16c".split())
  assert xeon["GGML_AVX512"] == xeon["GGML_AVX512_VNNI"] == xeon["GGML_AVX512_BF16"] == "ON"
  assert epyc["GGML_AVX2"] == "ON" and epyc["GGML_AVX512"] == epyc["GGML_AVX512_VNNI"] == "OFF"
  for built in (xeon, epyc):
    assert built["GGML_NATIVE"] == built["GGML_AMX_TILE"] == built["GGML_AMX_INT8"] == built["GGML_AMX_BF16"] == "OFF"


@pytest.mark.parametrize("arg", [None, "small"])
def test_bench_peers_config_runs_every_drafter_and_peer(arg):
  """Its prompts and the checks every config passes: tests/test_experiments.py."""
  config = bench_peers.get_config(arg)
  assert config.temperature == 0.0
  names = [m["name"] for m in config.methods]
  assert {"prompt_lookup", "layer_skip_exit24", "mtp_parallel", "mtp_sequential"} <= set(names)
  assert {"hf_autoregressive", "hf_prompt_lookup", "llamacpp_autoregressive", "llamacpp_prompt_lookup"} <= set(names)


@pytest.mark.parametrize("arg, model, drafters", [
    ("quantized", "smollm2-135m", ("prompt_lookup", "mtp_parallel", "mtp_sequential")),
    ("gemma,quantized", "gemma3-270m", ("prompt_lookup", "layer_skip_exit12"))])
def test_bench_peers_quantized_times_specjax_on_the_ggufs_blocks_against_llamacpp_on_the_same_file(arg, model,
                                                                                                  drafters):
  """The target loaded with its quantized blocks for every specjax method (the autoregressive baseline too: the
  lossless check is against the quantized target), and llama.cpp on the same file, at specjax's threads."""
  config = bench_peers.get_config(arg)
  assert config.quantized and config.model == model and config.temperature == 0.0
  specs = {m["name"]: m for m in config.methods}
  assert [n for n, m in specs.items() if not m.get("peer")] == ["autoregressive", *drafters]
  llamacpp = [m for m in specs.values() if m.get("peer")]
  assert [m["peer"] for m in llamacpp] == ["llamacpp_autoregressive", "llamacpp_prompt_lookup"]
  assert [m["name"] for m in llamacpp] == list(bench_peers.LLAMACPP_SAME_THREADS)
  assert all(m["options"]["n_threads"] == peers.SAME_THREADS for m in llamacpp)
  assert not bench_peers.get_config(arg.replace("quantized", "").strip(",") or None).quantized


def test_same_threads_are_the_cores_xla_runs_specjax_on():
  assert peers.specjax_threads() == len(os.sched_getaffinity(0)) >= 1
