"""specjax: lossless speculative decoding in JAX.

Public API:
  load(name_or_path, dtype) -> Model
  logits(model, token_ids) -> [T, vocab]
  make_drafter(name, model, **options) -> Drafter  ("mtp_parallel", "mtp_sequential", "layer_skip", "draft_model",
                                                    "prompt_lookup")
  make_mesh(data, model) -> jax.sharding.Mesh  (pass as generate(..., mesh=mesh))
  generate(model, prompts, *, max_new_tokens, temperature, top_k, top_p, seed, drafter, gamma, adaptive, mesh,
           max_len, stop_ids) -> Output
  AdaptiveDrafting(min_confidence, forward_costs, prior_alpha, memory, plain_memory, optimism), FixedGamma()
                   drafting policies (generate(..., adaptive=...))
"""

from specjax.adaptive import AdaptiveDrafting, FixedGamma
from specjax.config import ModelConfig
from specjax.drafters import Drafter, make_drafter
from specjax.generate import Output, generate, logits
from specjax.loading import CheckpointError, Model, load
from specjax.sampling import SamplingParams
from specjax.sharding import make_mesh

__all__ = ["AdaptiveDrafting", "CheckpointError", "Drafter", "FixedGamma", "Model", "ModelConfig", "Output",
           "SamplingParams", "generate", "load", "logits", "make_drafter", "make_mesh"]
