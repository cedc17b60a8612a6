"""Sampling and the compiled generation program: distributions, one while loop, stops, ragged batches, and
greedy parity with HF transformers on SmolLM2."""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import compilation
from specjax.sampling import SamplingParams, probabilities, sample

# `specjax.generate` is the function (re-exported by the package); the module holds the compiled program.
generate_module = importlib.import_module("specjax.generate")


# --------------------------------------------------------------------------------------------- sampling

def _random_logits(shape, seed=0, scale=3.0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def test_greedy_is_argmax():
  logits = _random_logits((8, 50))
  np.testing.assert_array_equal(sample(jax.random.PRNGKey(0), logits, SamplingParams()), jnp.argmax(logits, -1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=2.0, top_k=5, top_p=1e-6),
], ids=["top_k_1", "tiny_top_p", "top_k_5_tiny_top_p"])
def test_filters_that_keep_one_token_equal_greedy(params):
  logits = _random_logits((8, 50))
  for seed in range(5):
    np.testing.assert_array_equal(sample(jax.random.PRNGKey(seed), logits, params), jnp.argmax(logits, -1))


def test_top_k_zeroes_the_rest_and_renormalizes():
  logits = jnp.log(jnp.asarray([0.1, 0.2, 0.3, 0.4]))
  probs = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
  np.testing.assert_allclose(probs, [0, 0, 3 / 7, 4 / 7], atol=1e-6)


@pytest.mark.parametrize("top_p, expected", [
    (0.7, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),  # 0.5 < 0.7: the second token is needed to reach 0.7
    (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    (0.4, [1, 0, 0, 0]),  # the most likely token alone reaches top_p
    (1.0, [0.5, 0.3, 0.15, 0.05]),
])
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, expected):
  logits = jnp.log(jnp.asarray([0.5, 0.3, 0.15, 0.05]))
  np.testing.assert_allclose(probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p)), expected, atol=1e-6)


def test_temperature_scales_logits():
  logits = _random_logits((3, 20))
  np.testing.assert_allclose(probabilities(logits, SamplingParams(temperature=2.0)), jax.nn.softmax(logits / 2.0),
                             atol=1e-6)


def test_top_k_larger_than_vocab_keeps_everything():
  logits = _random_logits((2, 10))
  np.testing.assert_allclose(probabilities(logits, SamplingParams(temperature=1.0, top_k=1000)),
                             jax.nn.softmax(logits), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 0.9), (0.7, 10, 1.0), (1.3, 20, 0.8), (1.0, 5, 0.5)])
def test_probabilities_match_transformers_warpers(temperature, top_k, top_p):
  import torch
  from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                      TopPLogitsWarper)
  logits = _random_logits((16, 100), seed=1)
  scores = torch.tensor(np.asarray(logits))
  input_ids = torch.zeros((16, 1), dtype=torch.long)
  scores = TemperatureLogitsWarper(temperature)(input_ids, scores)
  if top_k:
    scores = TopKLogitsWarper(top_k)(input_ids, scores)
  if top_p < 1.0:
    scores = TopPLogitsWarper(top_p)(input_ids, scores)
  theirs = torch.softmax(scores, dim=-1).numpy()
  ours = np.asarray(probabilities(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)))
  np.testing.assert_array_equal(ours > 0, theirs > 0)
  np.testing.assert_allclose(ours, theirs, atol=1e-6)


def test_same_seed_reproduces_and_different_seeds_differ():
  logits = _random_logits((64, 50), scale=0.5)
  params = SamplingParams(temperature=1.0)
  a, b = sample(jax.random.PRNGKey(0), logits, params), sample(jax.random.PRNGKey(0), logits, params)
  c = sample(jax.random.PRNGKey(1), logits, params)
  np.testing.assert_array_equal(a, b)
  assert np.any(np.asarray(a) != np.asarray(c))


@pytest.mark.slow
@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), [0.4, 0.3, 0.2, 0.1]),
    (SamplingParams(temperature=1.0, top_k=2), [4 / 7, 3 / 7, 0, 0]),
    (SamplingParams(temperature=1.0, top_p=0.8), [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0]),
], ids=["plain", "top_k", "top_p"])
def test_sample_frequencies_match_the_distribution(params, expected):
  import scipy.stats
  draws = 20000
  logits = jnp.broadcast_to(jnp.log(jnp.asarray([0.4, 0.3, 0.2, 0.1])), (draws, 4))
  counts = np.bincount(np.asarray(sample(jax.random.PRNGKey(42), logits, params)), minlength=4)
  expected = np.asarray(expected)
  assert np.all(counts[expected == 0] == 0)
  kept = expected > 0
  _, p_value = scipy.stats.chisquare(counts[kept], draws * expected[kept])
  assert p_value > 1e-3, (counts, expected)


def test_invalid_sampling_params_are_rejected(tiny):
  for kwargs, match in [({"top_p": 0.0}, "top_p must be in"), ({"top_p": 1.5}, "top_p must be in"),
                        ({"temperature": -0.5}, "temperature must be >= 0"), ({"top_k": -1}, "top_k must be")]:
    with pytest.raises(ValueError, match=match):
      specjax.generate(tiny, [[1, 2, 3]], max_new_tokens=4, **kwargs)


# ------------------------------------------------------------------------- the compiled program (tiny)

def _program_args(model, prompts, max_new_tokens, sampling=SamplingParams(), stop_ids=()):
  batch = generate_module.prepare_batch(model, prompts, max_new_tokens)
  args = (model.params, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), jax.random.PRNGKey(0))
  kwargs = dict(config=model.config, sampling=sampling, max_new_tokens=max_new_tokens, cache_len=batch.cache_len,
                stop_ids=stop_ids)
  return args, kwargs


def _host_callbacks(hlo_text: str) -> list[str]:
  """Custom calls that reach back to the host (jax.debug.print, pure_callback, io_callback, ...)."""
  targets = re.findall(r"custom_call\s*@([\w.]+)|call_target_name\s*=\s*\"([^\"]+)\"", hlo_text)
  names = [a or b for a, b in targets]
  return [n for n in names if "callback" in n.lower() or "host" in n.lower()]


def test_host_callback_detector_sees_a_debug_print():
  def loop(x):
    def body(i):
      jax.debug.print("step {}", i)
      return i + 1
    return jax.lax.while_loop(lambda i: i < x, body, 0)
  assert _host_callbacks(jax.jit(loop).lower(3).as_text())


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=10, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_program_is_one_while_loop_without_host_callbacks(sampling, tiny):
  args, kwargs = _program_args(tiny, [[1, 2, 3], [4, 5]], 8, sampling=sampling, stop_ids=(7,))
  text = generate_module._generate_autoregressive.lower(*args, **kwargs).as_text()
  main = text[text.index("func.func public @main"):]
  main = main[:main.index("func.func", 1)]
  assert main.count("stablehlo.while") == 1  # the decode loop (jax.random adds its own loops in helpers)
  assert _host_callbacks(text) == []
  assert "callback" not in text.lower()


def test_second_call_with_the_same_shapes_does_not_recompile(tiny):
  program = generate_module._autoregressive_program
  specjax.generate(tiny, [[1, 2, 3], [4, 5, 6, 7]], max_new_tokens=6, stop_ids=(3,))
  compiles = []
  listener = lambda event, duration, **kwargs: compiles.append(event)  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    entries = program.cache_size()
    # Other tokens, other lengths inside the same bucket, another seed: same program.
    out = specjax.generate(tiny, [[9, 8], [7, 6, 5, 4, 3, 2]], max_new_tokens=6, stop_ids=(3,), seed=5)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert len(out.tokens) == 2
  assert program.cache_size() == entries
  assert "/jax/core/compile/backend_compile_duration" not in compiles
  assert out.stats["compile_seconds"] == 0.0


def test_clear_all_forgets_every_compiled_program(tiny):
  prompts = [[1, 2], [3, 4, 5]]
  first = specjax.generate(tiny, prompts, max_new_tokens=5, stop_ids=())
  assert generate_module._autoregressive_program.cache_size() > 0
  compilation.clear_all()
  assert generate_module._autoregressive_program.cache_size() == 0
  again = specjax.generate(tiny, prompts, max_new_tokens=5, stop_ids=())  # compiles afresh, same result
  assert again.tokens == first.tokens and again.stats["compile_seconds"] > 0


def test_compilation_is_timed_apart_from_decoding(tiny):
  prompts = [[1, 2, 3], [4], [5, 6]]  # batch 3 with 7 new tokens: a shape no other test compiles
  first = specjax.generate(tiny, prompts, max_new_tokens=7, stop_ids=())
  again = specjax.generate(tiny, prompts, max_new_tokens=7, stop_ids=())
  assert first.tokens == again.tokens
  assert first.stats["compile_seconds"] > 0 and again.stats["compile_seconds"] == 0.0
  # Seven steps of a tiny model take milliseconds; compiling its program takes far longer.
  assert first.stats["seconds"] < first.stats["compile_seconds"]
  assert first.stats["tokens_per_second"] == first.stats["new_tokens"] / first.stats["seconds"]


def test_programs_drop_their_oldest_executables_before_the_memory_map_limit(monkeypatch):
  """XLA:CPU maps every kernel apart; past vm.max_map_count LLVM fails and the process crashes, so a Program
  about to compile drops the least recently used executables while the process holds too many mappings."""
  import weakref
  monkeypatch.setattr(compilation, "_programs", weakref.WeakSet())
  program = compilation.Program(jax.jit(lambda x: x * 2), "doubling")
  # 1000 mappings plus 150 per executable, of 2000 allowed (budget 0.6: 1200): room for 1000 + 150 * 1.
  monkeypatch.setattr(compilation, "_map_limit", lambda: 2000)
  monkeypatch.setattr(compilation, "_map_count", lambda: 1000 + 150 * program.cache_size())
  a, b, c = (jnp.zeros(n) for n in (1, 2, 3))
  assert program(a)[1] > 0 and program(b)[1] > 0  # a held: 1150, room for b
  assert program(a)[1] == 0.0  # a is now the most recently used
  assert program(c)[1] > 0 and program.cache_size() == 2  # 1300 > 1200 before compiling c: b, the oldest, went
  assert program(a)[1] == 0.0 and program(b)[1] > 0


def test_dropping_an_executable_gives_its_memory_mappings_back(monkeypatch):
  """With the real mapping count: JAX's compilation caches also hold a Program's executables, so a drop that
  left them there would free nothing and every later compile would drop everything in vain."""
  if compilation._map_count() is None:
    pytest.skip("no /proc/self/maps on this platform")
  import weakref
  monkeypatch.setattr(compilation, "_programs", weakref.WeakSet())

  def layers(x):
    for i in range(12):
      x = jnp.tanh(x @ x.T + i) @ x
    return x

  program = compilation.Program(jax.jit(layers), "layers")
  inputs = [np.ones((n, n), np.float32) for n in (3, 4, 5)]
  jax.clear_caches()
  before = compilation._map_count()
  for x in inputs:
    program(x)
  held = compilation._map_count()
  per_executable = (held - before) / 3
  assert per_executable >= 2
  # A budget half an executable below what the process holds: dropping the oldest one must get under it.
  monkeypatch.setattr(compilation, "_map_limit", lambda: int((held - per_executable / 2) / compilation.MAP_BUDGET))
  compilation._make_room()
  assert program.cache_size() == 2
  assert compilation._map_count() < held
  assert program(inputs[2])[1] == 0.0 and program(inputs[0])[1] > 0


def _first_stop(tokens: list[int], stop: int) -> list[int]:
  return tokens[:tokens.index(stop) + 1] if stop in tokens else tokens


def test_stop_token_ends_a_row_exactly_there(tiny):
  prompts = [[1, 2, 3], [10, 20, 30, 14, 25], [5]]
  free = specjax.generate(tiny, prompts, max_new_tokens=16, stop_ids=()).tokens
  # The token that first appears latest in row 0, so the stop cuts a long prefix there.
  stop = max(set(free[0]), key=free[0].index)
  assert free[0].index(stop) > 0
  stopped = specjax.generate(tiny, prompts, max_new_tokens=16, stop_ids=(stop,))
  assert stopped.tokens == [_first_stop(row, stop) for row in free]
  assert stopped.tokens[0][-1] == stop and len(stopped.tokens[0]) < 16
  assert stopped.stats["new_tokens_per_row"] == [len(r) for r in stopped.tokens]


@pytest.mark.parametrize("max_new_tokens", [1, 5])
def test_max_new_tokens_is_respected(max_new_tokens, tiny):
  out = specjax.generate(tiny, [[1, 2, 3], [4]], max_new_tokens=max_new_tokens, stop_ids=())
  assert [len(r) for r in out.tokens] == [max_new_tokens, max_new_tokens]
  assert out.stats["new_tokens"] == 2 * max_new_tokens
  assert out.stats["rounds"] == max_new_tokens - 1  # prefill makes the first token


def test_rows_of_different_lengths_equal_each_row_alone(tiny):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, tiny.config.vocab_size, size=n).tolist() for n in (3, 9, 14, 1)]
  batched = specjax.generate(tiny, prompts, max_new_tokens=12, stop_ids=()).tokens
  alone = [specjax.generate(tiny, [p], max_new_tokens=12, stop_ids=()).tokens[0] for p in prompts]
  assert batched == alone
  assert len({tuple(r) for r in alone}) == len(prompts)  # the rows really differ


def test_sampled_generation_is_reproducible_by_seed(tiny):
  def run(seed):
    return specjax.generate(tiny, [[1, 2, 3], [4, 5]], max_new_tokens=12, temperature=1.0, top_p=0.95, seed=seed,
                            stop_ids=()).tokens
  assert run(3) == run(3)
  assert run(3) != run(4)


# ------------------------------------------------------------------------------------- bad inputs

def test_prompt_plus_max_new_tokens_beyond_max_len(tiny):
  with pytest.raises(ValueError, match=r"= 20 exceeds the cache capacity of 16 positions"):
    specjax.generate(tiny, [list(range(10))], max_new_tokens=10, max_len=16)


def test_prompt_plus_max_new_tokens_beyond_the_context_length(tiny):
  context = tiny.config.max_position_embeddings
  with pytest.raises(ValueError, match=f"exceeds the cache capacity of {context} positions"):
    specjax.generate(tiny, [[1] * (context - 10)], max_new_tokens=11)


def test_empty_prompt(tiny):
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    specjax.generate(tiny, [[1, 2], []], max_new_tokens=4)
  with pytest.raises(ValueError, match="prompts is empty"):
    specjax.generate(tiny, [], max_new_tokens=4)


@pytest.mark.slow
def test_empty_text_prompt(smollm2):
  with pytest.raises(ValueError, match="prompt 0 is empty"):
    specjax.generate(smollm2, [""], max_new_tokens=4)


def test_a_bare_prompt_is_not_a_batch(tiny):
  with pytest.raises(TypeError, match="list of token-id lists"):
    specjax.generate(tiny, [1, 2, 3], max_new_tokens=4)


def test_token_ids_outside_the_vocabulary(tiny):
  with pytest.raises(ValueError, match="outside"):
    specjax.generate(tiny, [[1, tiny.config.vocab_size]], max_new_tokens=4)
  with pytest.raises(ValueError, match="outside"):
    specjax.logits(tiny, [1, -1])


# ------------------------------------------------------------------------ SmolLM2 vs HF transformers

@pytest.fixture(scope="module")
def smollm2_prompts(smollm2) -> list[list[int]]:
  """Two chat-formatted and two plain-text prompts of different lengths, all in one 64-token bucket."""
  tok = smollm2.tokenizer
  prompts = [
      tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
      tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}]),
      tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that "
                 "large values of n stay fast and use constant memory.\"\"\"\n"),
      tok.encode("Once upon a time, in a small village by the mountains, there lived an old clockmaker who had "
                 "never once left the valley where he was born. One morning, a stranger knocked on his door and"),
  ]
  assert all(33 <= len(p) <= 64 for p in prompts) and len({len(p) for p in prompts}) == 4
  return prompts


@pytest.fixture(scope="module")
def smollm2_alone(smollm2, smollm2_prompts) -> list[list[int]]:
  stop_ids = smollm2.tokenizer.stop_ids
  return [specjax.generate(smollm2, [p], max_new_tokens=64, stop_ids=stop_ids).tokens[0] for p in smollm2_prompts]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(4), ids=["chat_capital", "chat_haiku", "code", "story"])
def test_greedy_continuation_equals_transformers(index, smollm2, hf_smollm2, smollm2_prompts, smollm2_alone):
  import torch
  prompt, stop_ids = smollm2_prompts[index], list(smollm2.tokenizer.stop_ids)
  with torch.no_grad():
    out = hf_smollm2.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=64, eos_token_id=stop_ids, pad_token_id=stop_ids[0])
  theirs = out[0, len(prompt):].tolist()
  ours = smollm2_alone[index]
  assert ours == theirs, (smollm2.tokenizer.decode(ours), smollm2.tokenizer.decode(theirs))
  assert len(ours) == 64 or ours[-1] in stop_ids


@pytest.mark.slow
def test_chat_answer_ends_with_the_end_of_turn_token(smollm2, smollm2_alone):
  assert smollm2_alone[0][-1] == smollm2.tokenizer.token_to_id("<|im_end|>")
  assert "Paris" in smollm2.tokenizer.decode(smollm2_alone[0])


@pytest.mark.slow
def test_ragged_batch_equals_each_prompt_alone(smollm2, smollm2_prompts, smollm2_alone):
  out = specjax.generate(smollm2, smollm2_prompts, max_new_tokens=64, stop_ids=smollm2.tokenizer.stop_ids)
  assert out.tokens == smollm2_alone
  stop_ids = smollm2.tokenizer.stop_ids
  assert out.texts == [smollm2.tokenizer.decode(r[:-1] if r[-1] in stop_ids else r) for r in smollm2_alone]
  # Both kinds of row: one ended by its stop token, one cut by max_new_tokens (its text keeps its last token).
  assert {r[-1] in stop_ids for r in smollm2_alone} == {True, False}


@pytest.mark.slow
def test_texts_stop_before_the_stop_token_and_tokens_keep_it(smollm2, smollm2_prompts, smollm2_alone):
  end_of_turn = smollm2.tokenizer.token_to_id("<|im_end|>")
  out = specjax.generate(smollm2, smollm2_prompts[:1], max_new_tokens=64)
  assert out.tokens[0] == smollm2_alone[0] and out.tokens[0][-1] == end_of_turn
  assert out.texts[0] == smollm2.tokenizer.decode(out.tokens[0][:-1])
  assert "<|im_end|>" not in out.texts[0] and "Paris" in out.texts[0]
