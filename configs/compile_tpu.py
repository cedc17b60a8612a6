r"""specjax's programs compiled for TPU topologies on a machine without a TPU (experiments/compile_for.py).

  pip install -e ".[tpu]"                                              # libtpu
  python -m experiments.compile_for --config=configs/compile_tpu.py [--workdir=results/tpu_compile]
  python -m experiments.compile_for --config=configs/compile_tpu.py:small   # one model, one topology, a few minutes
  python -m experiments.compile_for --config=configs/compile_tpu.py:programs  # every program of SmolLM2 on v5e:2x4
  python -m experiments.compile_for --config=configs/compile_tpu.py:gpu   # H100/H200s: pip install "jax[cuda12]"
  python -m experiments.compile_for --config=configs/compile_tpu.py:cover --workdir=results/tpu_compile-cover
                                                                   # what a user runs, everywhere: ~5 CPU-hours
  python -m experiments.compile_for --config=configs/compile_tpu.py:full    # every model too: longer still
  python -m experiments.compile_for --config=configs/compile_tpu.py:families --workdir=results/tpu_compile-families
                                                                   # Gemma 3 and Qwen 3 on v5e:2x4
  python -m experiments.compile_for --config=configs/compile_tpu.py:int8 --workdir=results/tpu_compile-int8
                                                                   # int8 weights against bf16 on v5e:2x4

The models are SmolLM2-135M and Llama-3.2-1B and Llama-3.1-8B shaped (specjax.config.MODEL_SHAPES; no weights), and in
`families` Gemma-3-270M, Gemma-3-1B, Gemma-3-4B (its text model) and Qwen3-8B shaped, each with drafters sized for it:
the shipped SmolLM2 drafters' options (4 parallel heads, a recurrent EAGLE-3-style sequential module, a 4-layer
distilled draft, an exit adapter) with a draft vocabulary of `draft_vocab` tokens, plain layer skip, and prompt
lookup. bf16, batch 8, a KV cache of 4096 positions. Topologies: v5e:2x4, v6e:2x4, v5p:2x2x1,
v5e:4x4, Colab's v2-8 (v2:2x2) and a single v5e chip (Colab's v5e-1), each with a (data, model) mesh. Compiling is
CPU work that grows with the layers of every unrolled forward: results/tpu_compile/RUN.md gives the default's time.
A run appends each program's record to <workdir>/records.jsonl as it is compiled and a rerun keeps them, so a long
run given its folder under results/ can be carried to another machine by committing that file as it grows.

A model entry may hold its matrices as int8 codes with a bf16 scale per output channel (`"weights": "int8"`,
specjax/int8.py; bf16 activations), under a name of its own, of the shape `"shape"` names. `int8`: the SmolLM2-135M,
Qwen3-8B and Gemma-3-4B shaped targets with bf16 and with int8 weights on v5e:2x4, their whole autoregressive program
(the HBM a user needs) and the projection's step programs (a decode step, a verification of gamma + 1 tokens, prompt
lookup's draft); results.md compares each int8 program with its bf16 twin (HBM per chip, arguments, bytes accessed)
and counts its CPU kernel calls (none).
"""

import ml_collections

PROGRAMS = ("prefill", "autoregressive", "speculative", "train_drafter", "train", "steps")
DECODING = ("prefill", "autoregressive", "speculative", "steps")
# What a user runs; "steps" are the loop-free programs the projection reads (the default grid has them everywhere).
USER_PROGRAMS = ("prefill", "autoregressive", "speculative", "train_drafter", "train")
# The models of other families than Llama's (`families`), each with the draft vocabulary of its trained drafters: 32,768
# of Gemma 3's 262,144 (262,208 for 4B) and of Qwen 3's 151,936, as of Llama 3's 128,256.
FAMILY_MODELS = (
    {"name": "gemma3-270m", "draft_vocab": 32768},
    {"name": "gemma-3-1b", "draft_vocab": 32768},
    {"name": "gemma-3-4b", "draft_vocab": 32768},
    {"name": "qwen3-8b", "draft_vocab": 32768},
)
# The targets `int8` compiles with bf16 weights and with int8 ones: (shape, draft vocabulary).
INT8_SHAPES = (("smollm2-135m", 8192), ("qwen3-8b", 32768), ("gemma-3-4b", 32768))


def get_config(arg=None):
  if arg not in (None, "small", "programs", "gpu", "cover", "full", "families", "int8"):
    raise ValueError("configs/compile_tpu.py takes no argument, 'small', 'programs', 'gpu', 'cover', 'full', "
                     f"'families' or 'int8', got {arg!r}")
  config = ml_collections.ConfigDict()
  config.dtype = "bfloat16"
  # name: a `specjax.config.MODEL_SHAPES` entry (or a name of its own, with "shape" the entry); draft_vocab: the
  # truncated draft vocabulary of its trained drafters (SmolLM2's shipped ones: 8192 of 49,152; EAGLE-3's Llama 3.1 8B
  # draft: 32,000 of 128,256); weights: "int8" for int8 codes and a scale per output channel (default: config.dtype).
  config.models = (
      {"name": "smollm2-135m", "draft_vocab": 8192},
      {"name": "llama-3.2-1b", "draft_vocab": 32768},
      {"name": "llama-3.1-8b", "draft_vocab": 32768},
  )
  # (topology, data, model): a mesh over all of the slice's devices (v2: one device per TensorCore, 2 per chip).
  config.topologies = (
      ("v5e:2x4", 2, 4),
      ("v6e:2x4", 2, 4),
      ("v5p:2x2x1", 1, 4),
      ("v5e:4x4", 4, 4),
      ("v2:2x2", 2, 4),
      ("v5e:1x1", 1, 1),
  )
  config.batch_size = 8
  config.prompt_len = 1024
  config.cache_len = 4096
  config.gamma = 4  # the speculative programs' largest draft, and their trees' depth
  # Draft trees (`generate(..., tree_nodes=N)`): the sizes compiled for the drafters that draft trees, in the
  # speculative and step programs (a block's `tree_nodes` overrides them).
  config.tree_nodes = (16, 32)
  config.temperature = 0.0
  config.stop_ids = (2,)
  # Where each drafter's tau (tokens per target forward) comes from: fixed-gamma runs of experiments/run.py (one
  # results.json or several; a method in several is taken from the first).
  # The comparison at one training budget first (configs/compare_drafters.py:budget): its budget_<run> methods draft
  # with the rounds below, beside the shipped checkpoints' methods of the full comparison.
  # And the data control (configs/compare_drafters.py:data): the sequential module trained on ShareGPT's answers.
  config.acceptance = ("results/compare_drafters-budget/results.json", "results/compare_drafters/results.json",
                       "results/compare_drafters-data/results.json")
  # Where each tree's tau comes from: a run of configs/trees.py (its `<method>_tree<N>`); absent, trees are projected
  # by their round's cost alone (the tau at which they break even).
  config.tree_acceptance = "results/trees/results.json"
  # name; drafter and options for `specjax.make_drafter` (fresh parameters: no checkpoint is read); layers as fractions
  # of the model's (`exit_layer_fraction`, `skip_layer_fraction`); draft_vocab: a truncated head of the model's
  # `draft_vocab` tokens; acceptance_of: the method of `acceptance` whose tau (and gamma) the projection takes, or a
  # tuple of methods drafting with this round at one gamma (a row each; trees at the first's).
  config.drafters = (
      {"name": "prompt_lookup", "drafter": "prompt_lookup", "acceptance_of": "prompt_lookup"},
      {"name": "layer_skip", "drafter": "layer_skip", "exit_layer_fraction": 0.8, "acceptance_of": "layer_skip_exit24"},
      {"name": "layer_skip_set", "drafter": "layer_skip", "skip_layer_fraction": 0.4,
       "acceptance_of": "layer_skip_best_set"},
      {"name": "exit_adapter", "drafter": "layer_skip", "options": {"adapter": "fresh", "mlp": True},
       "exit_layer_fraction": 3 / 30, "draft_vocab": True,
       "acceptance_of": ("layer_skip_trained_exit", "budget_exit")},
      {"name": "exit16", "drafter": "layer_skip", "options": {"adapter": "fresh", "mlp": True},
       "exit_layer_fraction": 16 / 30, "draft_vocab": True, "acceptance_of": "budget_exit16"},
      {"name": "draft_model", "drafter": "draft_model", "options": {"draft": "fresh", "num_layers": 4},
       "draft_vocab": True, "acceptance_of": ("draft_model", "budget_draft")},
      {"name": "mtp_parallel", "drafter": "mtp_parallel", "options": {"path": None, "num_heads": 4},
       "draft_vocab": True, "acceptance_of": ("mtp_parallel", "budget_parallel")},
      {"name": "mtp_sequential", "drafter": "mtp_sequential",
       "options": {"path": None, "depth": 4, "recurrent": True, "eagle3": True}, "draft_vocab": True,
       "acceptance_of": ("mtp_sequential", "budget_sequential", "budget_sequential_sharegpt")},
      # DeepSeek-V3's MTP: distinct modules chained on the last hidden state (configs/train_budget.py's deepseek).
      {"name": "deepseek", "drafter": "mtp_sequential",
       "options": {"path": None, "depth": 4, "recurrent": False, "eagle3": False}, "draft_vocab": True,
       "acceptance_of": "budget_deepseek"},
  )
  config.train_drafters = ("mtp_sequential",)  # whose training step is compiled
  config.train = ml_collections.ConfigDict({"batch_size": 8, "seq_len": 1024, "top_k": 32})

  names = tuple(m["name"] for m in config.models)
  topologies = tuple(t[0] for t in config.topologies)
  everything = {"models": names, "topologies": topologies, "programs": PROGRAMS}
  # Blocks of the grid, each crossing its models, topologies and programs, with its `drafters` (default: all) in the
  # speculative, step and drafter-training programs and its `tree_nodes` (default: `config.tree_nodes`) in the
  # speculative and step programs (experiments/compile_for.py). The default, ~15 min of CPU time: the 8B target on
  # v5e:2x4 (its decoding program and the speculative one with the sequential MTP module, and the steps of the
  # drafters that read few weights), every drafter's step programs (the projection) for SmolLM2 on every topology,
  # and the trees' step programs for SmolLM2 on v5e:2x4 (this run's projection of trees). A tree's whole
  # speculative program compiles in about as long as the 8B target's steps, so those are in `small` and `cover`.
  config.runs = (
      {"models": ("llama-3.1-8b",), "topologies": ("v5e:2x4",), "programs": ("autoregressive", "speculative"),
       "drafters": ("mtp_sequential",), "tree_nodes": ()},
      {"models": ("llama-3.1-8b",), "topologies": ("v5e:2x4",), "programs": ("steps",),
       "drafters": ("prompt_lookup", "mtp_parallel", "mtp_sequential"), "tree_nodes": ()},
      {"models": ("smollm2-135m",), "topologies": topologies, "programs": ("steps",), "tree_nodes": ()},
      {"models": ("smollm2-135m",), "topologies": ("v5e:2x4",), "programs": ("steps",),
       "drafters": ("mtp_parallel", "mtp_sequential")},
  )
  if arg == "small":  # with one tree size
    config.runs = ({"models": ("smollm2-135m",), "topologies": ("v5e:2x4",), "programs": DECODING,
                    "drafters": ("prompt_lookup", "mtp_sequential"), "tree_nodes": (16,)},)
  elif arg == "programs":  # every program a user runs, with every drafter, for SmolLM2 on one slice
    config.train_drafters = ("exit_adapter", "draft_model", "mtp_parallel", "mtp_sequential")
    config.runs = (dict(everything, models=("smollm2-135m",), topologies=("v5e:2x4",),
                        programs=tuple(p for p in PROGRAMS if p != "steps")),)
  elif arg == "gpu":  # the decoding programs for one H200 and a node of 8 H100s (memory only: see compile_for)
    config.topologies = (("h200:1x1x1", 1, 1), ("h100:1x1x8", 2, 4))
    config.runs = ({"models": ("smollm2-135m",), "topologies": ("h200:1x1x1", "h100:1x1x8"),
                    "programs": ("prefill", "autoregressive", "speculative"), "drafters": ("mtp_sequential",)},)
  elif arg == "cover":  # every program a user runs on every topology (SmolLM2), and every model on v5e:2x4
    # Trees of one size everywhere (a larger tree is the same program with more nodes), both sizes for SmolLM2 on
    # v5e:2x4.
    config.train_drafters = ("exit_adapter", "draft_model", "mtp_parallel", "mtp_sequential")
    users = dict(everything, programs=USER_PROGRAMS, tree_nodes=config.tree_nodes[:1])
    config.runs = (dict(users, models=("smollm2-135m",)), dict(users, topologies=("v5e:2x4",)),
                   {"models": ("smollm2-135m",), "topologies": ("v5e:2x4",), "programs": ("speculative",)})
  elif arg == "full":  # the whole cross product
    config.train_drafters = ("exit_adapter", "draft_model", "mtp_parallel", "mtp_sequential")
    config.runs = (everything,)
  elif arg == "families":  # Gemma 3 (sliding and full layers, GeGLU, QK norms, a 262k vocabulary) and Qwen 3 on v5e:2x4
    # The decoding programs and the sequential module's training step, with plain layer skip (the full vocabulary)
    # and the sequential module (a truncated one), their chains and trees of one size.
    config.models = FAMILY_MODELS
    config.runs = ({"models": tuple(m["name"] for m in FAMILY_MODELS), "topologies": ("v5e:2x4",),
                    "programs": ("prefill", "autoregressive", "speculative", "train_drafter"),
                    "drafters": ("layer_skip", "mtp_sequential"), "tree_nodes": config.tree_nodes[:1]},)
  elif arg == "int8":  # each target with bf16 and with int8 weights: its decoding program and steps, on v5e:2x4
    config.models = tuple({"name": name, "draft_vocab": vocab} for name, vocab in INT8_SHAPES) + tuple(
        {"name": f"{name} int8", "shape": name, "weights": "int8", "draft_vocab": vocab} for name, vocab in INT8_SHAPES)
    config.drafters = tuple(d for d in config.drafters if d["name"] == "prompt_lookup")  # no weights of its own
    config.runs = ({"models": tuple(m["name"] for m in config.models), "topologies": ("v5e:2x4",),
                    "programs": ("autoregressive", "steps"), "tree_nodes": ()},)
  return config
