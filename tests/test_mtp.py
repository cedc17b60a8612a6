"""Trained MTP drafters: lossless on every engine path, trainable end to end, checkpoints that refuse misfits.

The end-to-end test trains a tiny target on a predictable task (arithmetic progressions with a per-sequence
stride), caches its features, trains the drafters on them with the real training loop, and decodes with
them: held-out top-1 agreement and the tokens accepted per round must be near their maxima.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.backends import cpu
from specjax.decoding import decode_draft_params
from specjax.drafters import DraftInputs, PromptInfo, RoundResult, block, draft_head
from specjax.loading import CheckpointError
from specjax.sampling import SamplingParams
from specjax.train_drafter import train_drafter
from tests.task_drafters import VOCAB, assert_greedy_lossless, fewer_layers, perturbed, progression, tiered

# test id -> (drafter name, options for fresh parameters)
MTP_DRAFTERS = {
    "parallel": ("mtp_parallel", dict(num_heads=5)),
    "parallel_truncated": ("mtp_parallel", dict(num_heads=5, token_map=list(range(0, VOCAB, 2)))),
    "sequential": ("mtp_sequential", dict(depth=5)),
    "sequential_recurrent": ("mtp_sequential", dict(depth=2, recurrent=True)),
    "sequential_eagle3_truncated": ("mtp_sequential", dict(depth=5, eagle3=True,
                                                           token_map=list(range(1, VOCAB, 3)))),
    "block": ("block", dict(block_size=5)),
    "block_two_layers_truncated": ("block", dict(block_size=5, layers=2, token_map=list(range(0, VOCAB, 2)))),
}


def make(name, target, seed=1):
  drafter_name, options = MTP_DRAFTERS[name]
  return perturbed(specjax.make_drafter(drafter_name, target, path=None, **options), seed)


# Every drafter at gamma 1, 3 and 5; its variants (truncated vocabulary, recurrent, EAGLE-3) at gamma 3.
GREEDY_GRID = [(name, gamma) for name in ("parallel", "sequential", "block") for gamma in (1, 3, 5)] + [
    (name, 3) for name in sorted(MTP_DRAFTERS) if name not in ("parallel", "sequential", "block")]
# The sequential module on EAGLE-3 features over a truncated vocabulary; the rest are slow. The fast tier's other cases
# of each kind are in tests/test_families.py (over a truncated vocabulary, on every family).
FAST = {("sequential_eagle3_truncated", 3)}


@pytest.mark.parametrize("name, gamma", tiered(GREEDY_GRID, FAST))
def test_greedy_mtp_speculative_equals_autoregressive(name, gamma, random_target):
  assert_greedy_lossless(random_target, make(name, random_target), gamma)


@pytest.mark.parametrize("name", ["mtp_sequential", "block"])
def test_a_fresh_drafters_seed_is_its_random_start(name, random_target):
  """The drafters whose fresh parameters are random take a seed (a budget run's `seed2` variant passes it): two seeds,
  two starts; one seed, one start."""
  starts = [specjax.make_drafter(name, random_target, path=None, seed=s).params for s in (0, 0, 1)]
  flat = [np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(p)]) for p in starts]
  assert np.array_equal(flat[0], flat[1]) and not np.array_equal(flat[0], flat[2])
  assert "seed" in specjax.drafters.option_names(name)


def test_gamma_beyond_the_heads_is_a_clear_error(random_target):
  drafter = specjax.make_drafter("mtp_parallel", random_target, path=None, num_heads=3)
  with pytest.raises(ValueError, match="at most 3 tokens"):
    specjax.generate(random_target, [[1, 2, 3]], max_new_tokens=8, drafter=drafter, gamma=4)


def test_untrained_parallel_heads_are_the_targets_own_head(random_target):
  """Zero-initialised residual heads output h: each head predicts what the target's head predicts from h_t."""
  drafter = specjax.make_drafter("mtp_parallel", random_target, path=None, num_heads=3)
  hidden = jax.random.normal(jax.random.PRNGKey(0), (2, random_target.config.hidden_size))
  from specjax.drafters import mtp_parallel
  from specjax.model import lm_head
  heads = mtp_parallel.heads(drafter.params, hidden, 3)
  for k in range(3):
    np.testing.assert_allclose(draft_head.logits(random_target.params, drafter.params, heads[:, k],
                                                 random_target.config),
                               lm_head(random_target.params, hidden, random_target.config), rtol=1e-5, atol=1e-5)


def test_truncated_vocabulary_drafts_only_mapped_tokens_and_q_is_zero_elsewhere(random_target):
  token_map = list(range(0, VOCAB, 2))
  drafter = perturbed(specjax.make_drafter("mtp_parallel", random_target, path=None, num_heads=3,
                                           token_map=token_map))
  from specjax.drafters import DraftInputs
  from specjax.sampling import SamplingParams
  hidden = jax.random.normal(jax.random.PRNGKey(0), (4, random_target.config.hidden_size))
  inputs = DraftInputs(sequence=jnp.zeros((4, 8), jnp.int32), position=jnp.ones(4, jnp.int32),
                       target_cache=None, key=jax.random.PRNGKey(1))
  proposal = drafter.propose(random_target.params, drafter.params, drafter.options, hidden, inputs, 3,
                             SamplingParams(temperature=1.0))
  assert set(np.asarray(proposal.tokens).ravel()) <= set(token_map)
  probs = np.asarray(proposal.probs)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  assert probs[..., 1::2].max() == 0.0


# --------------------------------------------------------------------------------------------- end to end


# Slow, every case: the training task's target and caches take 40 s to build; the fast tier trains and exports
# drafters through their training configs instead (test_train_configs.py: parallel heads, an exit adapter, a draft).
@pytest.mark.slow
@pytest.mark.parametrize("name, options", [
    ("mtp_parallel", dict(num_heads=3)),
    ("block", dict(block_size=3)),
    ("mtp_sequential", dict(depth=3)),
    ("mtp_sequential", dict(depth=3, recurrent=True, eagle3=True)),
])
def test_trained_drafter_learns_a_predictable_task_end_to_end(name, options, task_target, task_caches, tmp_path):
  fresh = specjax.make_drafter(name, task_target, path=None, **options)
  result = train_drafter(task_target, fresh, task_caches["train"], task_caches["held_out"], workdir=str(tmp_path),
                         steps=200, batch_size=16, learning_rate=1e-2, warmup_steps=10, eval_every=200,
                         progress=False)
  top1 = [result.final_eval[f"eval_top1_{k}"] for k in range(1, 4)]
  assert min(top1) >= 0.95, top1
  prompts = [progression(5, 2, 6), progression(11, 1, 9), progression(30, 2, 4)]
  expected = specjax.generate(task_target, prompts, max_new_tokens=30, stop_ids=[])
  out = specjax.generate(task_target, prompts, max_new_tokens=30, drafter=result.drafter, gamma=3, stop_ids=[],
                         adaptive=False)
  assert out.tokens == expected.tokens
  assert out.stats["mean_accepted"] >= 0.9 * 4, out.stats
  # The checkpoint round trip gives the same drafter.
  path = draft_head.save(result.drafter, str(tmp_path / f"{name}.safetensors"), task_target, dtype="float32")
  loaded = specjax.make_drafter(name, task_target, path=path)
  again = specjax.generate(task_target, prompts, max_new_tokens=30, drafter=loaded, gamma=3, stop_ids=[],
                           adaptive=False)
  assert again.tokens == out.tokens and again.stats["mean_accepted"] == out.stats["mean_accepted"]


# -------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_for_another_model_is_a_clear_error(random_target, tmp_path):
  drafter = specjax.make_drafter("mtp_sequential", random_target, path=None, depth=2)
  path = draft_head.save(drafter, str(tmp_path / "seq.safetensors"), random_target)
  with pytest.raises(CheckpointError, match="num_layers 4 vs 3"):
    specjax.make_drafter("mtp_sequential", fewer_layers(random_target, 3), path=path)
  with pytest.raises(CheckpointError, match="holds a 'mtp_sequential' drafter, not 'mtp_parallel'"):
    specjax.make_drafter("mtp_parallel", random_target, path=path)


def test_corrupt_or_truncated_checkpoint_is_a_clear_error(random_target, tmp_path):
  drafter = specjax.make_drafter("mtp_parallel", random_target, path=None, num_heads=2)
  path = draft_head.save(drafter, str(tmp_path / "heads.safetensors"), random_target)
  data = open(path, "rb").read()
  truncated = tmp_path / "truncated.safetensors"
  truncated.write_bytes(data[:len(data) - 100])
  with pytest.raises(CheckpointError, match="corrupt or truncated"):
    specjax.make_drafter("mtp_parallel", random_target, path=str(truncated))
  garbage = tmp_path / "garbage.safetensors"
  garbage.write_bytes(b"\x00" * 64)
  with pytest.raises(CheckpointError):
    specjax.make_drafter("mtp_parallel", random_target, path=str(garbage))
  with pytest.raises(CheckpointError, match="does not exist"):
    specjax.make_drafter("mtp_parallel", random_target, path=str(tmp_path / "missing.safetensors"))


def test_no_shipped_checkpoint_for_a_model_says_what_to_do(random_target):
  with pytest.raises(CheckpointError, match="no shipped 'mtp_parallel' checkpoint"):
    specjax.make_drafter("mtp_parallel", random_target)


def test_checkpoint_save_is_atomic(random_target, tmp_path, monkeypatch):
  drafter = specjax.make_drafter("mtp_parallel", random_target, path=None, num_heads=2)
  path = str(tmp_path / "heads.safetensors")
  draft_head.save(drafter, path, random_target)
  before = open(path, "rb").read()

  def broken(*args, **kwargs):
    raise OSError("disk full")
  monkeypatch.setattr("safetensors.numpy.save_file", broken)
  with pytest.raises(OSError):
    draft_head.save(perturbed(drafter), path, random_target)
  assert open(path, "rb").read() == before
  assert [p.name for p in tmp_path.iterdir()] == ["heads.safetensors"]


@pytest.mark.slow  # the training loop's own resume: test_train.py
def test_killed_training_resumes_to_the_same_drafter(task_target, task_caches, tmp_path, monkeypatch):
  """A run killed after its step-4 checkpoint, restarted with the same arguments, ends where an unbroken run ends."""
  import specjax.train_drafter as td

  def run(workdir):
    fresh = specjax.make_drafter("mtp_sequential", task_target, path=None, depth=2, recurrent=True)
    return train_drafter(task_target, fresh, task_caches["train"], task_caches["held_out"], workdir=str(workdir),
                         steps=8, batch_size=8, learning_rate=1e-2, warmup_steps=2, eval_every=4, save_every=4,
                         progress=False)

  unbroken = run(tmp_path / "unbroken")
  real_batch, calls = td._batch, []

  def dies_at_step_6(cache, indices, layers):
    if cache is task_caches["train"]:
      calls.append(1)
      if len(calls) == 6:
        raise KeyboardInterrupt("killed")
    return real_batch(cache, indices, layers)
  monkeypatch.setattr(td, "_batch", dies_at_step_6)
  with pytest.raises(KeyboardInterrupt):
    run(tmp_path / "killed")
  monkeypatch.setattr(td, "_batch", real_batch)
  resumed = run(tmp_path / "killed")
  assert resumed.steps == unbroken.steps == 8
  for a, b in zip(jax.tree.leaves(resumed.drafter.params), jax.tree.leaves(unbroken.drafter.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert resumed.final_eval == unbroken.final_eval


def test_a_block_drafts_every_slot_in_one_forward(random_target):
  """One draft forward per drafting round, whatever gamma: `draft_calls` equals the rounds that drafted, and the
  policy prices the forward once a round (`DraftCost.round`), not per token."""
  drafter = make("block", random_target)
  assert drafter.cost.round > 0.0 and drafter.cost.step == 0.0
  out = specjax.generate(random_target, [[1, 2, 3, 4], [5, 6, 7]], max_new_tokens=12, drafter=drafter, gamma=4,
                         stop_ids=[], adaptive=False)
  assert out.stats["draft_calls"] == out.stats["rounds"] > 0, out.stats


@pytest.mark.parametrize("name", ["sequential", "block_two_layers_truncated"])
def test_stacked_blocks_packed_for_the_cpu_draft_what_the_stacks_draft(name, random_target):
  """Decoding on a CPU lays a drafter's stacked blocks (DeepSeek-V3's chain of distinct MTP modules, a block drafter's
  blocks) out one dict per block, packed for the kernels (`decode_draft_params`): the same chain and tree proposals
  and the same state after an update as the stacks, within float32 rounding."""
  if not cpu.available():
    pytest.skip(f"the CPU kernels are not built here: {cpu.status()}")
  drafter = make(name, random_target)
  packed = decode_draft_params(drafter)
  assert "wq" not in packed and len(packed["blocks"]) > 1 and isinstance(packed["blocks"][1]["wo"], cpu.Packed)
  rng = np.random.default_rng(0)
  b, t, d = 2, 10, random_target.config.hidden_size
  tokens = jnp.asarray(rng.integers(0, VOCAB, (b, t)), jnp.int32)
  features = jnp.asarray(rng.standard_normal((b, t, len(drafter.feature_layers), d)), jnp.float32)
  prompt = PromptInfo(tokens=tokens, lengths=jnp.full((b,), t, jnp.int32), first_token=tokens[:, -1],
                      last_hidden=jnp.zeros((b, d)), features=features, cache_len=24)
  sequence = jnp.pad(tokens, ((0, 0), (0, 14)))
  position = jnp.full((b,), t - 1, jnp.int32)
  init = jax.jit(lambda params: drafter.init(random_target.params, params, drafter.options, prompt))
  states = [init(drafter.params), init(packed)]

  def close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-4), a, b)

  close(*states)
  for nodes in (None, 6):
    inputs = DraftInputs(sequence=sequence, position=position, target_cache=None, key=jax.random.PRNGKey(0),
                         tree_nodes=nodes)
    propose = jax.jit(lambda params, state: drafter.propose(random_target.params, params, drafter.options, state,
                                                            inputs, 3, SamplingParams()))
    stacks, blocks = propose(drafter.params, states[0]), propose(packed, states[1])
    np.testing.assert_array_equal(np.asarray(stacks.tokens), np.asarray(blocks.tokens))
    if nodes:
      np.testing.assert_array_equal(np.asarray(stacks.parents), np.asarray(blocks.parents))
  result = RoundResult(sequence=sequence, position=position + 2, accepted=jnp.ones((b,), jnp.int32),
                       verify_hidden=jnp.zeros((b, 4, d)), features=features[:, :4], verify_position=position)
  update = jax.jit(lambda params, state: drafter.update(random_target.params, params, drafter.options, state, result))
  close(update(drafter.params, states[0]), update(packed, states[1]))


def test_the_block_drafters_loss_reads_the_context_before_each_anchor_only(random_target):
  """Slot outputs at anchor t depend on the features at positions < t and the tokens at t, never later ones."""
  drafter = make("block", random_target)
  rng = np.random.default_rng(0)
  b, t, f = 2, 10, len(drafter.feature_layers)
  d = random_target.config.hidden_size
  batch = {"tokens": jnp.asarray(rng.integers(0, VOCAB, (b, t)), jnp.int32),
           "features": jnp.asarray(rng.standard_normal((b, t, f, d)), jnp.float32)}
  g = block.block_outputs(random_target.params, drafter.params, drafter.options, batch)
  changed = dict(batch, tokens=batch["tokens"].at[:, 6:].set(0),
                 features=batch["features"].at[:, 6:].set(1.0))  # anchor 6's own token changes too
  g2 = block.block_outputs(random_target.params, drafter.params, drafter.options, changed)
  np.testing.assert_allclose(np.asarray(g[:, :6]), np.asarray(g2[:, :6]), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(g[:, 6:]), np.asarray(g2[:, 6:]))


@pytest.mark.parametrize("name", ["block", "block_two_layers_truncated"])
def test_the_block_drafters_training_inputs_are_what_decoding_builds(name, random_target):
  """Decoding carries c_(p-1), the context at each row's newest committed position: the prompt's last after `init`,
  the verified position `accepted` after `update` (rows ragged; the features of a row's prompt padding and of the
  drafts it rejected are noise, never read). Its draft logits at pending position p equal the loss's slot logits at
  anchor p over the same sequence (`depth_logits`, the training path), before and after the update."""
  drafter = make(name, random_target)
  options, params, target = drafter.options, drafter.params, random_target.params
  rng = np.random.default_rng(0)
  b, t, f, d = 2, 14, len(drafter.feature_layers), random_target.config.hidden_size
  tokens = jnp.asarray(rng.integers(0, VOCAB, (b, t)), jnp.int32)
  features = jnp.asarray(rng.standard_normal((b, t, f, d)), jnp.float32)
  noise = jnp.asarray(10 * rng.standard_normal((b, t, f, d)), jnp.float32)
  c = block.context(params, features, jnp.float32)
  training = jnp.stack([logits for logits, _ in block.depth_logits(target, params, options,
                                                                    {"tokens": tokens, "features": features})], 2)
  rows, gamma = jnp.arange(b), options.block_size

  def decoded(state, position):
    inputs = DraftInputs(sequence=tokens, position=position, target_cache=None, key=jax.random.PRNGKey(0))
    return block.draft_logits(target, params, options, state, inputs, gamma)

  lengths = jnp.asarray([5, 3], jnp.int32)
  padded = jnp.where((jnp.arange(t)[None] < lengths[:, None])[..., None, None], features, noise)
  state = drafter.init(target, params, options, PromptInfo(
      tokens=tokens, lengths=lengths, first_token=tokens[rows, lengths], last_hidden=jnp.zeros((b, d)),
      features=padded, cache_len=t))
  np.testing.assert_allclose(np.asarray(state["last_context"]), np.asarray(c[rows, lengths - 1]), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(decoded(state, lengths)), np.asarray(training[rows, lengths]), rtol=1e-4,
                             atol=1e-4)

  w, accepted = 4, jnp.asarray([2, 0], jnp.int32)  # row 0 accepts two drafts, row 1 none
  verified = lengths[:, None] + jnp.arange(w)[None]
  kept = (jnp.arange(w)[None] <= accepted[:, None])[..., None, None]
  result = RoundResult(sequence=tokens, position=lengths + accepted + 1, accepted=accepted,
                       verify_hidden=jnp.zeros((b, w, d)), verify_position=lengths,
                       features=jnp.where(kept, features[rows[:, None], verified], noise[rows[:, None], verified]))
  state = drafter.update(target, params, options, state, result)
  np.testing.assert_allclose(np.asarray(state["last_context"]), np.asarray(c[rows, lengths + accepted]), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(decoded(state, result.position)), np.asarray(training[rows, result.position]),
                             rtol=1e-4, atol=1e-4)


def test_the_loss_is_the_cross_entropy_against_the_targets_top_k_over_the_draft_vocabulary():
  """The soft cross-entropy against the target's top-K renormalised over the tokens the draft vocabulary holds; a
  position none of whose top-K tokens the draft vocabulary holds counts for nothing."""
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2, 0.0]]) + 1e-30)
  ids, probs = jnp.asarray([[1, 0, 3]]), jnp.asarray([[0.6, 0.3, 0.1]])
  kl, top1 = draft_head.distill_loss(logits, ids, probs, jnp.asarray([True]), {}, 4)
  np.testing.assert_allclose(float(kl), -(0.6 * np.log(0.3) + 0.3 * np.log(0.5) + 0.1 * np.log(1e-30)), rtol=1e-4)
  assert float(top1) == 0.0  # the draft's argmax (0) is not the target's (1)
  # Draft vocabulary [0, 1, 3]: the second position's top-K (2 alone) is out of it.
  token_map = {"token_map": jnp.asarray([0, 1, 3])}
  two_ids = jnp.asarray([[1, 0, 2], [2, 2, 2]])
  two_probs = jnp.asarray([[0.6, 0.3, 0.1], [1.0, 0.0, 0.0]])
  draft = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]] * 2))
  kl, _ = draft_head.distill_loss(draft, two_ids, two_probs, jnp.asarray([True, True]), token_map, 4)
  np.testing.assert_allclose(float(kl), -(0.6 * np.log(0.3) + 0.3 * np.log(0.5)) / 0.9, rtol=1e-5)
