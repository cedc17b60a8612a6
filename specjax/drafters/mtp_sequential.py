"""Sequential multi-token-prediction modules (DeepSeek-V3 §2.2; EAGLE, Li et al. 2024; EAGLE-3, Li et al. 2025).

A module turns the target's hidden state at position i and the embedding of the token after it into a
hidden state that predicts one token further:

    x_i = W [RMSNorm(emb(t_{i+1})); RMSNorm(h_i)]        (embedding first, as in DeepSeek-V3's weights)
    g_i = Block(x_i)                                       (one transformer block of the target's shape)
    logits = LMHead(FinalNorm(g_i))                        (the target's, frozen and shared; `draft_head`)

so with h the target's last hidden state, g_i predicts t_{i+2}. Chaining: drafting step k feeds the previous
step's g and the token it drafted into module k (or, with `recurrent=True`, into the one module applied
again and again, as EAGLE does), which runs one position further. With `feature_layers` of three layers
(EAGLE-3: after layers 2, L/2 and L-3) h is a learned projection of their concatenation (3D -> D).

KV caches. Each module keeps its own K/V cache over committed positions, computed from the TRUE target
features: after every verification (`update`) each module runs over the gamma + 1 verified positions with
the target's hidden states from that same verification forward (no extra target call; plain target steps
too); slots past a row's committed length are overwritten in the next round before anything reads them. Module
1's output at the newest committed position p-1 is kept, and gives the first draft at no cost in the next round.
Drafting step k (k >= 2) runs at position q = p - 2 + k and attends to the committed slots (<= p-1) plus what
this round wrote at positions p..q: with a recurrent module those are its own earlier drafting steps; with
distinct modules, only module k's own position q.

Trees (EAGLE-2's dynamic trees, `draft_tree.grow`): expanding a node of depth d - 1 is drafting step d over it: the
module reads the node's token and the output that drafted it, at position p - 2 + d, attending to the committed
slots and (recurrent) to the K/V of the steps that drafted its ancestors, or (distinct modules) to its own only,
exactly what a chain through that node would see. The k nodes a step expands run as k queries of one call; their
K/V travel with the nodes, so the module caches hold committed positions only.

Training (`loss`, self-distillation on cached features) follows exactly that visibility (EAGLE-3's
"training-time test"): depth k at position j reads g^{k-1}_{j-1} from depth k-1, attends to true-feature
K/V at positions <= j-k+1 and to the drafted K/V of depths 2..k at positions j-k+2..j (recurrent) or only
its own (distinct modules), and learns the target's distribution at position j+1 with weight 0.8^(k-1).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax import leviathan, ops
from specjax.drafters import (DraftCost, Drafter, DraftInputs, PromptInfo, Proposal, RoundResult, choose_tokens,
                              confidence, draft_head, draft_tree, keeps)
from specjax.model import (ParamSpec, attend, attention_output, embed, layer_shapes, mlp_block, node_attention_block,
                           qkv)
from specjax.sampling import SamplingParams

NAME = "mtp_sequential"
DEPTH_DECAY = 0.8
TREES = True  # drafts EAGLE-2's trees (`propose` with `DraftInputs.tree_nodes`)
INPUT = draft_head.FUSION  # a module's own arrays before its block (a decoder layer's arrays)


@dataclasses.dataclass(frozen=True)
class Options:
  config: ModelConfig
  depth: int  # distinct modules (max gamma); with recurrent=True, the depth unrolled in training
  recurrent: bool  # one module applied at every drafting step (EAGLE) instead of one module per step
  feature_layers: tuple[int, ...]  # target layers whose outputs form h (last layer: DeepSeek/EAGLE; 3: EAGLE-3)
  draft_vocab: int | None  # V' of a truncated draft vocabulary; None scores the full vocabulary

  @property
  def num_modules(self) -> int:
    return 1 if self.recurrent else self.depth

  def saved(self) -> dict:
    return {"depth": self.depth, "recurrent": self.recurrent, "feature_layers": list(self.feature_layers),
            "draft_vocab": self.draft_vocab}


def block_keys(config: ModelConfig) -> tuple[str, ...]:
  """A module's block: the arrays of one decoder layer of the target's kind."""
  return tuple(layer_shapes(config))


def saved_specs(options: Options) -> dict:
  c, m = options.config, options.num_modules
  d = c.hidden_size
  specs = {
      **draft_head.fusion_specs(d, m),
      **{k: ParamSpec((m,) + spec.shape, ("stack",) + spec.axes) for k, spec in layer_shapes(c).items()},
  }
  if len(options.feature_layers) > 1:
    specs["feature_proj"] = ParamSpec((len(options.feature_layers) * d, d), ("embed", "embed"))
  if options.draft_vocab is not None:
    specs["token_map"] = draft_head.head_specs(c, options.draft_vocab)["token_map"]
  return specs


def param_specs(options: Options) -> dict:
  return {**saved_specs(options), **draft_head.head_specs(options.config, options.draft_vocab)}


# ------------------------------------------------------------------------------------------- the module


def _module(params, m: int, config: ModelConfig) -> dict:
  """Module m's arrays: sliced from the stacks, or as decoding on a CPU lays them out (`backends.cpu.pack_draft_params`:
  one dict per module)."""
  if "blocks" in params:
    return params["blocks"][m]
  return {k: params[k][m] for k in INPUT + block_keys(config)}


def features_to_hidden(params, features: jax.Array) -> jax.Array:
  """h [B, T, D] from the target features [B, T, F, D] (a projection of their concatenation when F > 1)."""
  if "feature_proj" not in params:
    return features[:, :, 0, :]
  flat = features.reshape(features.shape[:2] + (-1,))
  return ops.matmul(flat, params["feature_proj"].astype(flat.dtype))


def finish(mp, x, attn_update, config: ModelConfig) -> jax.Array:
  """The block's residual updates after attention, given its update Wo attn: g = x + Wo attn; g + MLP(g)."""
  x = x + attn_update
  return x + mlp_block(mp, x, config)


def _run_true(target_params, params, options: Options, state, next_tokens, features, positions):
  """Every module over positions [B, T] with true inputs (tokens after them, target features): writes their
  K/V into the caches; returns (state, module 1's outputs [B, T, D])."""
  config = options.config
  token_emb = embed(target_params, next_tokens, config)
  hidden = features_to_hidden(params, features).astype(token_emb.dtype)
  k_caches, v_caches, first = [], [], None
  for m in range(options.num_modules):
    mp = _module(params, m, config)
    x = draft_head.fuse(mp, token_emb, hidden, config)
    q, k, v = qkv(mp, x, positions, config)
    k_cache, v_cache = (ops.cache_write(state["k"][m], k, positions, in_place=False),
                        ops.cache_write(state["v"][m], v, positions, in_place=False))
    if m == 0:  # causal over the committed slots
      first = finish(mp, x, attention_output(mp, attend(q, k_cache, v_cache, positions, config), config), config)
    k_caches.append(k_cache)
    v_caches.append(v_cache)
  return {**state, "k": jnp.stack(k_caches), "v": jnp.stack(v_caches)}, first


# ------------------------------------------------------------------------------------------ the drafter


def init(target_params, params, options: Options, prompt: PromptInfo):
  config, (b, t) = options.config, prompt.tokens.shape
  rows = jnp.arange(b)
  shape = (options.num_modules, b, prompt.cache_len, config.num_kv_heads, config.head_dim)
  dtype = jnp.dtype(config.dtype)
  state = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
           "hidden": jnp.zeros((b, config.hidden_size), dtype)}
  next_tokens = draft_head.shifted(prompt.tokens, 1).at[rows, prompt.lengths - 1].set(prompt.first_token)
  positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
  state, first = _run_true(target_params, params, options, state, next_tokens, prompt.features, positions)
  return {**state, "hidden": first[rows, prompt.lengths - 1]}


def propose(target_params, params, options: Options, state, inputs: DraftInputs, gamma: int,
            sampling: SamplingParams):
  config = options.config
  if not options.recurrent and gamma > options.depth:
    raise ValueError(f"{NAME} has {options.depth} modules, gamma={gamma}")
  if inputs.tree_nodes:
    return _propose_tree(target_params, params, options, state, inputs, gamma, sampling)
  keys = jax.random.split(inputs.key, gamma)
  p = inputs.position
  token_map = params.get("token_map")
  budget = gamma if inputs.budget is None else inputs.budget

  def choose(hidden, key):
    logits = draft_head.logits(target_params, params, hidden, config)
    token, q = choose_tokens(logits, key, sampling, token_map, config.vocab_size)
    return token, q, confidence(logits, q)

  def advance(step, carry):
    token, _, _, hidden, k_all, v_all = carry
    m = 0 if options.recurrent else step - 1
    mp = _module(params, m, config)
    position = (p + step - 2)[:, None]  # [B, 1]
    x = draft_head.fuse(mp, embed(target_params, token[:, None], config), hidden[:, None], config)
    q_, k, v = qkv(mp, x, position, config)
    k_cache, v_cache = (ops.cache_write(k_all[m], k, position, in_place=False),
                        ops.cache_write(v_all[m], v, position, in_place=False))
    if options.recurrent:  # committed slots and this round's drafts p..q, all written by this module: causal
      attn = attend(q_, k_cache, v_cache, position, config)
    else:  # committed slots and this module's own position
      slots = jnp.arange(k_cache.shape[1])[None, None, :]
      own = (slots <= (p - 1)[:, None, None]) | (slots == position[:, :, None])
      attn = attend(q_, k_cache, v_cache, position, config, mask=own)
    hidden = finish(mp, x, attention_output(mp, attn, config), config)[:, 0]
    return (*choose(hidden, keys[step - 1]), hidden, k_all.at[m].set(k_cache), v_all.at[m].set(v_cache))

  token, q, sure = choose(state["hidden"], keys[0])
  tokens, probs, joint = [token], [q], sure
  kept, active = keeps(joint, inputs, 0, gamma)  # active: the row drafts the next slot
  lengths, steps = kept.astype(jnp.int32), jnp.ones((), jnp.int32)
  carry = (token, q, sure, state["hidden"], state["k"], state["v"])
  for step in range(2, gamma + 1):
    go = (step <= budget) & jnp.any(active)  # no module runs once every row has stopped
    carry = jax.lax.cond(go, functools.partial(advance, step), lambda carry: carry, carry)
    token, q, sure = carry[:3]
    joint = joint * sure
    kept, goes_on = keeps(joint, inputs, step - 1, gamma)
    lengths, steps = lengths + (active & go & kept), steps + go
    active = active & go & goes_on
    tokens.append(token)
    probs.append(q)
  state = {**state, "k": carry[4], "v": carry[5]}
  return Proposal(tokens=jnp.stack(tokens, axis=1), probs=None if sampling.greedy else jnp.stack(probs, axis=1),
                  state=state, target_cache=inputs.target_cache, lengths=lengths, steps=steps)


def _propose_tree(target_params, params, options: Options, state, inputs: DraftInputs, gamma: int,
                  sampling: SamplingParams) -> Proposal:
  """A tree of `inputs.tree_nodes` nodes, at most gamma deep (the module docstring)."""
  config, p = options.config, inputs.position
  b = p.shape[0]
  kv_shape = (b, 0, config.num_kv_heads, config.head_dim)
  # A node carries the output that drafted it and the K/V of the steps that drafted its ancestors (recurrent).
  first = {"hidden": state["hidden"], "k": jnp.zeros(kv_shape, state["k"].dtype),
           "v": jnp.zeros(kv_shape, state["v"].dtype)}

  def expand(d, tokens, node):
    m = 0 if options.recurrent else d - 1
    mp = _module(params, m, config)
    x = draft_head.fuse(mp, embed(target_params, tokens, config), node["hidden"], config)
    # Every node sees the committed slots, its ancestors' K/V (none for chained modules: each depth is another
    # module) and its own.
    update, keys, values = node_attention_block(mp, x, state["k"][m], state["v"][m], p - 1,
                                                jnp.broadcast_to((p + d - 2)[:, None], tokens.shape), node["k"],
                                                node["v"], config)
    hidden = finish(mp, x, update, config)
    children = {"hidden": hidden, "k": keys if options.recurrent else node["k"],
                "v": values if options.recurrent else node["v"]}
    return draft_head.logits(target_params, params, hidden, config), children

  tokens, probs, parents = draft_tree.grow(draft_head.logits(target_params, params, state["hidden"], config), first,
                                           expand, gamma, inputs.tree_nodes, sampling, params.get("token_map"),
                                           config.vocab_size)
  return Proposal(tokens=tokens, probs=probs, state=state, target_cache=inputs.target_cache,
                  steps=jnp.asarray(gamma, jnp.int32), parents=parents)


def update(target_params, params, options: Options, state, result: RoundResult):
  # The verified positions p..p+gamma now have true target features; the token after each is committed
  # up to p + accepted + 1 (later slots are stale and get overwritten before they are read).
  b, width = result.verify_hidden.shape[:2]
  rows = jnp.arange(b)
  positions = result.verify_position[:, None] + jnp.arange(width)[None, :]
  next_tokens = result.sequence[rows[:, None], jnp.minimum(positions + 1, result.sequence.shape[1] - 1)]
  state, first = _run_true(target_params, params, options, state, next_tokens, result.features, positions)
  return {**state, "hidden": first[rows, result.accepted]}


def loss(target_params, params, options: Options, batch):
  """Self-distillation with training-time test (see the module docstring) over cached features.

  batch: tokens/mask [B, T], features [B, T, F, D] (the drafter's feature layers), teacher_ids/probs [B, T, K].
  Returns (sum_k 0.8^(k-1) loss_k, {"loss_k", "top1_k" per depth}).
  """
  config = options.config
  tokens = batch["tokens"]
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
  token_emb = embed(target_params, draft_head.shifted(tokens, 1), config).astype(jnp.float32)
  hidden0 = features_to_hidden(params, batch["features"].astype(jnp.float32))
  teacher_ids = draft_head.shifted(batch["teacher_ids"], 1)
  teacher_probs = draft_head.shifted(batch["teacher_probs"], 1)
  target_mask = draft_head.shifted(batch["mask"], 1, False)  # depth k at j predicts t_{j+2}: the target at j+1
  true_kv = {}

  def true_keys(m):
    if m not in true_kv:
      mp = _module(params, m, config)
      x = draft_head.fuse(mp, token_emb, hidden0, config)
      true_kv[m] = (x,) + qkv(mp, x, positions, config)
    return true_kv[m]

  slots = jnp.arange(t)
  total, metrics, hidden, drafted = 0.0, {}, None, []
  for k in range(1, options.depth + 1):
    m = 0 if options.recurrent else k - 1
    mp = _module(params, m, config)
    x_true, q_true, k_true, v_true = true_keys(m)
    if k == 1:
      hidden = finish(mp, x_true, attention_output(mp, attend(q_true, k_true, v_true, positions, config), config), config)
    else:
      prev = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))  # g^{k-1}_{j-1} at position j
      x = draft_head.fuse(mp, token_emb, prev, config)
      q, k_new, v_new = qkv(mp, x, positions, config)
      drafted = (drafted if options.recurrent else []) + [(k_new, v_new)]
      # Depth d's drafted K/V (d = k - len + 1 .. k) sit at position j - (k - d) for the query at j.
      n = len(drafted)
      extra_k = jnp.stack([draft_head.shifted_back(kd, n - 1 - i) for i, (kd, _) in enumerate(drafted)], axis=2)
      extra_v = jnp.stack([draft_head.shifted_back(vd, n - 1 - i) for i, (_, vd) in enumerate(drafted)], axis=2)
      attn = attend(q, k_true, v_true, positions - (k - 1), config, extra_keys=extra_k, extra_values=extra_v)
      hidden = finish(mp, x, attention_output(mp, attn, config), config)
    valid = target_mask & (slots[None, :] >= k - 1)
    loss_k, top1_k = draft_head.distill_loss(draft_head.logits(target_params, params, hidden, config), teacher_ids,
                                             teacher_probs, valid, params, config.vocab_size)
    total = total + DEPTH_DECAY ** (k - 1) * loss_k
    metrics[f"loss_{k}"], metrics[f"top1_{k}"] = loss_k, top1_k
  return total, metrics


def fresh_params(model, options: Options, token_map=None, seed: int = 0) -> dict:
  """fc starts as [small random; identity] (the module first reads the target's hidden state), each block
  as a copy of the target's last layer, norms at one, the feature projection averaging the layers."""
  config, m = options.config, options.num_modules
  d = config.hidden_size
  dtype = jnp.dtype(config.dtype)
  last = model.params["layers"][config.num_layers - 1]
  params = draft_head.fresh_fusion(d, dtype, seed, stack=m)
  params.update({name: jnp.broadcast_to(ops.dequantize(last[name]), (m,) + last[name].shape).astype(dtype)
                 for name in block_keys(config)})
  if len(options.feature_layers) > 1:
    n = len(options.feature_layers)
    params["feature_proj"] = (jnp.tile(jnp.eye(d), (n, 1)) / n).astype(dtype)
  if options.draft_vocab is not None:
    params["token_map"] = jnp.asarray(token_map, jnp.int32)
  return params


def default_feature_layers(config: ModelConfig, eagle3: bool) -> tuple[int, ...]:
  """(L-1,) (the last hidden state), or EAGLE-3's low, middle and high layers (2, L/2, L-3)."""
  n = config.num_layers
  return (min(2, n - 1), n // 2, max(n - 3, 0)) if eagle3 else (n - 1,)


def make(model, path: str | None = "default", depth: int = 4, recurrent: bool = False, eagle3: bool = False,
         token_map=None, seed: int = 0) -> Drafter:
  """path: "default" (the checkpoint shipped for this model), a checkpoint file, or None for fresh modules.

  depth: number of modules (the most drafts a round), or with recurrent=True the depth trained.
  eagle3: read the target's layers 2, L/2 and L-3 instead of its last hidden state.
  token_map: the draft vocabulary (token ids) of fresh modules; a checkpoint brings its own options.
  """
  config = model.config
  if path is None:
    if depth < 1:
      raise ValueError(f"depth must be positive, got {depth}")
    token_map = None if token_map is None else draft_head.as_token_map(token_map, config.vocab_size)
    options = Options(config=config, depth=int(depth), recurrent=bool(recurrent),
                      feature_layers=default_feature_layers(config, eagle3),
                      draft_vocab=None if token_map is None else int(token_map.size))
    params = fresh_params(model, options, token_map, seed)
  else:
    options, params = draft_head.load(model, NAME, path, saved_specs, lambda saved: Options(
        config=config, depth=int(saved["depth"]), recurrent=bool(saved["recurrent"]),
        feature_layers=tuple(int(i) for i in saved["feature_layers"]), draft_vocab=saved["draft_vocab"]))
  if max(options.feature_layers) >= config.num_layers:
    raise ValueError(f"feature layers {options.feature_layers} exceed the target's {config.num_layers} layers")
  if options.draft_vocab is not None:
    params["head"] = draft_head.head_columns(model.params, config, params["token_map"])
  return Drafter(name=NAME, init=init, propose=propose, update=update, options=options, params=params,
                 param_specs=param_specs(options), loss=loss, feature_layers=options.feature_layers,
                 max_gamma=None if options.recurrent else options.depth, cost=cost(model, options, params), trees=TREES)


def cost(model, options: Options, params) -> DraftCost:
  """A draft step reads one module and the (truncated) head; following a plain step, every module over one
  position (no head)."""
  own = INPUT + block_keys(model.config)
  module = {k: v[0] for k, v in params.items() if k in own}
  modules = {k: v for k, v in params.items() if k in own + ("feature_proj",)}
  return DraftCost(step=leviathan.draft_cost(model.params, model.config, (), module, options.draft_vocab),
                   plain_step=leviathan.draft_cost(model.params, model.config, (), modules, head_columns=0))
