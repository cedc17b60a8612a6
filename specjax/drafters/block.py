"""Block drafter: one forward drafts a whole block (DFlash, Chen et al. 2026, block diffusion conditioned on the
target's features; PARD, An et al. 2025, a parallel draft model predicting several mask tokens at once).

A small transformer of the target's own block kind (`layers` decoder blocks, the target's norms and activation)
reads gamma + 1 queries in one forward: the pending token x_p at position p and gamma mask slots at positions
p + 1 .. p + gamma. The queries attend to each other bidirectionally and to a cache of the target's features over
the committed positions 0 .. p - 1 (DFlash's feature injection). Every query's input holds the anchor directly, fused
as EAGLE fuses a token with the feature before it (`anchor`):

    c_t = W_f [h^(l_1)_t; ...; h^(l_F)_t]                 (the target's residual stream after `feature_layers`)
    K_t, V_t = the block's own key/value projections of c_t at position t (RoPE), in each of its layers
    a_p = W_in [RMSNorm(emb(x_p)); RMSNorm(c_(p-1))]      (the pending token and the newest committed feature)
    g = Blocks([a_p; m_1 + a_p; ...; m_gamma + a_p])       (m_i: slot i's learned embedding; attention: the cache,
                                                           then the block's own keys)
    logits_i = LMHead(FinalNorm(g_i)), i = 1 .. gamma      (the target's, frozen; truncated: `draft_head`)

so slot i predicts token p + i, the target's distribution at position p + i - 1. Drafting costs one forward over
gamma + 1 positions whatever gamma (`Proposal.steps` = 1, so `stats["draft_calls"]` counts one per drafting round),
and `DraftCost.round` prices it for the drafting policy (`specjax.adaptive`).

Why the anchor is in every input: with one shared mask embedding every mask slot's input is the same vector, so a slot
reaches x_p and c_(p-1) only through attention whose query does not depend on them; trained on a real target's
answers (SmolLM2-135M), its slots put ~0.8 of their attention on the other (identical) mask slots and none on x_p or
c_(p-1), their outputs hardly vary across anchors, and every slot learns the unigram distribution.

Context cache: `init` writes the prompt's features; after every verification (`update`, also after a plain step)
the features of the verified positions, from that same verification forward (`RoundResult.features`), are
projected and written at their positions. Slots past a row's committed length are overwritten by the next update
before a query reads them (a query at pending p reads slots 0 .. p - 1 only). The state also carries c_(p-1) at each
row's newest committed position (`last_context`, as the sequential module carries its `hidden`): the prompt's last
feature after `init`, the feature at verify_position + accepted (the new pending position - 1) after `update`.

Trees: the slots' distributions depend on the context, not on each other's tokens, so a tree is built as the
parallel heads' are: Medusa's static tree from measured per-(slot, rank) accuracy (`draft_tree.rank_accuracy`,
`depth_logits`), else EAGLE-2's
rule over the slots' distributions (`draft_tree.grow`), expanding a node costing nothing.

Training (`loss`, self-distillation on cached features): every position t of a sequence is an anchor at once: its
block [a_t, m_1 + a_t, ..., m_gamma + a_t], with a_t fused from emb(x_t) and c_(t-1) (the cached features shifted by
one; zero before the first position), attends to the context features at positions < t and to its own block, and
slot i learns the target's distribution at position t + i - 1, weighted 0.8^(i-1): the inputs decoding builds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import leviathan, ops
from specjax.config import ModelConfig
from specjax.drafters import (DraftCost, Drafter, DraftInputs, PromptInfo, Proposal, RoundResult, choose_tokens,
                              confidence, draft_head, draft_lengths, draft_tree)
from specjax.model import ParamSpec, attend, attention_output, embed, layer_shapes, mlp_block, qkv
from specjax.sampling import SamplingParams

NAME = "block"
DEPTH_DECAY = 0.8
TREES = True  # drafts Medusa's static trees, or EAGLE-2's grown ones (`propose` with `DraftInputs.tree_nodes`)


@dataclasses.dataclass(frozen=True)
class Options:
  config: ModelConfig
  block_size: int  # mask slots trained (the most draft tokens a round proposes)
  layers: int  # decoder blocks
  feature_layers: tuple[int, ...]  # target layers whose outputs form the context c_t
  draft_vocab: int | None  # V' of a truncated draft vocabulary; None scores the full vocabulary
  # [gamma][R] measured share of positions where slot i's rank-r token is the target's (None: trees grown)
  rank_accuracy: tuple[tuple[float, ...], ...] | None = None

  def saved(self) -> dict:
    return {"block_size": self.block_size, "layers": self.layers, "feature_layers": list(self.feature_layers),
            "draft_vocab": self.draft_vocab}


def block_keys(config: ModelConfig) -> tuple[str, ...]:
  """A block: the arrays of one decoder layer of the target's kind."""
  return tuple(layer_shapes(config))


def saved_specs(options: Options) -> dict:
  c, n = options.config, options.layers
  d = c.hidden_size
  specs = {"feature_proj": ParamSpec((len(options.feature_layers) * d, d), ("embed", "embed")),
           **draft_head.fusion_specs(d),
           "mask": ParamSpec((options.block_size, d), ("block_slot", "embed")),
           **{k: ParamSpec((n,) + spec.shape, ("stack",) + spec.axes) for k, spec in layer_shapes(c).items()}}
  if options.draft_vocab is not None:
    specs["token_map"] = draft_head.head_specs(c, options.draft_vocab)["token_map"]
  return specs


def param_specs(options: Options) -> dict:
  return {**saved_specs(options), **draft_head.head_specs(options.config, options.draft_vocab)}


def _layer(params, i: int, config: ModelConfig) -> dict:
  """Block i's arrays: sliced from the stacks, or as decoding on a CPU lays them out (`backends.cpu.pack_draft_params`:
  one dict per block)."""
  if "blocks" in params:
    return params["blocks"][i]
  return {k: params[k][i] for k in block_keys(config)}


def context(params, features: jax.Array, dtype) -> jax.Array:
  """c [B, T, D] = W_f [features concatenated] from the target features [B, T, F, D]."""
  flat = features.reshape(features.shape[:2] + (-1,)).astype(dtype)
  return ops.matmul(flat, params["feature_proj"].astype(dtype))


def context_kv(params, options: Options, c: jax.Array, positions: jax.Array):
  """Each layer's keys and values [B, T, KV, hd] of the context c [B, T, D] at `positions` [B, T]."""
  out = []
  for i in range(options.layers):
    _, k, v = qkv(_layer(params, i, options.config), c, positions, options.config)
    out.append((k, v))
  return out


def anchor(target_params, params, tokens: jax.Array, last_context: jax.Array, config: ModelConfig) -> jax.Array:
  """a = W_in [RMSNorm(emb(x)); RMSNorm(c)] [..., D]: anchor tokens [...] fused with the context c [..., D] at the
  position before each (EAGLE's pairing of a token with the feature that predicted it)."""
  return draft_head.fuse(params, embed(target_params, tokens, config), last_context, config)


def block_input(target_params, params, tokens: jax.Array, last_context: jax.Array, gamma: int,
                config: ModelConfig) -> jax.Array:
  """[a; m_1 + a; ...; m_gamma + a] [..., gamma + 1, D] for anchor tokens [...] and the context [..., D] before each:
  the pending slot's input and every mask slot's hold the anchor (`anchor`), each slot its own embedding m_i."""
  a = anchor(target_params, params, tokens, last_context, config)[..., None, :]
  return jnp.concatenate([a, params["mask"][:gamma].astype(a.dtype) + a], axis=-2)


def run_block(params, options: Options, x: jax.Array, positions: jax.Array, seen: jax.Array, caches) -> jax.Array:
  """The blocks over x [B, A * (g + 1), D]: A anchors' blocks of g + 1 queries each, at positions [B, A * (g + 1)];
  the queries of anchor a see the context slots 0..seen[b, a] of caches[i] = (keys, values) [B, S, KV, hd] and,
  bidirectionally, their own block. Returns g [B, A * (g + 1), D]."""
  config = options.config
  b, n = positions.shape
  anchors = seen.shape[1]
  width = n // anchors  # g + 1
  committed = jnp.repeat(seen, width, axis=1)  # [B, A * (g + 1)]

  def own_block(a):  # [B, A * (g + 1), KV, hd] -> each query's block's keys [B, A * (g + 1), g + 1, KV, hd]
    a = a.reshape((b, anchors, 1, width) + a.shape[2:])
    return jnp.broadcast_to(a, (b, anchors, width) + a.shape[3:]).reshape((b, n, width) + a.shape[4:])

  for i, (k_cache, v_cache) in enumerate(caches):
    layer = _layer(params, i, config)
    q, k, v = qkv(layer, x, positions, config)
    out = attend(q, k_cache, v_cache, committed, config, extra_keys=own_block(k.astype(k_cache.dtype)),
                 extra_values=own_block(v.astype(v_cache.dtype)))
    x = x + attention_output(layer, out, config)
    x = x + mlp_block(layer, x, config)
  return x


# ---------------------------------------------------------------------------------------------------- decoding


def _write(state, options: Options, params, features, positions):
  """The context of `features` [B, W, F, D] at `positions` [B, W] written into every layer's cache; returns
  (state, c [B, W, D])."""
  dtype = state["k"][0].dtype
  c = context(params, features, dtype)
  new = context_kv(params, options, c, positions)
  return {**state, "k": [ops.cache_write(cache, k, positions) for cache, (k, _) in zip(state["k"], new)],
          "v": [ops.cache_write(cache, v, positions) for cache, (_, v) in zip(state["v"], new)]}, c


def init(target_params, params, options: Options, prompt: PromptInfo):
  config = options.config
  b, t = prompt.tokens.shape
  shape = (b, prompt.cache_len, config.num_kv_heads, config.head_dim)
  dtype = jnp.dtype(config.dtype)
  state = {"k": [jnp.zeros(shape, dtype) for _ in range(options.layers)],
           "v": [jnp.zeros(shape, dtype) for _ in range(options.layers)]}
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
  state, c = _write(state, options, params, prompt.features, positions)
  return {**state, "last_context": c[jnp.arange(b), prompt.lengths - 1]}  # c_(p-1) for the first pending p


def update(target_params, params, options: Options, state, result: RoundResult):
  b, w = result.features.shape[:2]
  positions = result.verify_position[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
  state, c = _write(state, options, params, result.features, positions)
  # The new pending position is verify_position + accepted + 1: its c_(p-1) is the verified position `accepted`.
  return {**state, "last_context": c[jnp.arange(b), result.accepted]}


def draft_logits(target_params, params, options: Options, state, inputs: DraftInputs, gamma: int) -> jax.Array:
  """The block's draft logits [B, gamma, V'] for slots 1..gamma after the pending token: one forward."""
  config = options.config
  rows = jnp.arange(inputs.position.shape[0])
  pending = inputs.sequence[rows, inputs.position]
  x = block_input(target_params, params, pending, state["last_context"], gamma, config)  # [B, g + 1, D]
  positions = inputs.position[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)[None]
  g = run_block(params, options, x, positions, (inputs.position - 1)[:, None], list(zip(state["k"], state["v"])))
  return draft_head.logits(target_params, params, g[:, 1:], config)


def propose(target_params, params, options: Options, state, inputs: DraftInputs, gamma: int,
            sampling: SamplingParams):
  if gamma > options.block_size:  # static; generate() checks max_gamma first with a clearer message
    raise ValueError(f"{NAME} drafts blocks of {options.block_size}, gamma={gamma}")
  logits = draft_logits(target_params, params, options, state, inputs, gamma)  # [B, gamma, V']
  one = jnp.ones((), jnp.int32)
  token_map = params.get("token_map")
  if inputs.tree_nodes and options.rank_accuracy is not None:
    tokens, probs, parents = draft_tree.static_tree_tokens(logits, options.rank_accuracy, gamma, inputs.tree_nodes,
                                                           sampling, token_map, options.config.vocab_size)
    return Proposal(tokens=tokens, probs=probs, state=state, target_cache=inputs.target_cache, steps=one,
                    parents=parents)
  if inputs.tree_nodes:
    def expand(d, tokens, payload):  # slot d scores the children of every node of depth d - 1 alike
      return jnp.broadcast_to(logits[:, None, d - 1], tokens.shape + logits.shape[-1:]), payload

    tokens, probs, parents = draft_tree.grow(logits[:, 0], (), expand, gamma, inputs.tree_nodes, sampling, token_map,
                                             options.config.vocab_size)
    return Proposal(tokens=tokens, probs=probs, state=state, target_cache=inputs.target_cache, steps=one,
                    parents=parents)
  tokens, probs = choose_tokens(logits, inputs.key, sampling, token_map, options.config.vocab_size)
  # One forward drafted every slot, so stopping early trims the verification, not drafting.
  return Proposal(tokens=tokens, probs=probs, state=state, target_cache=inputs.target_cache,
                  lengths=draft_lengths(confidence(logits, probs), inputs, gamma), steps=one)


# ---------------------------------------------------------------------------------------------------- training


def block_outputs(target_params, params, options: Options, batch) -> jax.Array:
  """g [B, T, gamma, D]: the block anchored at every position t of the batch's sequences (tokens [B, T], features
  [B, T, F, D]), seeing the context at positions < t: slot i at t stands for token t + i."""
  config = options.config
  tokens = batch["tokens"]
  b, t = tokens.shape
  gamma = options.block_size
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
  c = context(params, batch["features"], jnp.float32)
  caches = context_kv(params, options, c, positions)
  # Anchor t reads c_(t-1), as decoding's pending p reads the state's c_(p-1) (zero before the first position).
  x = block_input(target_params, params, tokens, draft_head.shifted_back(c, 1), gamma, config)  # [B, T, g + 1, D]
  x = x.astype(jnp.float32)
  block_positions = positions[..., None] + jnp.arange(gamma + 1, dtype=jnp.int32)  # [B, T, g + 1]
  g = run_block(params, options, x.reshape(b, t * (gamma + 1), -1), block_positions.reshape(b, -1), positions - 1,
                caches)
  return g.reshape(b, t, gamma + 1, -1)[:, :, 1:]


def depth_logits(target_params, params, options: Options, batch) -> list[tuple[jax.Array, int]]:
  """Per slot i, (logits [B, T, V'] of the block anchored at every position t of a batch of cached features, i - 1):
  slot i at t drafts token t + i, the target's greedy token at t + i - 1 (`draft_tree.rank_accuracy`)."""
  g = block_outputs(target_params, params, options, batch)
  return [(draft_head.logits(target_params, params, g[:, :, i - 1], options.config), i - 1)
          for i in range(1, options.block_size + 1)]


def loss(target_params, params, options: Options, batch):
  """Self-distillation over cached features (the module docstring): slot i at anchor t learns the target's
  distribution at position t + i - 1 (teacher_ids/probs [B, T, K]), over the batch's mask [B, T].
  Returns (sum_i 0.8^(i-1) loss_i, {"loss_i", "top1_i" per slot})."""
  g = block_outputs(target_params, params, options, batch)
  total, metrics = 0.0, {}
  for i in range(1, options.block_size + 1):
    logits = draft_head.logits(target_params, params, g[:, :, i - 1], options.config)
    loss_i, top1_i = draft_head.distill_loss(
        logits, draft_head.shifted(batch["teacher_ids"], i - 1), draft_head.shifted(batch["teacher_probs"], i - 1),
        draft_head.shifted(batch["mask"], i - 1, False), params, options.config.vocab_size)
    total = total + DEPTH_DECAY ** (i - 1) * loss_i
    metrics[f"loss_{i}"], metrics[f"top1_{i}"] = loss_i, top1_i
  return total, metrics


def fresh_params(model, options: Options, token_map=None, seed: int = 0) -> dict:
  """Each block a copy of the target's last layer; the feature projection averaging the feature layers; W_in as the
  sequential module's starts (`draft_head.fresh_fusion`: the anchor first reads the context feature); every slot's embedding m_i the mean of the target's (scaled as `embed` scales it)."""
  config = options.config
  d, n, f = config.hidden_size, options.layers, len(options.feature_layers)
  dtype = jnp.dtype(config.dtype)
  last = model.params["layers"][config.num_layers - 1]
  params = {k: jnp.broadcast_to(ops.dequantize(last[k]), (n,) + last[k].shape).astype(dtype)
            for k in block_keys(config)}
  params["feature_proj"] = (jnp.tile(jnp.eye(d), (f, 1)) / f).astype(dtype)
  params.update(draft_head.fresh_fusion(d, dtype, seed))
  mean = jnp.mean(ops.dequantize(model.params["embed"]).astype(jnp.float32), axis=0)
  if config.scale_embeddings:
    mean = mean * np.sqrt(d)
  params["mask"] = jnp.broadcast_to(mean, (options.block_size, d)).astype(dtype)
  if options.draft_vocab is not None:
    params["token_map"] = jnp.asarray(token_map, jnp.int32)
  return params


def default_feature_layers(config: ModelConfig) -> tuple[int, ...]:
  """EAGLE-3's low, middle and high layers: after layers 2, L/2 and L-3 (fewer for a shallow target)."""
  layers = config.num_layers
  return tuple(sorted({min(2, layers - 1), layers // 2, max(layers - 3, 0)}))


def make(model, path: str | None = "default", block_size: int = 4, layers: int = 1,
         feature_layers: tuple[int, ...] | None = None, token_map=None, rank_accuracy=None, seed: int = 0) -> Drafter:
  """path: "default" (the checkpoint shipped for this model), a checkpoint file, or None for fresh parameters.

  block_size (the most draft tokens a round proposes), layers, feature_layers (default: EAGLE-3's three),
  token_map (a truncated draft vocabulary) and seed (the random start) apply to fresh parameters; a checkpoint
  brings its own. rank_accuracy [block_size][R] makes trees Medusa's static ones; None reads it from beside the
  checkpoint where one was measured (`draft_head.ranks_path`).
  """
  config = model.config
  if path is None:
    if block_size < 1 or layers < 1:
      raise ValueError(f"block_size and layers must be positive, got {block_size} and {layers}")
    feature_layers = default_feature_layers(config) if feature_layers is None else tuple(int(i) for i in feature_layers)
    if not feature_layers or not all(0 <= i < config.num_layers for i in feature_layers):
      raise ValueError(f"feature_layers must name target layers in [0, {config.num_layers}), got {feature_layers}")
    token_map = None if token_map is None else draft_head.as_token_map(token_map, config.vocab_size)
    options = Options(config=config, block_size=int(block_size), layers=int(layers), feature_layers=feature_layers,
                      draft_vocab=None if token_map is None else int(token_map.size))
    params = fresh_params(model, options, token_map, seed)
  else:
    options, params = draft_head.load(model, NAME, path, saved_specs, lambda saved: Options(
        config=config, block_size=int(saved["block_size"]), layers=int(saved["layers"]),
        feature_layers=tuple(int(i) for i in saved["feature_layers"]), draft_vocab=saved["draft_vocab"]))
  rank_accuracy = draft_head.stored_rank_accuracy(model, NAME, path, rank_accuracy, options.block_size)
  if rank_accuracy is not None:
    options = dataclasses.replace(options, rank_accuracy=rank_accuracy)
  if options.draft_vocab is not None:
    params["head"] = draft_head.head_columns(model.params, config, params["token_map"])
  return Drafter(name=NAME, init=init, propose=propose, update=update, options=options, params=params,
                 param_specs=param_specs(options), loss=loss, feature_layers=options.feature_layers,
                 max_gamma=options.block_size, trees=TREES, cost=cost(model, options, params))


def cost(model, options: Options, params) -> DraftCost:
  """A round is one forward, whatever its length: the blocks' weights, the anchor's fusion, the slots' embeddings and
  the (truncated) head, read once, and the context's projection (`round`); drafting a slot more adds nothing to first order (`step` 0). Following a plain
  step writes one position's context: the projection and the blocks' key/value weights."""
  config = model.config
  own = {k: params[k] for k in block_keys(config) + draft_head.FUSION + ("feature_proj", "mask")}
  forward = leviathan.draft_cost(model.params, config, (), own, head_columns=options.draft_vocab)
  kv = {k: params[k] for k in ("feature_proj",) + tuple(k for k in block_keys(config) if k in ("wk", "wv"))}
  plain = leviathan.draft_cost(model.params, config, (), kv, head_columns=0)
  return DraftCost(round=forward, plain_step=plain)
