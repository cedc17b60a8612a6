"""A smaller draft model with the target's tokenizer and its own KV cache: independent, or distilled from the target.

Each round the draft model first re-reads the token before the pending one, then the pending token (a
2-token step), and then feeds back its own proposals one at a time. Re-reading the previous token keeps the
draft cache complete when every draft was accepted in the last round (the last draft was never fed then).
After a round without drafting (a plain target step), `update` reads that step's token, so a plain step costs
the target step plus the draft's layers over one token.

Trees (EAGLE-2's, `draft_tree.grow`): after the same 2-token first step, expanding k nodes of a depth is one forward
over k positions a row (`model.forward_nodes`), each node seeing the draft cache up to the pending token and its
ancestors' keys and values, which it carries; nodes write no cache, so after a tree round `update` reads the
accepted path's tokens as after a plain step (one forward over depth + 1 positions).

Distilled draft (DistillSpec, Zhou et al. 2024; layer-dropped initialisation as in DistilBERT, Sanh et al. 2019,
and Sheared/ShortGPT-style pruned students): n decoder layers initialised from target layers (evenly spaced,
first and last included), sharing the target's embedding and output head (frozen, not stored: the draft owns
only its layers and final norm), trained on the target's top-K next-token distributions (soft cross-entropy,
`draft_head.distill_loss`) over the cached training sequences; it needs no hidden features. With a truncated
draft vocabulary (`token_map`) it scores only V' tokens, like the trained heads. `as_model` assembles it into
a standalone `Model`, which `specjax.export.save_hf` writes as an HF Llama directory.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import leviathan, ops
from specjax.config import ModelConfig
from specjax.drafters import (DraftCost, Drafter, DraftInputs, PromptInfo, RoundResult, draft_head, draft_tokens,
                              draft_tree_tokens)
from specjax.loading import EMBEDDED_MODELS, CheckpointError, Model, load
from specjax.model import forward, forward_nodes, init_cache, param_shapes
from specjax.sampling import SamplingParams

NAME = "draft_model"
TREES = True  # drafts EAGLE-2's trees (`propose` with `DraftInputs.tree_nodes`)
SHIPPED_SUFFIX = "-draft"  # draft="smollm2-135m-draft": the distilled draft shipped for smollm2-135m
SHIPPED_NAMES = ("{target}" + SHIPPED_SUFFIX,)  # besides draft="default" (`specjax.drafters.shipped_names`)


@dataclasses.dataclass(frozen=True)
class Options:
  config: ModelConfig  # the draft model's
  init_layers: tuple[int, ...] | None = None  # a distilled draft: the target layers it started from; None: independent
  draft_vocab: int | None = None  # V' of a truncated draft vocabulary (distilled drafts); None: the full vocabulary
  # The draft reads only the last `prompt_window` prompt tokens (None: the whole prompt); see `init`.
  prompt_window: int | None = None

  @property
  def distilled(self) -> bool:
    return self.init_layers is not None

  def saved(self) -> dict:
    if not self.distilled:
      raise ValueError("an independent draft model is saved as a model (specjax.export.save_hf), not a drafter "
                       "checkpoint")
    return {"num_layers": self.config.num_layers, "init_layers": list(self.init_layers),
            "draft_vocab": self.draft_vocab}


def model_params(target_params, params, options: Options) -> dict:
  """The draft model's whole parameter tree: a distilled draft's layers and final norm, with the target's
  embedding (and untied output head); an independent draft's own tree."""
  if not options.distilled:
    return params
  shared = {k: target_params[k] for k in ("embed", "lm_head") if k in target_params}
  return {**shared, "layers": params["layers"], "final_norm": params["final_norm"]}


def logits(target_params, params, options: Options, hidden):
  """float32 draft logits [..., V'] (or [..., V]) of the draft model's last hidden states [..., D]."""
  return draft_head.logits(model_params(target_params, params, options), params, hidden, options.config)


class State(NamedTuple):
  cache: Any  # the draft model's KV cache
  offset: jax.Array  # [B] the target position of the draft cache's position 0 (prompt tokens left unread)


def init(target_params, params, options: Options, prompt: PromptInfo) -> State:
  """Prefills the draft's cache with the prompts, or with their last `prompt_window` tokens: the draft then holds
  target position p at p - offset (RoPE scores depend on distances only, so this is the draft reading the
  window at its own positions). A draft model's prefill costs its share of the target's (4 of 30 layers for the
  shipped one), which on a prompt of several hundred tokens outweighs what low-acceptance rounds recover; the
  window bounds it (StreamingLLM-style draft caches for long contexts: TriForce, Sun et al. 2024; MagicDec)."""
  tokens, lengths = prompt.tokens, prompt.lengths
  window = options.prompt_window
  offset = jnp.zeros_like(lengths)
  if window is not None and window < tokens.shape[1]:
    offset = jnp.maximum(lengths - window, 0)
    tokens = jnp.take_along_axis(tokens, offset[:, None] + jnp.arange(window)[None, :], axis=1)
  cache = init_cache(options.config, tokens.shape[0], prompt.cache_len)
  cache = forward(model_params(target_params, params, options), tokens, cache, jnp.zeros_like(lengths),
                  options.config, compute_logits=False).cache
  return State(cache=cache, offset=offset)


def propose(target_params, params, options: Options, state: State, inputs: DraftInputs, gamma: int,
            sampling: SamplingParams):
  full = model_params(target_params, params, options)

  def step(cache, tokens, positions):
    out = forward(full, tokens, cache, positions - state.offset, options.config, compute_logits=False)
    return logits(target_params, params, options, out.hidden[:, -1]), out.hidden[:, -1], out.cache

  def expand_step(cache, tokens, committed, positions, ancestors):
    out = forward_nodes(full, tokens, cache, committed - state.offset, positions - state.offset[:, None], ancestors,
                        options.config, compute_logits=False)
    return logits(target_params, params, options, out.hidden), out.cache

  if inputs.tree_nodes:
    no_ancestors = init_cache(options.config, inputs.position.shape[0], 0)
    proposal = draft_tree_tokens(step, expand_step, state.cache, no_ancestors, inputs, gamma, sampling,
                                 params.get("token_map"), options.config.vocab_size)
  else:
    proposal = draft_tokens(step, state.cache, inputs, gamma, sampling, params.get("token_map"),
                            options.config.vocab_size)
  return proposal._replace(state=state._replace(cache=proposal.target_cache), target_cache=inputs.target_cache)


def update(target_params, params, options: Options, state: State, result: RoundResult) -> State:
  """After a round that drafted a chain the cache already holds [pending - 1, pending, x_1, ...]. After plain target
  steps (`result.drafted` False) and after trees (`result.tree`: the nodes wrote nothing) the draft reads the tokens
  of the round, each one's previous token: positions verify_position - 1 .. verify_position + w - 2, w being the
  result's width (one forward over all of them; a tree's accepted path: its depth + 1), so its cache stays valid
  below position - 1, where the next round's 2-token first step starts."""
  if result.drafted and not result.tree:
    return state
  rows = jnp.arange(result.sequence.shape[0])
  start = result.verify_position - 1
  positions = jnp.minimum(start[:, None] + jnp.arange(result.verify_hidden.shape[1])[None, :],
                          result.sequence.shape[1] - 1)  # slots past the sequence: dropped by the write, or
  # (behind an offset) written past every position read so far, as any slot beyond the pending token is
  cache = forward(model_params(target_params, params, options), result.sequence[rows[:, None], positions],
                  state.cache, start - state.offset, options.config, compute_logits=False).cache
  return state._replace(cache=cache)


def cost(target, options: Options, params) -> DraftCost:
  """A draft step reads the draft's layers and output head; following a plain step, its layers only."""
  if not options.distilled:
    own = {"layers": params["layers"], "head": params.get("lm_head", params["embed"])}
    step = leviathan.draft_cost(target.params, target.config, (), own, head_columns=0)
  else:
    own = {k: v for k, v in params.items() if k not in ("token_map", "head")}
    step = leviathan.draft_cost(target.params, target.config, (), own, head_columns=options.draft_vocab)
  return DraftCost(step=step, plain_step=leviathan.draft_cost(target.params, target.config, (),
                                                              {"layers": params["layers"]}, head_columns=0))


def loss(target_params, params, options: Options, batch):
  """Distillation on cached training sequences: the draft model reads tokens [B, T] from position 0 and learns
  the target's next-token distribution at every masked position (teacher_ids/probs [B, T, K], mask [B, T]).
  Returns (loss, {"loss_1", "top1_1"})."""
  tokens = batch["tokens"]
  cache = init_cache(options.config, tokens.shape[0], tokens.shape[1], dtype=jnp.float32)
  out = forward(model_params(target_params, params, options), tokens, cache, jnp.zeros(tokens.shape[0], jnp.int32),
                options.config, compute_logits=False)
  value, top1 = draft_head.distill_loss(logits(target_params, params, options, out.hidden), batch["teacher_ids"],
                                        batch["teacher_probs"], batch["mask"], params, options.config.vocab_size)
  return value, {"loss_1": value, "top1_1": top1}


# ------------------------------------------------------------------------------------ distilled drafts


def evenly_spaced_layers(num_target_layers: int, num_layers: int) -> tuple[int, ...]:
  """num_layers target layers, evenly spaced from the first to the last (both kept)."""
  if not 1 <= num_layers < num_target_layers:
    raise ValueError(f"num_layers must be in [1, {num_target_layers - 1}], got {num_layers}")
  return tuple(int(i) for i in np.round(np.linspace(0, num_target_layers - 1, num_layers)))


def saved_specs(options: Options) -> dict:
  """A distilled draft's own arrays: its layers and final norm (and the token map of a truncated vocabulary)."""
  full = param_shapes(options.config)
  specs = {"layers": full["layers"], "final_norm": full["final_norm"]}
  if options.draft_vocab is not None:
    specs["token_map"] = draft_head.head_specs(options.config, options.draft_vocab)["token_map"]
  return specs


def param_specs(options: Options) -> dict:
  return {**saved_specs(options), **draft_head.head_specs(options.config, options.draft_vocab)}


def _distilled_options(target_config: ModelConfig, init_layers, draft_vocab) -> Options:
  init_layers = tuple(int(i) for i in init_layers)
  if not init_layers or min(init_layers) < 0 or max(init_layers) >= target_config.num_layers:
    raise ValueError(f"init_layers must be target layers in [0, {target_config.num_layers}), got {init_layers}")
  return Options(config=target_config.layers_config(init_layers), init_layers=init_layers,
                 draft_vocab=None if draft_vocab is None else int(draft_vocab))


def fresh_params(model, options: Options, token_map=None) -> dict:
  """Copies of the target's layers `init_layers` and of its final norm."""
  params = {"layers": [{k: jnp.array(ops.dequantize(v)) for k, v in model.params["layers"][i].items()}
                       for i in options.init_layers],
            "final_norm": jnp.array(model.params["final_norm"])}
  if options.draft_vocab is not None:
    params["token_map"] = jnp.asarray(token_map, jnp.int32)
  return params


def shipped_path(model, name: str) -> str:
  """The checkpoint of a shipped distilled draft, `<target>-draft`; CheckpointError when absent."""
  base = name[:-len(SHIPPED_SUFFIX)]
  hint = (f"no shipped draft model {name!r}: train one with `python -m experiments.train "
          "--config=configs/train_draft.py` and pass draft=<its .safetensors or exported HF directory>")
  if base.lower() not in EMBEDDED_MODELS:
    raise CheckpointError(f"{hint} (known targets: {sorted(EMBEDDED_MODELS)})")
  return draft_head.shipped_checkpoint(base, NAME, hint=hint)


def as_model(target: Model, drafter: Drafter, name: str | None = None) -> Model:
  """A distilled draft as a standalone `Model` (the target's embedding and tokenizer included), e.g. for export."""
  if drafter.name != NAME:
    raise ValueError(f"not a draft model drafter: {drafter.name!r}")
  params = model_params(target.params, drafter.params, drafter.options)
  return Model(config=drafter.options.config, params=params, tokenizer=target.tokenizer,
               name=name or f"{target.name}{SHIPPED_SUFFIX}")


def make(model, draft=None, num_layers: int | None = None, init_layers=None, token_map=None,
         prompt_window: int | None = None) -> Drafter:
  """draft: a `Model` or a name/path for `specjax.load` (an independent model with the same tokenizer); a
  distilled draft's checkpoint (`.safetensors`) or shipped name ("smollm2-135m-draft", or "default": the one shipped
  for this target, as the other trained drafters' "default" is); or "fresh", a new
  distilled draft to train, from `init_layers` (default: `num_layers`, default 4, evenly spaced target layers),
  optionally over the draft vocabulary `token_map`. `prompt_window`: the draft reads only the prompt's last
  tokens, at most this many (None: all; `init`)."""
  drafter = _make(model, draft, num_layers, init_layers, token_map)
  if prompt_window is None:
    return drafter
  if isinstance(prompt_window, bool) or not isinstance(prompt_window, (int, np.integer)) or prompt_window < 1:
    raise ValueError(f"prompt_window must be an integer >= 1 (or None: the whole prompt), got {prompt_window!r}")
  return dataclasses.replace(drafter, options=dataclasses.replace(drafter.options, prompt_window=int(prompt_window)))


def _make(model, draft, num_layers, init_layers, token_map) -> Drafter:
  config = model.config
  if draft is None:
    raise ValueError("draft_model needs draft=<Model, name/path, distilled checkpoint or 'fresh'>")
  if draft != "fresh" and (num_layers is not None or init_layers is not None or token_map is not None):
    raise ValueError("num_layers, init_layers and token_map describe a fresh distilled draft (draft='fresh')")
  if draft == "fresh":
    if init_layers is None:
      init_layers = evenly_spaced_layers(config.num_layers, 4 if num_layers is None else num_layers)
    elif num_layers is not None and num_layers != len(init_layers):
      raise ValueError(f"num_layers={num_layers} but {len(init_layers)} init_layers")
    token_map = None if token_map is None else draft_head.as_token_map(token_map, config.vocab_size)
    options = _distilled_options(config, init_layers, None if token_map is None else token_map.size)
    params = fresh_params(model, options, token_map)
  elif isinstance(draft, str) and (draft == "default" or draft.endswith(".safetensors")
                                   or draft.lower().endswith(SHIPPED_SUFFIX)):
    if draft == "default":  # the one shipped for this target: "<target>-draft"
      draft = f"{draft_head.canonical_model_name(model) or model.name}{SHIPPED_SUFFIX}"
    path = shipped_path(model, draft) if draft.lower().endswith(SHIPPED_SUFFIX) else draft
    options, params = draft_head.load(model, NAME, path, saved_specs, lambda saved: _distilled_options(
        config, saved["init_layers"], saved["draft_vocab"]))
  else:
    if not isinstance(draft, Model):
      draft = load(draft, dtype=config.dtype)
    _check_vocabulary(model, draft)
    options = Options(config=draft.config)
    return Drafter(name=NAME, init=init, propose=propose, update=update, options=options, params=draft.params,
                   param_specs=param_shapes(draft.config), loss=loss, cost=cost(model, options, draft.params),
                   trees=TREES)
  if options.draft_vocab is not None:
    params["head"] = draft_head.head_columns(model.params, config, params["token_map"])
  return Drafter(name=NAME, init=init, propose=propose, update=update, options=options, params=params,
                 param_specs=param_specs(options), loss=loss, cost=cost(model, options, params), trees=TREES)


def _check_vocabulary(model, draft) -> None:
  if draft.config.vocab_size != model.config.vocab_size:
    raise ValueError(f"draft model vocabulary ({draft.config.vocab_size}) differs from the target's "
                     f"({model.config.vocab_size}); speculative decoding needs the same tokenizer")
  if (draft.tokenizer is None) != (model.tokenizer is None) or (
      draft.tokenizer is not None and draft.tokenizer.fingerprint() != model.tokenizer.fingerprint()):
    raise ValueError(f"draft model {draft.name!r} has a different tokenizer from the target {model.name!r}; "
                     "speculative decoding needs identical vocabularies")
