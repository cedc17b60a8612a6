"""Test doubles for trained drafters: a tiny target that learned a predictable task, its feature caches, and random
drafter parameters. The fixtures built from them live in conftest.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import train
from specjax.config import ModelConfig
from specjax.data.features import build_feature_cache
from specjax.drafters import Drafter, Proposal, keep_state, no_state
from specjax.drafters import draft_tree
from specjax.loading import Model
from specjax.model import forward, init_params

VOCAB = 32  # the vocabulary of conftest's TINY_CONFIG: progressions run over all of it


def progression(start: int, stride: int, length: int) -> list[int]:
  return [(start + stride * i) % VOCAB for i in range(length)]


def task_sequences(n: int, length: int, seed: int) -> list[list[int]]:
  rng = np.random.RandomState(seed)
  return [progression(rng.randint(VOCAB), rng.choice([1, 2]), length) for _ in range(n)]


def train_task_target(config: ModelConfig) -> Model:
  """A tiny target trained to continue arithmetic progressions mod VOCAB (stride 1 or 2)."""
  if config.vocab_size != VOCAB:
    raise ValueError(f"the task runs over {VOCAB} tokens, the config has {config.vocab_size}")
  params = init_params(config, jax.random.PRNGKey(0), std=0.1)
  data = np.asarray(task_sequences(512, 32, seed=0), np.int32)
  optimizer = train.make_optimizer(1e-2, 20, 300)
  state = train.init_train_state(params, optimizer)
  step = train.make_train_step(train.lm_loss(config), optimizer)
  for i in range(300):
    state, _ = step(state, None, {"tokens": data[(i * 32) % 512:(i * 32) % 512 + 32]})
  return Model(config, state.params, None, "task")


def task_feature_caches(target: Model, root) -> dict:
  """Train and held-out feature caches of the task (every layer's output stored)."""
  caches = {}
  for split, (n, seed) in {"train": (192, 1), "held_out": (32, 2)}.items():
    seqs = [(np.asarray(s, np.int32), np.ones(len(s), bool)) for s in task_sequences(n, 48, seed)]
    caches[split] = build_feature_cache(target, seqs, str(root / split), seq_len=48,
                                        feature_layers=(0, 1, 2), top_k=8, batch_size=16)
  return caches


def fewer_layers(model: Model, num_layers: int) -> Model:
  """`model` cut to its first `num_layers` layers: another target, which a drafter checkpoint of `model` misfits."""
  params = {**model.params, "layers": model.params["layers"][:num_layers]}
  return Model(model.config.replace(num_layers=num_layers), params, None, f"{model.name}-{num_layers}")


def tiered(cases, fast) -> list:
  """pytest params of `cases` (tuples of arguments, or single arguments): those in `fast` in the fast tier, the rest
  marked slow."""
  import pytest
  return [pytest.param(*(case if isinstance(case, tuple) else (case,)),
                       marks=() if case in fast else pytest.mark.slow) for case in cases]


def perturbed(drafter, seed=1, scale=0.3):
  """Random (untrained) parameters, so drafts are wrong in varied ways. The noise is drawn on the host: a jax.random
  draw compiles a program for every parameter shape, and the tests perturb dozens of drafters."""
  leaves, treedef = jax.tree.flatten(drafter.params)
  rng = np.random.default_rng(seed)
  leaves = [jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape).astype(x.dtype))
            if jnp.issubdtype(x.dtype, jnp.floating) else x for x in leaves]
  return dataclasses.replace(drafter, params=jax.tree.unflatten(treedef, leaves))


def own_tree_propose(target_params, params, config: ModelConfig, state, inputs, gamma, sampling):
  """A tree of the target's own top tokens: `draft_tree.grow` over the target's next-token distributions, each node's
  children scored by a target forward through its path (the node's payload: the cache with its ancestors' K/V)."""
  rows = jnp.arange(inputs.position.shape[0])
  pending = forward(target_params, inputs.sequence[rows, inputs.position][:, None], inputs.target_cache,
                    inputs.position, config)

  def expand(depth, tokens, cache):  # tokens [B, k] at depth - 1, cache [B, k, ...] holding their ancestors
    batch, k = tokens.shape
    flat = jax.tree.map(lambda a: a.reshape((batch * k,) + a.shape[2:]), cache)
    out = forward(target_params, tokens.reshape(-1, 1), flat, jnp.repeat(inputs.position + depth - 1, k), config)
    return (out.logits.reshape(batch, k, -1), jax.tree.map(lambda a: a.reshape((batch, k) + a.shape[1:]), out.cache))

  tokens, probs, parents = draft_tree.grow(pending.logits[:, 0], pending.cache, expand, gamma, inputs.tree_nodes,
                                           sampling)
  return Proposal(tokens=tokens, probs=probs, state=state, target_cache=inputs.target_cache,
                  steps=jnp.asarray(gamma, jnp.int32), parents=parents)


def own_tree_drafter(target: Model) -> Drafter:
  """The target drafting trees for itself (trees only): siblings are the target's most probable tokens, so a rejected
  first sibling leaves a residual far from p, which is what a sibling rule gets wrong (a random drafter's siblings
  hold little target mass, and a residual left stale after them moves the output little)."""
  return Drafter(name="own_tree", init=no_state, propose=own_tree_propose, update=keep_state, options=target.config,
                 params={}, param_specs={}, trees=True)


def ragged_prompts(batch, seed=0):
  """Up to 4 prompts of different lengths, each a random motif twice (something for prompt lookup to find)."""
  rng = np.random.RandomState(seed)
  return [list(rng.randint(0, VOCAB, size=n)) * 2 for n in [7, 12, 3, 9][:batch]]


def assert_greedy_lossless(target: Model, drafter, gamma: int, batch: int = 4, max_new_tokens: int = 24):
  """Greedy speculative decoding with `drafter` gives autoregressive decoding's tokens on ragged prompts."""
  import specjax
  prompts = ragged_prompts(batch)
  expected = specjax.generate(target, prompts, max_new_tokens=max_new_tokens, stop_ids=[])
  out = specjax.generate(target, prompts, max_new_tokens=max_new_tokens, drafter=drafter, gamma=gamma, stop_ids=[])
  assert out.tokens == expected.tokens


def train_on_task(target: Model, fresh, caches: dict, workdir) -> dict:
  """Decodes task prompts with `fresh` (fixed gamma), trains it (200 steps), decodes again and checks that it
  learned: held-out top-1 agreement >= 0.95, autoregressive decoding's tokens, and >= 90% of the most tokens a
  round where the untrained drafter got fewer than 2. Returns prompts, expected (autoregressive), before and out
  (speculative, untrained and trained) and result, for further checks."""
  import specjax
  from specjax.train_drafter import train_drafter
  prompts = [progression(5, 2, 6), progression(11, 1, 9), progression(30, 2, 4)]
  expected = specjax.generate(target, prompts, max_new_tokens=30, stop_ids=[])
  before = specjax.generate(target, prompts, max_new_tokens=30, drafter=fresh, gamma=3, stop_ids=[],
                            adaptive=False)
  result = train_drafter(target, fresh, caches["train"], caches["held_out"], workdir=str(workdir), steps=200,
                         batch_size=16, learning_rate=1e-2, warmup_steps=10, eval_every=200, progress=False)
  out = specjax.generate(target, prompts, max_new_tokens=30, drafter=result.drafter, gamma=3, stop_ids=[],
                         adaptive=False)
  assert result.final_eval["eval_top1_1"] >= 0.95, result.final_eval
  assert out.tokens == expected.tokens
  assert before.stats["mean_accepted"] < 2 and out.stats["mean_accepted"] >= 0.9 * 4, (before.stats, out.stats)
  return {"prompts": prompts, "expected": expected, "before": before, "out": out, "result": result}
