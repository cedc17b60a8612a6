"""Layer-skip self-speculation: the target drafts with a subset of its own layers.

`exit_layer=k` runs the first k layers, then the final norm and LM head (early exit, LayerSkip-style);
`skip_layers=[...]` runs all layers but those (Draft & Verify, Zhang et al. 2023). The draft shares the
target's KV cache: the layers it runs read the target's K/V for committed positions, and the K/V it writes
for its speculative positions are overwritten by the target's verification forward, which covers every
position the draft wrote. For an early exit these K/V are exactly the target's (same weights, same inputs),
and so is the residual stream after layer k: the drafter declares `reuse_layers = k` and hands it over, so
verification runs layers 0..k-1 only for the last draft token, which the draft never processed (LayerSkip,
Elhoushi et al. 2024: self-speculation reuses the draft's cache and computation).

`token_map=[...]` reads the exit through the LM head's columns of a truncated draft vocabulary (FR-Spec), as the
trained drafters may: where the head is most of a step (Gemma 3's 262k tokens), that tells what a draft pays for,
its layers or its vocabulary. Verification stays over the full vocabulary.

`adapter=...` puts a trained adapter between layer k and the head (Kangaroo-style; `exit_adapter`).

Trees (EAGLE-2's, `draft_tree.grow`): the first step runs the pending token through the draft's layers as a chain's
does; expanding k nodes of a depth is one forward of those layers over k positions a row (`model.forward_nodes`),
each node seeing the target's cache of those layers up to the pending token and its ancestors' keys and values,
which it carries. Nodes write no cache, so verification runs every layer over the tree's block (no reuse) and
overwrites the pending token's slot; the accepted path's keys and values are moved where a chain's would be.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp

from specjax import leviathan
from specjax.config import ModelConfig
from specjax.drafters import (DraftCost, Drafter, DraftInputs, draft_head, draft_tokens, draft_tree_tokens,
                              exit_adapter, keep_state, no_state)
from specjax.model import forward, forward_nodes, init_cache
from specjax.sampling import SamplingParams

TREES = True  # drafts EAGLE-2's trees (`propose` with `DraftInputs.tree_nodes`), with or without an exit adapter


@dataclasses.dataclass(frozen=True)
class Options:
  config: ModelConfig
  layers: tuple[int, ...]


def propose(target_params, params, options: Options, state, inputs: DraftInputs, gamma: int,
            sampling: SamplingParams):
  config, truncated = options.config, "token_map" in params

  def head(hidden):  # the target's head, or its columns of a truncated draft vocabulary (FR-Spec)
    return draft_head.logits(target_params, params, hidden, config)

  def step(cache, tokens, positions):
    # Only the pending token (the last one) is new to the shared cache; the one before it is committed.
    out = forward(target_params, tokens[:, -1:], cache, positions + tokens.shape[1] - 1, config,
                  layers=options.layers, compute_logits=False)
    return head(out.hidden[:, -1]), out.hidden[:, -1], out.cache

  def expand_step(cache, tokens, committed, positions, ancestors):
    out = forward_nodes(target_params, tokens, cache, committed, positions, ancestors, config, layers=options.layers,
                        compute_logits=False)
    return head(out.hidden), out.cache

  token_map = params.get("token_map")
  vocab = config.vocab_size if truncated else None
  if inputs.tree_nodes:
    no_ancestors = init_cache(config, inputs.position.shape[0], 0)
    proposal = draft_tree_tokens(step, expand_step, inputs.target_cache, no_ancestors, inputs, gamma, sampling,
                                 token_map, vocab)
  else:
    proposal = draft_tokens(step, inputs.target_cache, inputs, gamma, sampling, token_map, vocab,
                            keep_hidden=is_prefix(options.layers))
  return proposal._replace(state=state)


def is_prefix(layers: tuple[int, ...]) -> bool:
  """An early exit (layers 0..k-1): the draft's K/V and hidden states are the target's own there."""
  return layers == tuple(range(len(layers)))


def draft_layers(num_layers: int, exit_layer: int | None = None, skip_layers=None) -> tuple[int, ...]:
  if (exit_layer is None) == (skip_layers is None):
    raise ValueError("layer_skip needs exactly one of exit_layer=k or skip_layers=[...]")
  if exit_layer is not None:
    if not 1 <= exit_layer < num_layers:
      raise ValueError(f"exit_layer must be in [1, {num_layers - 1}], got {exit_layer}")
    return tuple(range(exit_layer))
  skip = sorted(set(int(i) for i in skip_layers))
  if not skip or skip[0] < 0 or skip[-1] >= num_layers or len(skip) >= num_layers:
    raise ValueError(f"skip_layers must be a non-empty proper subset of 0..{num_layers - 1}, got {skip_layers}")
  return tuple(i for i in range(num_layers) if i not in skip)


def make(model, exit_layer: int | None = None, skip_layers=None, adapter: str | None = None, mlp: bool | None = None,
         token_map=None) -> Drafter:
  """adapter: None (plain early exit or skip set), or an exit adapter after `exit_layer` layers: "default" (the
  one shipped for this model), a checkpoint file, or "fresh" (a new one to train); see `exit_adapter.make`."""
  if adapter is not None:
    if skip_layers is not None:
      raise ValueError("an exit adapter follows the first exit_layer layers; it does not combine with skip_layers")
    return exit_adapter.make(model, adapter, exit_layer=exit_layer, mlp=mlp, token_map=token_map)
  if mlp is not None:
    raise ValueError("mlp describes an exit adapter: pass adapter='fresh' (or a checkpoint) too")
  layers = draft_layers(model.config.num_layers, exit_layer, skip_layers)
  params = {}
  if token_map is not None:  # the exit read through the head's columns of a truncated vocabulary
    params["token_map"] = jnp.asarray(draft_head.as_token_map(token_map, model.config.vocab_size), jnp.int32)
    params["head"] = draft_head.head_columns(model.params, model.config, params["token_map"])
  draft_vocab = None if token_map is None else int(params["token_map"].size)
  return Drafter(name="layer_skip", init=no_state, propose=propose, update=keep_state,
                 options=Options(config=model.config, layers=layers), params=params, param_specs={},
                 reuse_layers=len(layers) if is_prefix(layers) else 0, cost=cost(model, layers, draft_vocab),
                 trees=TREES)


def cost(model, layers: tuple[int, ...], draft_vocab: int | None = None) -> DraftCost:
  """A draft step reads `layers` and the head (its columns of a truncated vocabulary); an early exit's layers are
  reused by verification."""
  reused = leviathan.draft_cost(model.params, model.config, layers, head_columns=0) if is_prefix(layers) else 0.0
  step = leviathan.draft_cost(model.params, model.config, layers, head_columns=draft_vocab)
  return DraftCost(step=step, reused=reused)


# --- Saved skip sets (experiments/layer_skip_search.py searches for them and writes them) ----------------------

def read_skip_set(path: str) -> dict:
  """The whole saved record."""
  with open(path, encoding="utf-8") as f:
    record = json.load(f)
  if record.get("drafter") != "layer_skip" or not isinstance(record.get("options"), dict):
    raise ValueError(f"{path} is not a layer-skip record (drafter={record.get('drafter')!r})")
  return record


def load_skip_set(path: str, model=None) -> dict:
  """`make_drafter("layer_skip", model, **load_skip_set(path))` keyword arguments from a saved record.

  With `model`, checks that the record was searched for a model with as many layers and that the set is
  valid for it.
  """
  record = read_skip_set(path)
  options = dict(record["options"])
  if set(options) - {"skip_layers", "exit_layer"} or len(options) != 1:
    raise ValueError(f"{path}: options must be exactly one of skip_layers / exit_layer, got {options}")
  if "skip_layers" in options:
    options["skip_layers"] = [int(i) for i in options["skip_layers"]]
  else:
    options["exit_layer"] = int(options["exit_layer"])
  if model is not None:
    if record.get("num_layers") not in (None, model.config.num_layers):
      raise ValueError(f"{path} was searched for a {record['num_layers']}-layer model ({record.get('model')}); "
                       f"{model.name} has {model.config.num_layers}")
    draft_layers(model.config.num_layers, **options)
  return options
