"""specjax: lossless speculative decoding and multi-token prediction in JAX.

Public API:
  load(name_or_path, dtype) -> Model
  logits(model, token_ids) -> [T, vocab]
  generate(model, prompts, *, max_new_tokens, temperature, top_k, top_p, seed, drafter, gamma, mesh) -> Output
"""

from specjax.config import ModelConfig
from specjax.generate import Output, generate, logits
from specjax.loading import CheckpointError, Model, load
from specjax.sampling import SamplingParams

__all__ = ["CheckpointError", "Model", "ModelConfig", "Output", "SamplingParams", "generate", "load", "logits"]
