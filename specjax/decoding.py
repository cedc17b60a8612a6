"""What the autoregressive and the speculative decoding programs share, on the host and in the program.

Prompts become a `Batch` padded into a shape bucket (`prepare_batch`), which is placed on a mesh
(`place_on_mesh`); in the program, `prefill` runs the prompts and `is_stop` spots stop tokens; afterwards the
generated ids become an `Output` of token rows and texts (`decode_outputs`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sharding
from specjax.backends import cpu
from specjax.loading import Model
from specjax.model import KVCache, forward, lm_head


@dataclasses.dataclass
class Output:
  """tokens: generated ids per row, ending with the stop token when one was produced; texts: those tokens
  decoded, without the stop token; stats: see `generate`."""
  tokens: list[list[int]]
  texts: list[str]
  stats: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Batch:
  """Prompts padded into a shape bucket, ready for the compiled program."""
  tokens: np.ndarray  # [B, T_bucket] int32, right-padded
  lengths: np.ndarray  # [B] int32
  cache_len: int


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


BUCKET_STEP = 256  # prompt widths past 2 x BUCKET_STEP are multiples of it


def _bucket(n: int) -> int:
  """Prompt-length bucket, so a new prompt rarely means a new compile: powers of two from 16 up to 2 x BUCKET_STEP,
  then multiples of BUCKET_STEP. A prefill runs over the whole width, so past a few hundred tokens, where it costs
  more than compiling, the padding is bounded by BUCKET_STEP (Gemma-3-270M: a 1,100-token prompt took 2,048 wide)."""
  if n > 2 * BUCKET_STEP:
    return _round_up(n, BUCKET_STEP)
  return max(16, 1 << (n - 1).bit_length())


def prepare_batch(model: Model, prompts: Sequence[str | Sequence[int]], max_new_tokens: int,
                  extra_positions: int = 0, max_len: int | None = None) -> Batch:
  """Encodes and validates prompts; sizes the KV cache for prompt + max_new_tokens + extra_positions.

  `max_len` caps the cache (default: the model's context length); exceeding it is an error, not a silent
  truncation.
  """
  if isinstance(prompts, (str, bytes)) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
    raise TypeError("prompts must be a list of strings or a list of token-id lists (one per row)")
  if not len(prompts):
    raise ValueError("prompts is empty")
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  rows = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if model.tokenizer is None:
        raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
      ids = model.tokenizer.encode(p)
    else:
      ids = [int(t) for t in p]
    if not ids:
      raise ValueError(f"prompt {i} is empty: give at least one token")
    check_ids(ids, model.config.vocab_size, f"prompt {i}")
    rows.append(ids)
  capacity = max_len or model.config.max_position_embeddings
  longest = max(len(r) for r in rows)
  needed = longest + max_new_tokens + extra_positions
  if needed > capacity:
    raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens})"
                     f"{f' + {extra_positions} speculative positions' if extra_positions else ''} = {needed} "
                     f"exceeds the cache capacity of {capacity} positions")
  cache_len = min(capacity, _round_up(max(needed, _bucket(longest)), 128))
  width = min(_bucket(longest), cache_len)  # the pad never outgrows the cache (capacity need not be 2^k)
  tokens = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  return Batch(tokens=tokens, lengths=np.array([len(r) for r in rows], np.int32), cache_len=cache_len)


def check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
  # An out-of-range id gathers NaNs (jnp.take's fill mode), which then poison every position.
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"{what} has token ids outside [0, {vocab_size}): {bad[:5]}")


def _packed_once(owner, pack):
  """pack(owner.params), kept on `owner` (a Model, or a frozen Drafter: hence object.__setattr__) until its
  params are replaced."""
  params = owner.params
  cached = getattr(owner, "_decode_params", None)
  if cached is None or cached[0] is not params:
    cached = (params, pack(params))
    object.__setattr__(owner, "_decode_params", cached)
  return cached[1]


def decode_params(model: Model):
  """model.params as the decode loop reads them on one device: packed for the CPU kernels where the process decodes
  on its CPU (`specjax.backends.cpu.pack_params`). Packed once per parameter tree and kept on the model: assigning
  new params to model.params packs those on the next call."""
  return _packed_once(model, lambda params: cpu.pack_params(params, model.config))


def decode_draft_params(drafter):
  """drafter.params as the decode loop reads them on one device: a draft model's layers, stacked blocks (sequential
  MTP modules, a block drafter's) and a truncated draft vocabulary's output head packed for the CPU kernels where the
  process decodes on its CPU (`specjax.backends.cpu.pack_draft_params`); the rest as it is. Packed once per parameter
  tree and kept on the drafter."""
  return _packed_once(drafter, lambda params: cpu.pack_draft_params(params, drafter.param_specs))


def place_on_mesh(model: Model, batch: Batch, mesh):
  """(params, prompt tokens, lengths, cache sharding): placed on `mesh`, or for one device (`decode_params`)
  when it is None."""
  if mesh is None:
    return decode_params(model), jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), None
  params = sharding.shard_params(model.params, model.config, mesh)
  tokens, lengths = sharding.shard_batch((batch.tokens, batch.lengths), mesh)
  cache = sharding.cache_sharding(model.config, mesh, batch_size=len(batch.lengths), max_len=batch.cache_len)
  return params, tokens, lengths, cache


def prefill(params, config, tokens: jax.Array, lengths: jax.Array, cache: KVCache, **forward_kwargs):
  """Runs the prompts; returns (next-token logits [B, V], last hidden [B, D], forward output)."""
  out = forward(params, tokens, cache, jnp.zeros_like(lengths), config, compute_logits=False, **forward_kwargs)
  rows = jnp.arange(tokens.shape[0])
  last_hidden = out.hidden[rows, lengths - 1]
  return lm_head(params, last_hidden, config), last_hidden, out


def is_stop(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
  return jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32)) if stop_ids else jnp.zeros(tokens.shape, bool)


def describe_shapes(batch: Batch) -> str:
  """The shape bucket a program is compiled for, as the compilation log names it."""
  return f"batch {len(batch.lengths)}, prompt width {batch.tokens.shape[1]}, cache {batch.cache_len}"


def decode_outputs(model: Model, tokens: np.ndarray, num_generated: np.ndarray,
                   stop_ids: tuple[int, ...]) -> tuple[list[list[int]], list[str]]:
  """Token rows (a stop token included) and their texts (a final stop token left out: it is not text)."""
  rows = [tokens[i, :n].tolist() for i, n in enumerate(num_generated)]
  texts = [model.tokenizer.decode(r[:-1] if r and r[-1] in stop_ids else r) if model.tokenizer else ""
           for r in rows]
  return rows, texts
