r"""Speculative speedup against batch size: every drafter at batch 1, 4 and 8, each against autoregressive decoding
at the same batch size, in one run.

  python -m experiments.run --config=configs/batch_sweep.py           # 8 prompts x 3 categories, 64 tokens
  python -m experiments.run --config=configs/batch_sweep.py:small     # 4 prompts x 2 categories, batch 1 and 4

A batch holds consecutive prompts of one category, so the categories are three of those with 40 prompts on the test
side of the dev/test split (MT-bench's have 5, less than a batch of 8): qa, translation and math_reasoning.

Rows of a batch accept different numbers of drafts each round (ragged acceptance) and advance together in one
compiled loop; a verification then multiplies batch x (gamma + 1) rows by every weight, so the cost r of a round
grows with the batch while the bytes read stay those of one step. Writes speedup_vs_batch_size.png and a
"Speedup by batch size" table beside the usual report (whose main table, costs included, is batch 1's).
Adaptive drafting is on (the library default): a round drafts only when the running acceptance says it pays.
Expected time on 2 CPU cores: 18 min for the full config on writing, coding and humanities (results/batch_sweep/,
compiling included).
"""

from configs import common


def get_config(arg=None):
  variants = common.parse_variants(arg, "configs/batch_sweep.py", ("small",))
  small = "small" in variants
  config = common.spec_bench_run(per_category=4 if small else 8, max_new_tokens=64)
  config.prompts.categories = ("qa", "translation") if small else ("qa", "translation", "math_reasoning")
  config.batch_sizes = (1, 4) if small else (1, 4, 8)
  config.methods = common.methods("autoregressive", "prompt_lookup", "layer_skip_best_set", "mtp_parallel",
                                  "mtp_sequential")
  config.costs = common.costs(repeats=3)
  return config
