"""Parallel multi-token-prediction heads (Gloeckle et al. 2024, "Better & Faster LLMs via Multi-token
Prediction"; Cai et al. 2024, "Medusa").

K heads read the target's last hidden state h_t at the newest committed position t (the one whose target
prediction is the pending token t+1). Head k (k = 1..K) is a residual block

    h_k = h_t + SiLU(W_k h_t + b_k),   W_k, b_k zero-initialised (so an untrained head is the target's own head)

followed by the target's final norm and its frozen LM head (tied to the embedding in SmolLM2), optionally
over a truncated draft vocabulary (`draft_head`). Head k predicts token t+1+k. The drafts come from the
hidden state the verification forward already produced (`RoundResult.verify_hidden` at the last accepted
position), so drafting costs K small matrix-vector products and one head over V' tokens: no target call.

Training (self-distillation, `loss`): at every position t of a cached sequence, head k learns the target's
next-token distribution at position t+k, with loss weight 0.8^(k-1) (Medusa's decay).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax import leviathan
from specjax.drafters import (DraftCost, Drafter, DraftInputs, PromptInfo, Proposal, RoundResult, choose_tokens,
                              confidence, draft_lengths)
from specjax.drafters import draft_head
from specjax.model import ParamSpec
from specjax.sampling import SamplingParams

NAME = "mtp_parallel"
DEPTH_DECAY = 0.8


@dataclasses.dataclass(frozen=True)
class Options:
  config: ModelConfig
  num_heads: int
  draft_vocab: int | None  # V' of a truncated draft vocabulary; None scores the full vocabulary

  def saved(self) -> dict:
    """The options a checkpoint records (the target's config is checked separately)."""
    return {"num_heads": self.num_heads, "draft_vocab": self.draft_vocab}


def saved_specs(options: Options) -> dict:
  """What a checkpoint holds: the trainable heads (stacked over k) and the token map."""
  d, k = options.config.hidden_size, options.num_heads
  specs = {"w": ParamSpec((k, d, d), ("stack", "embed", "embed")), "b": ParamSpec((k, d), ("stack", "embed"))}
  if options.draft_vocab is not None:
    specs["token_map"] = draft_head.head_specs(options.config, options.draft_vocab)["token_map"]
  return specs


def param_specs(options: Options) -> dict:
  return {**saved_specs(options), **draft_head.head_specs(options.config, options.draft_vocab)}


def heads(params, hidden: jax.Array, num: int) -> jax.Array:
  """h + SiLU(W_k h + b_k) for k = 1..num: hidden [..., D] -> [..., num, D]."""
  w, b = params["w"][:num], params["b"][:num]
  update = jnp.einsum("...d,kde->...ke", hidden, w.astype(hidden.dtype)) + b.astype(hidden.dtype)
  return hidden[..., None, :] + jax.nn.silu(update)


def init(target_params, params, options: Options, prompt: PromptInfo):
  return prompt.last_hidden


def propose(target_params, params, options: Options, hidden, inputs: DraftInputs, gamma: int,
            sampling: SamplingParams):
  if gamma > options.num_heads:  # static; generate() checks max_gamma first with a clearer message
    raise ValueError(f"{NAME} has {options.num_heads} heads, gamma={gamma}")
  logits = draft_head.logits(target_params, params, heads(params, hidden, gamma), options.config)  # [B, g, V']
  tokens, probs = choose_tokens(logits, inputs.key, sampling, params.get("token_map"), options.config.vocab_size)
  # All heads run at once (one small product each), so stopping early trims the verification, not drafting.
  return Proposal(tokens=tokens, probs=probs, state=hidden, target_cache=inputs.target_cache,
                  lengths=draft_lengths(confidence(logits, probs), inputs, gamma), steps=jnp.ones((), jnp.int32))


def update(target_params, params, options: Options, hidden, result: RoundResult):
  # The hidden state at the last accepted position predicted the new pending token: the heads continue it.
  rows = jnp.arange(result.accepted.shape[0])
  return result.verify_hidden[rows, result.accepted].astype(hidden.dtype)


def loss(target_params, params, options: Options, batch):
  """Self-distillation over a batch of cached features (`specjax.features.FeatureCache.batch`).

  batch: features [B, T, 1, D] (the target's last hidden state), teacher_ids/probs [B, T, K], mask [B, T].
  Returns (sum_k 0.8^(k-1) loss_k, {"loss_k", "top1_k" per head}).
  """
  h = heads(params, batch["features"][:, :, 0, :].astype(jnp.float32), options.num_heads)
  total, metrics = 0.0, {}
  for k in range(1, options.num_heads + 1):
    logits = draft_head.logits(target_params, params, h[:, :, k - 1], options.config)
    # Head k at position t predicts token t+1+k: the target's distribution at position t+k.
    loss_k, top1_k = draft_head.distill_loss(
        logits, draft_head.shifted(batch["teacher_ids"], k), draft_head.shifted(batch["teacher_probs"], k),
        draft_head.shifted(batch["mask"], k, False), params, options.config.vocab_size)
    total = total + DEPTH_DECAY ** (k - 1) * loss_k
    metrics[f"loss_{k}"], metrics[f"top1_{k}"] = loss_k, top1_k
  return total, metrics


def fresh_params(model, options: Options, token_map=None) -> dict:
  """Zero-initialised heads (each starts as the target's own head) and, when truncated, the token map."""
  d, k = options.config.hidden_size, options.num_heads
  dtype = jnp.dtype(options.config.dtype)
  params = {"w": jnp.zeros((k, d, d), dtype), "b": jnp.zeros((k, d), dtype)}
  if options.draft_vocab is not None:
    params["token_map"] = jnp.asarray(token_map, jnp.int32)
  return params


def make(model, path: str | None = "default", num_heads: int = 4, token_map=None) -> Drafter:
  """path: "default" (the checkpoint shipped for this model), a checkpoint file, or None for fresh heads.

  num_heads and token_map (the draft vocabulary: token ids, most frequent first) apply to fresh heads;
  a checkpoint brings its own.
  """
  config = model.config
  if path is None:
    if num_heads < 1:
      raise ValueError(f"num_heads must be positive, got {num_heads}")
    token_map = None if token_map is None else draft_head.as_token_map(token_map, config.vocab_size)
    options = Options(config=config, num_heads=int(num_heads),
                      draft_vocab=None if token_map is None else int(token_map.size))
    params = fresh_params(model, options, token_map)
  else:
    options, params = draft_head.load(model, NAME, path, saved_specs, lambda saved: Options(
        config=config, num_heads=int(saved["num_heads"]), draft_vocab=saved["draft_vocab"]))
  if options.draft_vocab is not None:
    params["head"] = draft_head.head_columns(model.params, config, params["token_map"])
  return Drafter(name=NAME, init=init, propose=propose, update=update, options=options, params=params,
                 param_specs=param_specs(options), loss=loss, max_gamma=options.num_heads,
                 cost=cost(model, options, params))


def cost(model, options: Options, params) -> DraftCost:
  """c per draft token: one round reads the (truncated) head once for all its heads, so each of num_heads
  tokens costs a share of it, plus its own head block. Following a plain step keeps a hidden state: free."""
  head = leviathan.draft_cost(model.params, model.config, (), head_columns=options.draft_vocab)
  block = leviathan.draft_cost(model.params, model.config, (), {"w": params["w"][0]}, head_columns=0)
  return DraftCost(step=head / options.num_heads + block)

