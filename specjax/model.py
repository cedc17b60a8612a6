"""A Llama-family decoder as pure functions over a parameter pytree.

Parameters are a plain nested dict (see `param_shapes` for every array's shape and logical axes):

  embed [vocab, embed]; final_norm [embed]; lm_head [embed, vocab] (absent when tied);
  layers: a list, one dict per layer, of
    attn_norm [embed], wq [embed, heads, head_dim], wk/wv [embed, kv_heads, head_dim],
    wo [heads, head_dim, embed], mlp_norm [embed], w_gate/w_up [embed, mlp], w_down [mlp, embed],
    and what the family's options add (`specjax.config.ModelConfig`): bq [heads, head_dim], bk/bv [kv_heads,
    head_dim] (qkv_bias); q_norm/k_norm [head_dim] (qk_norm); attn_post_norm/mlp_post_norm [embed] (post_norms).
Norm weights are multipliers (Gemma's 1 + w is added by the loaders). A layer's attention is full or sliding by the
config (`ModelConfig.window`); the cache keeps every position either way, and a sliding layer's queries read only
the last `sliding_window` of them.

Decoding on a CPU reads them laid out for its kernels (`specjax.backends.cpu.pack_params`): a layer's "wqkv" and
"w_gate_up" (the products that read the same input, side by side) and "lm_head_packed"; `forward` reads either
layout. Products and attention go through `specjax.ops`, which chooses by the platform a program is compiled for.
A GGUF loaded with `quantized=True` holds a matrix (the embedding table too) as its quantized blocks
(`specjax.backends.cpu.Quantized`), which stand for the float32 values gguf dequantizes them to: `ops.matmul`
multiplies by them, `ops.take` gathers from them (the embedding lookup decodes the looked-up rows only).

The KV cache is an explicit pytree passed in and returned; each row writes its T new positions at its own
offset (`positions[b]`), so rows of a batch may have different lengths. Query at absolute position p
attends to cache slots 0..p, so stale entries past a row's length are never read before being overwritten.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import ops
from specjax.config import ModelConfig, rope_inv_freq

Params = dict[str, Any]


class ParamSpec(NamedTuple):
  shape: tuple[int, ...]
  axes: tuple[str, ...]  # logical axis names, mapped to mesh axes by specjax.sharding


def layer_shapes(config: ModelConfig) -> Params:
  """Shape and logical axes of one decoder layer's arrays; the family options add theirs (`ModelConfig`)."""
  d, f = config.hidden_size, config.intermediate_size
  h, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
  norm = ParamSpec((d,), ("norm",))
  layer = {
      "attn_norm": norm,
      "wq": ParamSpec((d, h, hd), ("embed", "heads", "head_dim")),
      "wk": ParamSpec((d, kv, hd), ("embed", "kv_heads", "head_dim")),
      "wv": ParamSpec((d, kv, hd), ("embed", "kv_heads", "head_dim")),
      "wo": ParamSpec((h, hd, d), ("heads", "head_dim", "embed")),
      "mlp_norm": norm,
      "w_gate": ParamSpec((d, f), ("embed", "mlp")),
      "w_up": ParamSpec((d, f), ("embed", "mlp")),
      "w_down": ParamSpec((f, d), ("mlp", "embed")),
  }
  if config.qkv_bias:
    layer.update(bq=ParamSpec((h, hd), ("heads", "head_dim")), bk=ParamSpec((kv, hd), ("kv_heads", "head_dim")),
                 bv=ParamSpec((kv, hd), ("kv_heads", "head_dim")))
  if config.qk_norm:
    layer.update(q_norm=ParamSpec((hd,), ("norm",)), k_norm=ParamSpec((hd,), ("norm",)))
  if config.post_norms:
    layer.update(attn_post_norm=norm, mlp_post_norm=norm)
  return layer


def attention_keys(config: ModelConfig) -> tuple[str, ...]:
  """The names of a layer's attention arrays (its norms included), as `layer_shapes` has them for `config`."""
  return tuple(k for k in layer_shapes(config) if k not in mlp_keys(config))


def mlp_keys(config: ModelConfig) -> tuple[str, ...]:
  """The names of a layer's MLP arrays (its norms included)."""
  return ("mlp_norm", "w_gate", "w_up", "w_down") + (("mlp_post_norm",) if config.post_norms else ())


def param_shapes(config: ModelConfig) -> Params:
  """The abstract parameter tree: shape and logical axes of every array."""
  d, v = config.hidden_size, config.vocab_size
  tree = {
      "embed": ParamSpec((v, d), ("vocab", "embed")),
      "layers": [layer_shapes(config) for _ in range(config.num_layers)],
      "final_norm": ParamSpec((d,), ("norm",)),
  }
  if not config.tie_embeddings:
    tree["lm_head"] = ParamSpec((d, v), ("embed", "vocab"))
  return tree


def is_spec(x) -> bool:
  return isinstance(x, ParamSpec)


def init_params(config: ModelConfig, key: jax.Array, std: float = 0.02) -> Params:
  """Random parameters (normal(0, std) matrices, unit norms) for tests and training from scratch."""
  specs, treedef = jax.tree_util.tree_flatten(param_shapes(config), is_leaf=is_spec)
  keys = jax.random.split(key, len(specs))
  dtype = jnp.dtype(config.dtype)
  leaves = [jnp.ones(s.shape, dtype) if s.axes == ("norm",) else
            (std * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype) for s, k in zip(specs, keys)]
  return jax.tree_util.tree_unflatten(treedef, leaves)


@struct.dataclass
class KVCache:
  """Per-layer keys and values, each [batch, max_len, kv_heads, head_dim]."""
  k: list[jax.Array]
  v: list[jax.Array]


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
  dtype = jnp.dtype(dtype or config.dtype)
  shape = (batch_size, max_len, config.num_kv_heads, config.head_dim)
  return KVCache(k=[jnp.zeros(shape, dtype) for _ in range(config.num_layers)],
                 v=[jnp.zeros(shape, dtype) for _ in range(config.num_layers)])


class ForwardOutput(NamedTuple):
  logits: jax.Array | None  # [B, T, vocab] float32 (None when compute_logits=False)
  hidden: jax.Array  # [B, T, embed] residual stream after the last layer run, before the final norm
  cache: KVCache
  layer_hidden: list[jax.Array] | None  # residual stream after each layer run (when requested)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight * xf.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotary embedding, HF "rotate_half" layout. x [B, T, N, hd], positions [B, T]."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, hd/2]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
  sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def project_heads(h: jax.Array, w: jax.Array) -> jax.Array:
  """h [B, T, D] @ w [D, N, hd] -> [B, T, N, hd]."""
  return ops.matmul(h, w.reshape(w.shape[0], -1)).reshape(*h.shape[:-1], *w.shape[1:])


def merge_heads(out: jax.Array, w: jax.Array) -> jax.Array:
  """out [B, T, N, hd] @ w [N, hd, D] -> [B, T, D]."""
  return ops.matmul(out.reshape(*out.shape[:-2], -1), w.reshape(-1, w.shape[-1]))


def qkv(layer: Params, x: jax.Array, positions: jax.Array, config: ModelConfig, *, sliding: bool = False):
  """Queries [B, T, H, hd] and keys/values [B, T, KV, hd] of a layer's attention over the residual stream x
  [B, T, D] at `positions` [B, T], RoPE applied (a sliding layer's own where the config gives it one) and the queries
  scaled so that `attend`'s q.k / sqrt(hd) is the family's score: the target's layers, the MTP modules' blocks and
  the exit adapter."""
  h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
  heads = (config.num_heads, config.num_kv_heads, config.num_kv_heads)
  if "wqkv" in layer:  # laid out for decoding (backends.cpu.pack_layer): one product for the three
    parts = jnp.split(ops.matmul(h, layer["wqkv"]), np.cumsum(heads[:2]) * config.head_dim, axis=-1)
    q, k, v = (a.reshape(*h.shape[:-1], n, config.head_dim) for a, n in zip(parts, heads))
  else:
    q, k, v = project_heads(h, layer["wq"]), project_heads(h, layer["wk"]), project_heads(h, layer["wv"])
  if config.qkv_bias:
    q, k, v = q + layer["bq"].astype(q.dtype), k + layer["bk"].astype(k.dtype), v + layer["bv"].astype(v.dtype)
  if config.qk_norm:
    q, k = rms_norm(q, layer["q_norm"], config.rms_norm_eps), rms_norm(k, layer["k_norm"], config.rms_norm_eps)
  inv_freq = jnp.asarray(rope_inv_freq(config, sliding=sliding), jnp.float32)
  q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
  if config.query_pre_attn_scalar is not None:
    q = q * jnp.asarray(np.sqrt(config.head_dim / config.query_pre_attn_scalar), q.dtype)
  return q, k, v


def attend(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array, config: ModelConfig, *,
           window: int | None = None, query_positions: jax.Array | None = None, **extra) -> jax.Array:
  """`ops.attention` as a layer of this config attends: scores soft-capped where the family caps them, and with a
  sliding `window` each query at query_positions[b, t] (default: `positions`, the last slot it sees) sees only the
  cache slots after query_positions - window. `extra`: ops.attention's mask and extra keys."""
  starts = None
  if window is not None:
    starts = (positions if query_positions is None else query_positions) - (window - 1)
  return ops.attention(q, keys, values, positions, starts=starts, softcap=config.attn_softcap, **extra)


def attention_output(layer: Params, out: jax.Array, config: ModelConfig) -> jax.Array:
  """A layer's residual update from its attention's output [B, T, H, hd]: Wo, then the post-norm where it has one."""
  update = merge_heads(out, layer["wo"])
  if config.post_norms:
    update = rms_norm(update, layer["attn_post_norm"], config.rms_norm_eps)
  return update


def attention_block(layer: Params, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                    config: ModelConfig, *, block: BlockMask | None = None, window: int | None = None):
  """Pre-norm grouped-query self-attention over the cache: x [B, T, D] written at cache slots `positions` [B, T],
  each seeing slots up to its own (the last `window` of them in a sliding layer). With a `block` (a draft tree's
  nodes), token t is at RoPE position positions[b, 0] + depths[b, t] and sees the slots before the block and, of the
  block's own keys, the visible ones. Returns (residual update, k_cache, v_cache)."""
  rope_positions = positions if block is None else positions[:, :1] + block.depths
  q, k, v = qkv(layer, x, rope_positions, config, sliding=window is not None)
  k_cache = ops.cache_write(k_cache, k, positions)
  v_cache = ops.cache_write(v_cache, v, positions)
  if block is None:
    out = attend(q, k_cache, v_cache, positions, config, window=window)
  else:  # the committed slots (all of them, for every node), then the block's keys under the tree mask
    committed = jnp.broadcast_to(positions[:, :1] - 1, positions.shape)
    out = attend(q, k_cache, v_cache, committed, config, window=window, query_positions=rope_positions,
                 extra_keys=k.astype(k_cache.dtype), extra_values=v.astype(v_cache.dtype), extra_mask=block.visible)
  return attention_output(layer, out, config), k_cache, v_cache


def node_attention_block(layer: Params, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, committed: jax.Array,
                         positions: jax.Array, ancestor_keys: jax.Array, ancestor_values: jax.Array,
                         config: ModelConfig, *, window: int | None = None):
  """Pre-norm attention of draft-tree nodes that are not one sequence: x [B, T, D] holds T nodes per row, node t at
  RoPE position positions[b, t], seeing the cache slots 0..committed[b] (of a sliding layer, the last `window`
  positions before its own) and, beside them, the keys and values of its own ancestors ancestor_keys/values
  [B, T, E, KV, hd] and its own. Writes nothing into the cache (nodes of one depth share a position). Returns
  (residual update, keys, values [B, T, E + 1, KV, hd]: what its children see)."""
  q, k, v = qkv(layer, x, positions, config, sliding=window is not None)
  keys = jnp.concatenate([ancestor_keys, k[:, :, None].astype(ancestor_keys.dtype)], axis=2)
  values = jnp.concatenate([ancestor_values, v[:, :, None].astype(ancestor_values.dtype)], axis=2)
  seen = jnp.broadcast_to(committed[:, None], positions.shape)
  out = attend(q, k_cache, v_cache, seen, config, window=window, query_positions=positions, extra_keys=keys,
               extra_values=values)
  return attention_output(layer, out, config), keys, values


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def mlp_block(layer: Params, x: jax.Array, config: ModelConfig) -> jax.Array:
  """A layer's MLP residual update: W_down (act(W_gate h) * W_up h) of h = RMSNorm(x), post-normed where the family
  has post-norms."""
  h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
  if "w_gate_up" in layer:  # laid out for decoding (backends.cpu.pack_layer): one product for both
    gate, up = jnp.split(ops.matmul(h, layer["w_gate_up"]), 2, axis=-1)
  else:
    gate, up = ops.matmul(h, layer["w_gate"]), ops.matmul(h, layer["w_up"])
  update = ops.matmul(_ACTIVATIONS[config.activation](gate) * up, layer["w_down"])
  if config.post_norms:
    update = rms_norm(update, layer["mlp_post_norm"], config.rms_norm_eps)
  return update


def lm_head(params: Params, hidden: jax.Array, config: ModelConfig) -> jax.Array:
  """Final norm + output projection; float32 logits."""
  return output_projection(params, rms_norm(hidden, params["final_norm"], config.rms_norm_eps), config)


def output_projection(params: Params, h: jax.Array, config: ModelConfig) -> jax.Array:
  """float32 logits of normed hidden states h [..., D]: the LM head, or the tied embedding table (soft-capped where the
  family caps its logits)."""
  if "lm_head_packed" in params:  # laid out for decoding (backends.cpu.pack_params)
    logits = ops.matmul(h, params["lm_head_packed"], preferred_element_type=jnp.float32)
  elif config.tie_embeddings:
    logits = ops.matmul_transposed(h, params["embed"], preferred_element_type=jnp.float32)
  else:
    logits = ops.matmul(h, params["lm_head"], preferred_element_type=jnp.float32)
  return softcap_logits(logits, config)


def softcap_logits(logits: jax.Array, config: ModelConfig) -> jax.Array:
  """c * tanh(logits / c) where the family caps its final logits (Gemma 2), else the logits as they are."""
  if config.final_softcap is None:
    return logits
  return config.final_softcap * jnp.tanh(logits / config.final_softcap)


def embed(params: Params, tokens: jax.Array, config: ModelConfig) -> jax.Array:
  """The input embeddings of tokens, times sqrt(hidden_size) in the parameter dtype where the family scales them."""
  x = ops.take(params["embed"], tokens)
  if config.scale_embeddings:
    x = x * jnp.asarray(np.sqrt(config.hidden_size), x.dtype)
  return x


class BlockMask(NamedTuple):
  """The tokens of a block that do not form one sequence: a draft tree verified in one forward (SpecInfer, Miao et
  al. 2024; Medusa, Cai et al. 2024). Token t of the block sits at depths[b, t] after the block's first position
  (RoPE) and sees, of the block, only the tokens u <= t where visible[b, t, u] (its ancestors and itself); the
  slots before the block it sees as a causal block would."""
  depths: jax.Array  # [B, T] int32
  visible: jax.Array  # [B, T, T] bool


def forward(params: Params, tokens: jax.Array | None, cache: KVCache, positions: jax.Array, config: ModelConfig, *,
            layers: Sequence[int] | None = None, compute_logits: bool = True, return_layer_hidden: bool = False,
            hidden: jax.Array | None = None, block: BlockMask | None = None) -> ForwardOutput:
  """Runs tokens [B, T] written at per-row offsets `positions` [B] through the decoder.

  `layers` (static) selects which layers run, in order (default: all); layers not run keep their cache.
  Layer-skip drafters use it to run the first k layers, or all but a skipped set. `hidden` [B, T, D] is the
  residual stream entering the first layer run, in place of the tokens' embeddings (tokens may then be None):
  layers k..L-1 continue what layers 0..k-1 computed. `block`: the T tokens form a tree, not a sequence
  (`BlockMask`); token t is still written at cache slot positions[b] + t.
  """
  x = embed(params, tokens, config) if hidden is None else hidden
  t = x.shape[1]
  pos = positions[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
  k_all, v_all = list(cache.k), list(cache.v)
  layer_hidden = []
  for i in (range(config.num_layers) if layers is None else layers):
    layer = params["layers"][i]
    attn, k_all[i], v_all[i] = attention_block(layer, x, k_all[i], v_all[i], pos, config, block=block,
                                               window=config.window(i))
    x = x + attn
    x = x + mlp_block(layer, x, config)
    if return_layer_hidden:
      layer_hidden.append(x)
  logits = lm_head(params, x, config) if compute_logits else None
  return ForwardOutput(logits, x, KVCache(k=k_all, v=v_all), layer_hidden if return_layer_hidden else None)


def forward_nodes(params: Params, tokens: jax.Array, cache: KVCache, committed: jax.Array, positions: jax.Array,
                  ancestors: KVCache, config: ModelConfig, *, layers: Sequence[int] | None = None,
                  compute_logits: bool = True) -> ForwardOutput:
  """Draft-tree nodes tokens [B, T] through the decoder, each node on its own (`node_attention_block`): at RoPE
  position positions[b, t], seeing the cache up to slot committed[b] and its ancestors' keys and values, per layer
  ancestors.k[i] / .v[i] [B, T, E, KV, hd] (`init_cache(config, B, 0)`: none). The cache is read, never written.
  Expanding k nodes of a tree is one forward over k positions a row (EAGLE-2's draft step over a tree layer, Li et
  al. 2024), each node seeing what a causal forward of its path would. `layers` as `forward`'s. The output's `cache`
  holds each node's ancestors' keys and values and its own, [B, T, E + 1, KV, hd] per layer run (layers not run keep
  the ancestors'): what its children carry."""
  x = embed(params, tokens, config)
  k_all, v_all = list(ancestors.k), list(ancestors.v)
  for i in (range(config.num_layers) if layers is None else layers):
    layer = params["layers"][i]
    attn, k_all[i], v_all[i] = node_attention_block(layer, x, cache.k[i], cache.v[i], committed, positions, k_all[i],
                                                    v_all[i], config, window=config.window(i))
    x = x + attn
    x = x + mlp_block(layer, x, config)
  logits = lm_head(params, x, config) if compute_logits else None
  return ForwardOutput(logits, x, KVCache(k=k_all, v=v_all), None)
