"""Parallel multi-token-prediction heads (Gloeckle et al. 2024, "Better & Faster LLMs via Multi-token
Prediction"; Cai et al. 2024, "Medusa").

K heads read the target's last hidden state h_t at the newest committed position t (the one whose target
prediction is the pending token t+1). Head k (k = 1..K) is a residual block

    h_k = h_t + SiLU(W_k h_t + b_k),   W_k, b_k zero-initialised (so an untrained head is the target's own head)

followed by the target's final norm and its frozen LM head (tied to the embedding in SmolLM2), optionally
over a truncated draft vocabulary (`draft_head`). Head k predicts token t+1+k. The drafts come from the
hidden state the verification forward already produced (`RoundResult.verify_hidden` at the last accepted
position), so drafting costs K small matrix-vector products and one head over V' tokens: no target call.

Trees (Medusa's): head k's top tokens are the candidates at depth k under every node of depth k - 1. With a measured
per-(head, rank) accuracy (`draft_tree.rank_accuracy` on held-out cached features, stored beside the checkpoint
as <checkpoint>.ranks.json, `draft_head.save_rank_accuracy`), the tree is Medusa's static one: the N rank paths
(r_1..r_d) of highest expected acceptance prod_k accuracy[k][r_k] (`draft_tree.static_tree`), each node the rank-r_d
token of head d. Until such a measurement exists, the tree keeps the N paths of highest product of the heads' own probabilities
(`draft_tree.grow`, EAGLE-2's rule; the heads read one hidden state, so expanding a node costs nothing).

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
from specjax.drafters import draft_head, draft_tree
from specjax.model import ParamSpec
from specjax.sampling import SamplingParams

NAME = "mtp_parallel"
DEPTH_DECAY = 0.8
TREES = True  # drafts Medusa's static trees, or EAGLE-2's grown ones (`propose` with `DraftInputs.tree_nodes`)


@dataclasses.dataclass(frozen=True)
class Options:
  config: ModelConfig
  num_heads: int
  draft_vocab: int | None  # V' of a truncated draft vocabulary; None scores the full vocabulary
  # [K][R] measured share of positions where head k's rank-r token is the target's (None: trees grown, EAGLE-2)
  rank_accuracy: tuple[tuple[float, ...], ...] | None = None

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
  if inputs.tree_nodes and options.rank_accuracy is not None:
    tokens, probs, parents = draft_tree.static_tree_tokens(logits, options.rank_accuracy, gamma, inputs.tree_nodes,
                                                           sampling, params.get("token_map"),
                                                           options.config.vocab_size)
    return Proposal(tokens=tokens, probs=probs, state=hidden, target_cache=inputs.target_cache,
                    steps=jnp.ones((), jnp.int32), parents=parents)
  if inputs.tree_nodes:
    def expand(d, tokens, payload):  # head d scores the children of every node of depth d - 1 alike
      return jnp.broadcast_to(logits[:, None, d - 1], tokens.shape + logits.shape[-1:]), payload

    tokens, probs, parents = draft_tree.grow(logits[:, 0], (), expand, gamma, inputs.tree_nodes, sampling,
                                             params.get("token_map"), options.config.vocab_size)
    return Proposal(tokens=tokens, probs=probs, state=hidden, target_cache=inputs.target_cache,
                    steps=jnp.ones((), jnp.int32), parents=parents)
  tokens, probs = choose_tokens(logits, inputs.key, sampling, params.get("token_map"), options.config.vocab_size)
  # All heads run at once (one small product each), so stopping early trims the verification, not drafting.
  return Proposal(tokens=tokens, probs=probs, state=hidden, target_cache=inputs.target_cache,
                  lengths=draft_lengths(confidence(logits, probs), inputs, gamma), steps=jnp.ones((), jnp.int32))


def depth_logits(target_params, params, options: Options, batch) -> list[tuple[jax.Array, int]]:
  """Per head k, (logits [B, T, V'] at every position t of a batch of cached features, k): head k at t drafts token
  t + 1 + k, the target's greedy token at t + k (`draft_tree.rank_accuracy`)."""
  h = heads(params, jnp.asarray(batch["features"][:, :, 0, :], jnp.float32), options.num_heads)
  return [(draft_head.logits(target_params, params, h[:, :, k - 1], options.config), k)
          for k in range(1, options.num_heads + 1)]


def update(target_params, params, options: Options, hidden, result: RoundResult):
  # The hidden state at the last accepted position predicted the new pending token: the heads continue it.
  rows = jnp.arange(result.accepted.shape[0])
  return result.verify_hidden[rows, result.accepted].astype(hidden.dtype)


def loss(target_params, params, options: Options, batch):
  """Self-distillation over a batch of cached features (`specjax.data.features.FeatureCache.batch`).

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


def make(model, path: str | None = "default", num_heads: int = 4, token_map=None, rank_accuracy=None) -> Drafter:
  """path: "default" (the checkpoint shipped for this model), a checkpoint file, or None for fresh heads.

  num_heads and token_map (the draft vocabulary: token ids, most frequent first) apply to fresh heads;
  a checkpoint brings its own. rank_accuracy [K][R] (head k's rank-r token is the target's) makes trees Medusa's
  static ones (`draft_tree.static_tree`); None reads it from beside the checkpoint (`draft_head.ranks_path`)
  where one was measured.
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
  rank_accuracy = draft_head.stored_rank_accuracy(model, NAME, path, rank_accuracy, options.num_heads)
  if rank_accuracy is not None:
    options = dataclasses.replace(options, rank_accuracy=rank_accuracy)
  if options.draft_vocab is not None:
    params["head"] = draft_head.head_columns(model.params, config, params["token_map"])
  return Drafter(name=NAME, init=init, propose=propose, update=update, options=options, params=params,
                 param_specs=param_specs(options), loss=loss, max_gamma=options.num_heads, trees=TREES,
                 cost=cost(model, options, params))


def cost(model, options: Options, params) -> DraftCost:
  """A round reads the (truncated) head once for all its heads (`round`), and each draft token its own head block
  (`step`). Following a plain step keeps a hidden state: free."""
  head = leviathan.draft_cost(model.params, model.config, (), head_columns=options.draft_vocab)
  block = leviathan.draft_cost(model.params, model.config, (), {"w": params["w"][0]}, head_columns=0)
  return DraftCost(step=block, round=head)

