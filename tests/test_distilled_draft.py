"""A draft model distilled from the target: lossless, trainable end to end, shippable by name, exported as an HF
Llama directory that HF transformers and specjax both load."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import export
from specjax.drafters import DraftInputs, PromptInfo, draft_head, draft_model
from specjax.loading import CheckpointError, Model
from specjax.model import init_params
from specjax.sampling import SamplingParams
from tests.task_drafters import (VOCAB, assert_greedy_lossless, fewer_layers, perturbed, ragged_prompts, tiered,
                                 train_on_task)

# test id -> options of a fresh distilled draft (random_target has 4 layers)
DRAFTS = {
    "two_layers": dict(num_layers=2),
    "one_layer_truncated": dict(init_layers=[3], token_map=list(range(0, VOCAB, 2))),
    "two_layers_window": dict(num_layers=2, prompt_window=4),  # every prompt longer than the window
}


# The fast tier: one layer over a truncated vocabulary (a prompt window is
# test_a_prompt_window_drafts_the_continuation_of_the_windows_tokens'); the rest of the product is slow.
FAST = {("one_layer_truncated", 3)}


@pytest.mark.parametrize("name, gamma", tiered([(name, gamma) for name in sorted(DRAFTS) for gamma in (1, 3, 5)], FAST))
def test_greedy_distilled_draft_speculative_equals_autoregressive(name, gamma, random_target):
  drafter = perturbed(specjax.make_drafter("draft_model", random_target, draft="fresh", **DRAFTS[name]), scale=0.1)
  assert_greedy_lossless(random_target, drafter, gamma)


def test_a_prompt_window_drafts_the_continuation_of_the_windows_tokens(random_target):
  # With the target as its own draft, reading only the last `window` prompt tokens, the first round's proposals
  # are the model's greedy continuation of those tokens and the pending one: what it decodes from them alone.
  window, gamma = 5, 3
  prompts = ragged_prompts(4)  # 14, 24, 6 and 18 tokens
  pending = [3, 7, 11, 13]
  width = 32
  drafter = specjax.make_drafter("draft_model", random_target, draft=random_target, prompt_window=window)
  tokens = np.zeros((4, width), np.int32)
  sequence = np.zeros((4, width + gamma + 2), np.int32)
  for row, (p, t) in enumerate(zip(prompts, pending)):
    tokens[row, :len(p)] = p
    sequence[row, :len(p) + 1] = p + [t]
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  config = random_target.config
  prompt = PromptInfo(tokens=jnp.asarray(tokens), lengths=lengths, first_token=jnp.asarray(pending, jnp.int32),
                      last_hidden=jnp.zeros((4, config.hidden_size)), features=None, cache_len=sequence.shape[1])
  state = draft_model.init(random_target.params, drafter.params, drafter.options, prompt)
  assert state.offset.tolist() == [len(p) - window for p in prompts]
  proposal = draft_model.propose(random_target.params, drafter.params, drafter.options, state, DraftInputs(
      sequence=jnp.asarray(sequence), position=lengths, target_cache=None, key=jax.random.PRNGKey(0)), gamma,
      SamplingParams())
  expected = specjax.generate(random_target, [p[-window:] + [t] for p, t in zip(prompts, pending)],
                              max_new_tokens=gamma, stop_ids=[])
  assert proposal.tokens.tolist() == expected.tokens
  # The whole prompt gives other drafts here (the window changes what the draft sees).
  whole = specjax.make_drafter("draft_model", random_target, draft=random_target)
  state = draft_model.init(random_target.params, whole.params, whole.options, prompt)
  assert state.offset.tolist() == [0] * 4
  full = draft_model.propose(random_target.params, whole.params, whole.options, state, DraftInputs(
      sequence=jnp.asarray(sequence), position=lengths, target_cache=None, key=jax.random.PRNGKey(0)), gamma,
      SamplingParams())
  assert full.tokens.tolist() != proposal.tokens.tolist()
  for bad in (0, 2.5, True):
    with pytest.raises(ValueError, match="prompt_window must be an integer >= 1"):
      specjax.make_drafter("draft_model", random_target, draft=random_target, prompt_window=bad)


def test_fresh_draft_copies_evenly_spaced_target_layers_and_shares_the_embedding(random_target):
  assert draft_model.evenly_spaced_layers(30, 4) == (0, 10, 19, 29)
  drafter = specjax.make_drafter("draft_model", random_target, draft="fresh", num_layers=2)
  assert drafter.options.init_layers == (0, 3) and drafter.options.config.num_layers == 2
  assert set(drafter.params) == {"layers", "final_norm"}  # the embedding and head stay the target's
  np.testing.assert_array_equal(drafter.params["layers"][1]["wq"], random_target.params["layers"][3]["wq"])
  with pytest.raises(ValueError, match="describe a fresh distilled draft"):
    specjax.make_drafter("draft_model", random_target, draft=random_target, num_layers=2)
  with pytest.raises(ValueError, match="num_layers must be in"):
    specjax.make_drafter("draft_model", random_target, draft="fresh", num_layers=4)


def test_shipped_draft_names_the_model_it_was_made_for(random_target):
  with pytest.raises(CheckpointError, match="trained for target 'smollm2-135m', not 'tiny'.*hidden_size 576 vs 64"):
    specjax.make_drafter("draft_model", random_target, draft="smollm2-135m-draft")
  with pytest.raises(CheckpointError, match="no shipped draft model 'nosuchmodel-draft'.*configs/train_draft.py"):
    specjax.make_drafter("draft_model", random_target, draft="nosuchmodel-draft")
  # "default": the draft shipped for the target, as for the other trained drafters; every shipped name is one file
  names = specjax.drafters.shipped_names("draft_model", random_target.name)
  assert names == ["default", "tiny-draft"]
  for name in names:
    with pytest.raises(CheckpointError, match="no shipped draft model 'tiny-draft'.*configs/train_draft.py"):
      specjax.make_drafter("draft_model", random_target, draft=name)
  assert specjax.drafters.shipped_names("mtp_parallel", "smollm2-135m") == ["default"]
  with pytest.raises(ValueError, match="loads no checkpoint"):
    specjax.drafters.shipped_names("prompt_lookup", "smollm2-135m")
  assert draft_head.shipped_checkpoint("smollm2-135m", "draft_model") == draft_model.shipped_path(
      random_target, "smollm2-135m-draft")


def test_the_shipped_drafts_card_says_how_to_load_it_by_name_and_give_it_to_hf():
  """The card rendered from the shipped checkpoint's own training record, as shipping renders it."""
  from experiments import train
  from specjax.drafters import checkpoint
  card = checkpoint.read_header(draft_head.shipped_checkpoint("smollm2-135m", "draft_model"))["card"]
  trained = train.model_card(card)
  assert "hf_assisted" in trained and "smollm2-135m-draft" not in trained  # a candidate is loaded by its file
  card["shipped_comparison"] = {"prompts": 3, "gamma": 4, "max_new_tokens": 8, "candidate": {"mean_accepted": 1.5},
                                "shipped": {"mean_accepted": 1.25}, "prompts_candidate_better": 2,
                                "prompts_shipped_better": 1}
  shipped = train.model_card(card)
  assert 'or `draft="default"` or `draft="smollm2-135m-draft"` for the copy shipped inside specjax' in shipped


# --------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow  # training end to end: test_mtp.py's mtp_parallel in the fast tier
def test_distilled_draft_learns_a_predictable_task_end_to_end(task_target, task_caches, tmp_path):
  """One layer (the target's first) starts from a random perturbation and learns the target's next tokens."""
  fresh = perturbed(specjax.make_drafter("draft_model", task_target, draft="fresh", num_layers=1), scale=0.5)
  run = train_on_task(task_target, fresh, task_caches, tmp_path)
  prompts, out, result = run["prompts"], run["out"], run["result"]
  # The drafter checkpoint and the exported HF model both give the same drafts back.
  path = draft_head.save(result.drafter, str(tmp_path / "draft.safetensors"), task_target, dtype="float32")
  exported = export.save_hf(draft_model.as_model(task_target, result.drafter), str(tmp_path / "hf"))
  for draft in (path, exported):
    again = specjax.generate(task_target, prompts, max_new_tokens=30, gamma=3, stop_ids=[], adaptive=False,
                             drafter=specjax.make_drafter("draft_model", task_target, draft=draft))
    assert again.tokens == out.tokens and again.stats["accepted_per_row"] == out.stats["accepted_per_row"]


def test_distilled_checkpoint_misfits_are_clear_errors(random_target, tmp_path):
  drafter = specjax.make_drafter("draft_model", random_target, draft="fresh", num_layers=2)
  path = draft_head.save(drafter, str(tmp_path / "draft.safetensors"), random_target)
  with pytest.raises(CheckpointError, match="num_layers 4 vs 3"):
    specjax.make_drafter("draft_model", fewer_layers(random_target, 3), draft=path)
  with pytest.raises(CheckpointError, match="holds a 'draft_model' drafter, not 'layer_skip'"):
    specjax.make_drafter("layer_skip", random_target, adapter=path)
  with pytest.raises(CheckpointError, match="does not exist"):
    specjax.make_drafter("draft_model", random_target, draft=str(tmp_path / "missing.safetensors"))


# ------------------------------------------------------------------------------------------ HF export


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def exported(request, tiny_chat, tmp_path):
  """A distilled draft of a 3-layer target with a word tokenizer, exported as an HF Llama directory:
  (target, draft, path)."""
  config = tiny_chat.config.replace(tie_embeddings=request.param, num_layers=3, rope_theta=500.0)
  target = Model(config, init_params(config, jax.random.PRNGKey(2), std=0.3), tiny_chat.tokenizer, "tiny-words")
  drafter = perturbed(specjax.make_drafter("draft_model", target, draft="fresh", num_layers=2), scale=0.2)
  draft = draft_model.as_model(target, drafter)
  return target, draft, export.save_hf(draft, str(tmp_path / "draft"))


def test_exported_draft_loads_in_specjax_with_the_same_logits_and_tokenizer(exported):
  target, draft, path = exported
  assert sorted(os.listdir(path)) == ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json",
                                      "tokenizer_config.json"]
  ids = np.random.default_rng(0).integers(0, VOCAB, size=40)
  loaded = specjax.load(path)
  assert loaded.config == draft.config
  np.testing.assert_allclose(np.asarray(specjax.logits(loaded, ids)), np.asarray(specjax.logits(draft, ids)),
                             atol=1e-6, rtol=0)
  assert loaded.tokenizer.fingerprint() == target.tokenizer.fingerprint()
  messages = [{"role": "user", "content": "w1 w2"}]
  assert loaded.tokenizer.apply_chat_template(messages) == target.tokenizer.apply_chat_template(messages)


@pytest.mark.slow
def test_exported_draft_loads_in_transformers_with_the_same_logits(exported):
  import torch
  from transformers import AutoTokenizer, LlamaForCausalLM
  target, draft, path = exported
  ids = np.random.default_rng(0).integers(0, VOCAB, size=40)
  hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf(torch.tensor([ids.tolist()])).logits[0].numpy()
  np.testing.assert_allclose(np.asarray(specjax.logits(draft, ids)), theirs, atol=1e-4, rtol=0)
  assert AutoTokenizer.from_pretrained(path).encode("w3 </s> w4") == target.tokenizer.encode("w3 </s> w4")
