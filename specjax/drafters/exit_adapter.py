"""Trained early exit: the target's first k layers, then a small trained adapter, then the target's head.

Kangaroo (Liu et al. 2024, "Kangaroo: Lossless Self-Speculative Decoding via Double Early Exiting") drafts
with a shallow sub-network of the target plus an adapter trained to map its hidden state to what the full
model would predict; LayerSkip (Elhoushi et al. 2024) exits early without one. Here, with h_t the residual
stream after the target's first k layers at position t (the output of 0-based layer k - 1, the input of
layer k: `exit_layer=k` names the number of layers run, as `layer_skip` does):

    g_t = h_t + Wo Attn(RMSNorm(h_t); K/V of h_{<=t})       (one attention block with its own KV cache)
    g_t = g_t + MLP(RMSNorm(g_t))                           (optional: `mlp=True`, a whole decoder block)
    q(x_{t+1}) = softmax(LMHead(FinalNorm(g_t)))            (the target's, frozen; optionally over V' tokens)

Kangaroo's adapter is the attention alone (`mlp=False`). A fresh adapter is a copy of the target's layer k
(its attention only, without the MLP), so with `mlp=True` it starts as exact early exit after k + 1 layers.

Drafting runs layers 0..k-1 on the draft token against the target's shared KV cache, exactly as
`layer_skip` does, then the adapter. The adapter's own KV cache covers the committed positions: `init` and
`update` write it from the target's layer-k features of the prefill and of every verification forward
(`Drafter.feature_layers = (k - 1,)`; plain target steps too), so no extra target call; slots past a row's
committed length are overwritten by the next round's drafts before anything reads them.

Training (`loss`, self-distillation on cached features with layer k - 1 among the cache's feature layers):
the adapter runs causally over a whole cached sequence of h_t (what it attends to at inference, every one a
true target feature) and learns the target's next-token distribution at the same position t.

Trees (as `layer_skip`'s): a node runs layers 0..k-1 and the adapter seeing the committed caches and its ancestors'
keys and values (the target's layers' and the adapter's), which it carries; `update` then writes the adapter's cache
from the features along the accepted path, as after a chain.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import leviathan, ops
from specjax.config import ModelConfig
from specjax.drafters import (DraftCost, Drafter, DraftInputs, PromptInfo, RoundResult, draft_head, draft_tokens,
                              draft_tree_tokens)
from specjax.loading import CheckpointError
from specjax.model import (attention_block, attention_keys, forward, forward_nodes, init_cache, layer_shapes, mlp_block,
                           mlp_keys, node_attention_block)
from specjax.sampling import SamplingParams

NAME = "layer_skip"  # an adapter belongs to the layer-skip drafter; its checkpoints carry this name
SHIPPED_NAME = "exit_adapter"
SHIPPED_HINT = ("pass adapter=<checkpoint.safetensors>, adapter='fresh' for a new adapter to train, or "
                "adapter=None for plain early exit")


@dataclasses.dataclass(frozen=True)
class Options:
  config: ModelConfig  # the target's
  exit_layer: int  # k: the draft runs the target's layers 0..k-1, then the adapter
  mlp: bool  # a whole decoder block (attention + MLP) instead of attention alone
  draft_vocab: int | None  # V' of a truncated draft vocabulary; None scores the full vocabulary

  @property
  def layers(self) -> tuple[int, ...]:
    return tuple(range(self.exit_layer))

  def saved(self) -> dict:
    return {"exit_layer": self.exit_layer, "mlp": self.mlp, "draft_vocab": self.draft_vocab}


def _keys(options: Options) -> tuple[str, ...]:
  """The adapter's block: a decoder layer's attention arrays, and its MLP's with mlp=True."""
  return attention_keys(options.config) + (mlp_keys(options.config) if options.mlp else ())


def saved_specs(options: Options) -> dict:
  """The adapter's arrays, declared as a decoder layer's are, and the token map of a truncated vocabulary."""
  block = layer_shapes(options.config)
  specs = {k: block[k] for k in _keys(options)}
  if options.draft_vocab is not None:
    specs["token_map"] = draft_head.head_specs(options.config, options.draft_vocab)["token_map"]
  return specs


def param_specs(options: Options) -> dict:
  return {**saved_specs(options), **draft_head.head_specs(options.config, options.draft_vocab)}


def adapter(params, options: Options, hidden: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
            positions: jax.Array):
  """g [B, T, D] from h [B, T, D] at positions [B, T], attending to cache slots <= each position after writing
  this call's K/V there. Returns (g, k_cache, v_cache); callers that only fill the cache drop g (XLA prunes it)."""
  attn, k_cache, v_cache = attention_block(params, hidden, k_cache, v_cache, positions, options.config,
                                           window=options.config.window(options.exit_layer))
  return _output(params, options, hidden, attn), k_cache, v_cache


def adapter_nodes(params, options: Options, hidden: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                  committed: jax.Array, positions: jax.Array, ancestor_keys: jax.Array, ancestor_values: jax.Array):
  """g [B, T, D] of draft-tree nodes h [B, T, D], each at its own position seeing the adapter's cache up to slot
  committed[b] and its ancestors' adapter keys and values (`model.node_attention_block`). Returns (g, keys, values
  [B, T, E + 1, KV, hd])."""
  attn, keys, values = node_attention_block(params, hidden, k_cache, v_cache, committed, positions, ancestor_keys,
                                            ancestor_values, options.config,
                                            window=options.config.window(options.exit_layer))
  return _output(params, options, hidden, attn), keys, values


def _output(params, options: Options, hidden: jax.Array, attn: jax.Array) -> jax.Array:
  """g = h + attention, then + MLP(g) with mlp=True."""
  g = hidden + attn
  return g + mlp_block(params, g, options.config) if options.mlp else g


# ------------------------------------------------------------------------------------------ the drafter


def init(target_params, params, options: Options, prompt: PromptInfo):
  config, (b, t) = options.config, prompt.tokens.shape
  shape = (b, prompt.cache_len, config.num_kv_heads, config.head_dim)
  dtype = jnp.dtype(config.dtype)
  positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
  _, k, v = adapter(params, options, prompt.features[:, :, 0].astype(dtype), jnp.zeros(shape, dtype),
                    jnp.zeros(shape, dtype), positions)
  return {"k": k, "v": v}


def propose(target_params, params, options: Options, state, inputs: DraftInputs, gamma: int,
            sampling: SamplingParams):
  config = options.config

  def step(cache, tokens, positions):
    target_cache, k, v = cache
    # Only the pending token (the last one) is new to the shared cache; the one before it is committed.
    position = positions + tokens.shape[1] - 1
    out = forward(target_params, tokens[:, -1:], target_cache, position, config, layers=options.layers,
                  compute_logits=False)
    g, k, v = adapter(params, options, out.hidden, k, v, position[:, None])
    return draft_head.logits(target_params, params, g[:, -1], config), out.hidden[:, -1], (out.cache, k, v)

  def expand_step(cache, tokens, committed, positions, ancestors):
    target_cache, k, v = cache
    layer_ancestors, adapter_keys, adapter_values = ancestors
    out = forward_nodes(target_params, tokens, target_cache, committed, positions, layer_ancestors, config,
                        layers=options.layers, compute_logits=False)
    g, adapter_keys, adapter_values = adapter_nodes(params, options, out.hidden, k, v, committed, positions,
                                                    adapter_keys, adapter_values)
    return draft_head.logits(target_params, params, g, config), (out.cache, adapter_keys, adapter_values)

  cache = (inputs.target_cache, state["k"], state["v"])
  if inputs.tree_nodes:
    batch = inputs.position.shape[0]
    no_keys = jnp.zeros((batch, 0) + state["k"].shape[2:], state["k"].dtype)
    no_ancestors = (init_cache(config, batch, 0), no_keys, no_keys)
    proposal = draft_tree_tokens(step, expand_step, cache, no_ancestors, inputs, gamma, sampling,
                                 params.get("token_map"), config.vocab_size)
  else:
    proposal = draft_tokens(step, cache, inputs, gamma, sampling, params.get("token_map"), config.vocab_size,
                            keep_hidden=True)
  target_cache, k, v = proposal.target_cache
  return proposal._replace(state={"k": k, "v": v}, target_cache=target_cache)


def update(target_params, params, options: Options, state, result: RoundResult):
  # The verification forward gave true layer-k features at the verified positions: they replace the drafts' K/V.
  width = result.features.shape[1]
  positions = result.verify_position[:, None] + jnp.arange(width)[None, :]
  _, k, v = adapter(params, options, result.features[:, :, 0].astype(state["k"].dtype), state["k"], state["v"],
                    positions)
  return {"k": k, "v": v}


def loss(target_params, params, options: Options, batch):
  """Self-distillation over cached features: features [B, T, 1, D] (the output of layer k - 1),
  teacher_ids/probs [B, T, K] (the target's next-token distribution at the same position), mask [B, T].
  Returns (loss, {"loss_1", "top1_1"})."""
  config = options.config
  hidden = batch["features"][:, :, 0].astype(jnp.float32)
  b, t, _ = hidden.shape
  shape = (b, t, config.num_kv_heads, config.head_dim)
  positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
  g, _, _ = adapter(params, options, hidden, jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32), positions)
  value, top1 = draft_head.distill_loss(draft_head.logits(target_params, params, g, config), batch["teacher_ids"],
                                        batch["teacher_probs"], batch["mask"], params, config.vocab_size)
  return value, {"loss_1": value, "top1_1": top1}


def fresh_params(model, options: Options, token_map=None) -> dict:
  """A copy of the target's layer k (the first one the draft skips): its attention, and its MLP with mlp=True."""
  layer = model.params["layers"][options.exit_layer]
  params = {k: jnp.array(ops.dequantize(layer[k])) for k in _keys(options)}
  if options.draft_vocab is not None:
    params["token_map"] = jnp.asarray(token_map, jnp.int32)
  return params


def make(model, adapter: str, exit_layer: int | None = None, mlp: bool | None = None, token_map=None) -> Drafter:
  """adapter: "default" (the one shipped for this model), a checkpoint file, or "fresh" (a new one to train).

  exit_layer (k): layers the draft runs before the adapter; a checkpoint brings its own, and a different
  exit_layer is an error. mlp (default True) and token_map (the draft vocabulary) apply to a fresh adapter.
  """
  config = model.config
  if adapter == "fresh":
    if exit_layer is None:
      raise ValueError("a fresh exit adapter needs exit_layer=k")
    if not 1 <= exit_layer < config.num_layers:
      raise ValueError(f"exit_layer must be in [1, {config.num_layers - 1}], got {exit_layer}")
    token_map = None if token_map is None else draft_head.as_token_map(token_map, config.vocab_size)
    options = Options(config=config, exit_layer=int(exit_layer), mlp=True if mlp is None else bool(mlp),
                      draft_vocab=None if token_map is None else int(token_map.size))
    params = fresh_params(model, options, token_map)
  else:
    if mlp is not None or token_map is not None:
      raise ValueError("mlp and token_map describe a fresh adapter (adapter='fresh'); a checkpoint brings its own")
    if adapter == "default":  # shipped as checkpoints/<model>/exit_adapter.safetensors
      adapter = draft_head.shipped_checkpoint(model, SHIPPED_NAME, hint=SHIPPED_HINT)
    options, params = draft_head.load(model, NAME, adapter, saved_specs, lambda saved: Options(
        config=config, exit_layer=int(saved["exit_layer"]), mlp=bool(saved["mlp"]), draft_vocab=saved["draft_vocab"]),
        hint=SHIPPED_HINT)
    if exit_layer is not None and int(exit_layer) != options.exit_layer:
      raise CheckpointError(f"the adapter {adapter!r} was trained after layer {options.exit_layer} "
                            f"(exit_layer={options.exit_layer}), not exit_layer={exit_layer}; omit exit_layer or "
                            "train an adapter for it")
    if not 1 <= options.exit_layer < config.num_layers:
      raise CheckpointError(f"{adapter}: exit_layer {options.exit_layer} outside [1, {config.num_layers - 1}]")
  if options.draft_vocab is not None:
    params["head"] = draft_head.head_columns(model.params, config, params["token_map"])
  return Drafter(name=NAME, init=init, propose=propose, update=update, options=options, params=params,
                 param_specs=param_specs(options), loss=loss, feature_layers=(options.exit_layer - 1,),
                 reuse_layers=options.exit_layer, cost=cost(model, options, params), trees=True)


def _adapter_weights(params) -> dict:
  return {k: v for k, v in params.items() if k not in ("token_map", "head")}


def cost(model, options: Options, params) -> DraftCost:
  """A draft step reads layers 0..k-1 (reused by verification), the adapter and the (truncated) head; following a
  plain step, the adapter over one position's features."""
  target, config, adapter_weights = model.params, model.config, _adapter_weights(params)
  return DraftCost(step=leviathan.draft_cost(target, config, options.layers, adapter_weights, options.draft_vocab),
                   plain_step=leviathan.draft_cost(target, config, (), adapter_weights, head_columns=0),
                   reused=leviathan.draft_cost(target, config, options.layers, head_columns=0))
