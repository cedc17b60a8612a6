r"""Spec-Bench: every drafter against autoregressive decoding on all 13 categories (Xia et al., 2024).

  python -m experiments.run --config=configs/spec_bench.py          # 5 prompts x 13 categories, 128 tokens
  python -m experiments.run --config=configs/spec_bench.py:small    # 1 prompt x 13 categories, 64 tokens

SmolLM2-135M-Instruct, fp32, greedy, batch 1, chat template on the first turn. `self_draft` drafts with the
target itself (there is no smaller SmolLM2 here): all drafts are accepted, so it measures what a round costs;
point its `draft` option at a smaller checkpoint with the same tokenizer to measure a real draft model.
"""

from configs import common


def get_config(arg=None):
  if arg not in (None, "", "small"):
    raise ValueError(f"configs/spec_bench.py takes no argument or 'small', got {arg!r}")
  small = arg == "small"
  config = common.spec_bench_run(per_category=1 if small else 5, max_new_tokens=64 if small else 128,
                                 repeats=1 if small else 2)
  # self_draft: the target as its own draft, every token accepted, so it measures the loop's cost, not a gain.
  config.methods = (common.methods("autoregressive", "prompt_lookup", "layer_skip_exit24")
                    + ({**common.layer_skip_exit(28), "gamma": 3},) + common.methods("self_draft"))
  config.costs = common.costs(repeats=5)
  return config
