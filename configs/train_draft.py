r"""Distils a small draft model from SmolLM2-135M-Instruct on ShareGPT: the target's top-32 distributions as labels.

  python -m experiments.prepare_data --config=configs/train_data.py   # once: the feature caches (~30-40 min)
  python -m experiments.train --config=configs/train_draft.py          # 4 layers (0, 10, 19, 29 of the target)
  python -m experiments.train --config=configs/train_draft.py:6,small

The argument is the draft's number of layers (default 4), initialised from evenly spaced target layers, the
first and last included; the draft shares the target's embedding and LM head (frozen) and drafts over a
truncated vocabulary. Only the caches' tokens and teacher distributions are read, no hidden features.
`small` (comma-separated) runs a few steps, for a quick end-to-end check.

At the end the draft is exported twice: <workdir>/draft_model.safetensors (+ model card), which
`specjax.make_drafter("draft_model", model, draft=<that file>)` loads and which, copied to
specjax/checkpoints/smollm2-135m/draft_model.safetensors, is what `draft="smollm2-135m-draft"` names; and
<workdir>/smollm2-135m-draft/, an HF Llama directory (config.json, model.safetensors, tokenizer files) that
`transformers.LlamaForCausalLM.from_pretrained` and `specjax.load` read.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
  numbers = [p for p in parts if p.isdigit()]
  unknown = sorted(set(parts) - set(numbers) - {"small"})
  if unknown or len(numbers) > 1:
    raise ValueError(f"configs/train_draft.py takes the number of layers (e.g. ':4'), optionally ',small', "
                     f"got {arg!r}")
  num_layers = int(numbers[0]) if numbers else 4
  config = ml_collections.ConfigDict()
  config.model = "smollm2-135m"
  config.data_dir = "workdirs/data/train_data"  # <data_dir>/train and /held_out: prepare_data's default workdir
  config.drafter = "draft_model"
  # make_drafter's keyword arguments for a fresh distilled draft, besides the token map.
  config.options = ml_collections.ConfigDict({"draft": "fresh", "num_layers": num_layers})
  config.learning_rate = 5e-4
  config.steps = 800
  config.draft_vocab = 8192  # truncated draft vocabulary (FR-Spec); 0 scores the full vocabulary
  config = common.drafter_training(config, f"workdirs/train/draft{num_layers}", small="small" in parts)
  config.export_hf = f"{config.workdir}/smollm2-135m-draft"  # the HF Llama directory; "" for none
  return config
