"""An independent, smaller draft model with the target's tokenizer and its own KV cache.

Each round the draft model first re-reads the token before the pending one, then the pending token (a
2-token step), and then feeds back its own proposals one at a time. Re-reading the previous token keeps the
draft cache complete when every draft was accepted in the last round (the last draft was never fed then).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.drafters import Drafter, DraftInputs, PromptInfo, Proposal, draft_tokens, keep_state
from specjax.model import forward, init_cache, param_shapes
from specjax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Options:
  config: ModelConfig


def init(target_params, params, options: Options, prompt: PromptInfo):
  cache = init_cache(options.config, prompt.tokens.shape[0], prompt.cache_len)
  return forward(params, prompt.tokens, cache, jnp.zeros_like(prompt.lengths), options.config,
                 compute_logits=False).cache


def propose(target_params, params, options: Options, cache, inputs: DraftInputs, gamma: int,
            sampling: SamplingParams):
  def step(cache, tokens, positions):
    out = forward(params, tokens, cache, positions, options.config)
    return out.logits[:, -1], out.cache

  tokens, probs, cache = draft_tokens(step, cache, inputs, gamma, sampling)
  return Proposal(tokens=tokens, probs=probs, state=cache, target_cache=inputs.target_cache)


def make(model, draft=None) -> Drafter:
  """draft: a `Model` or a name/path for `specjax.load`, with the same tokenizer as `model`."""
  from specjax.loading import Model, load
  if draft is None:
    raise ValueError("draft_model needs draft=<Model or name/path>")
  if not isinstance(draft, Model):
    draft = load(draft, dtype=model.config.dtype)
  if draft.config.vocab_size != model.config.vocab_size:
    raise ValueError(f"draft model vocabulary ({draft.config.vocab_size}) differs from the target's "
                     f"({model.config.vocab_size}); speculative decoding needs the same tokenizer")
  if (draft.tokenizer is None) != (model.tokenizer is None) or (
      draft.tokenizer is not None and draft.tokenizer.fingerprint() != model.tokenizer.fingerprint()):
    raise ValueError(f"draft model {draft.name!r} has a different tokenizer from the target {model.name!r}; "
                     "speculative decoding needs identical vocabularies")
  return Drafter(name="draft_model", init=init, propose=propose, update=keep_state,
                 options=Options(config=draft.config), params=draft.params,
                 param_specs=param_shapes(draft.config))
