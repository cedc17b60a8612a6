r"""Quickstart: autoregressive vs prompt lookup, layer skip at its best and the shipped MTP drafters on Spec-Bench.

  python -m experiments.run --config=configs/quickstart.py

Overrides go on the command line, e.g. `--config.max_new_tokens=16 --config.only=autoregressive`;
tuples are Python literals: `--config.prompts.categories="('qa','rag')"`.
SmolLM2-135M-Instruct in float32 (the dtype tested for parity with HF), greedy, batch 1, one prompt from each of
four categories (the test side of the dev/test split, experiments/spec_bench.py), chat template on the first turn; configs/common.py describes every field. Results go to
workdirs/quickstart-<time>/ (or --workdir).
2 min 48 s measured on 2 CPU cores (10 programs compiled at 3-10 s each, then the cost loops); on cores shared
with other jobs, several times that.
"""

from configs import common


def get_config(arg=None):
  if arg:
    raise ValueError(f"configs/quickstart.py takes no argument, got {arg!r}")
  config = common.spec_bench_run(per_category=1, max_new_tokens=64)
  # Three short prompts share one compiled shape; extraction shows copying from the prompt.
  config.prompts.categories = ("coding", "qa", "humanities", "extraction")

  # Methods by name (configs/common.py's METHODS: what each builds). Layer skip at its best: the skip set the search
  # found (configs/layer_skip_sets/) and the shipped trained exit adapter; the MTP drafters are the shipped ones.
  config.methods = common.methods("autoregressive", "prompt_lookup", "layer_skip_best_set", "layer_skip_trained_exit",
                                  "mtp_parallel", "mtp_sequential")
  config.costs = common.costs(repeats=3)
  return config
