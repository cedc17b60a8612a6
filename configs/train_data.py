r"""Drafter training data: the target's features and next-token distributions on ShareGPT (SmolLM2-135M-Instruct;
Gemma-3-270M with `gemma3`).

  python -m experiments.prepare_data --config=configs/train_data.py [--config.workdir=DIR]

About 30 min on 2 busy CPU cores (the target's forward over ~390k positions, ~1.2 s per sequence), 1.9 GB
on disk. Variants (comma-separated, e.g. `configs/train_data.py:regenerate,small`):
  regenerate  the target's own answers replace ShareGPT's (EAGLE's choice): greedy, or sampled with
              --config.regenerate_temperature (and _seed). The features are kept while the target decodes, so
              there is no second forward: 15.0 s per 1k answer tokens (66.8 tokens/s) against 24.5 s (40.8) for
              greedy answers and then a forward over them, 97 against 59 answer tokens per CPU-second (measured
              2026-12-04 on 2 cores shared with other work, the same 64 train prompts, 16 per call). 12,000
              train conversations give 7,500 prompts and ~1.07M answer positions: ~3 CPU-hours, 9 GB
  exits       features after more layers, for exit adapters (configs/train_exit.py): the outputs of 0-based
              layers 3, 5, 7, 9, 11, 15 and 29 (exit after k = 4, 6, 8, 10, 12, 16 layers; 29 for the MTP
              heads), ~3 GB for train; any other set: --config.feature_layers="(3,7,11)"
  small       a few conversations, for a one-minute end-to-end check
  gemma3      the target Gemma-3-270M (a base model) instead of SmolLM2: with `regenerate` only (see below)

Writes <workdir>/train/ and <workdir>/held_out/ feature caches (specjax.data.features; they hold their sequences, also
in <split>.sequences.npz for ShareGPT's answers) and summary.json. Rerunning reuses whatever is finished and
resumes a killed build (a regeneration after its last finished batch of prompts).

Gemma-3-270M (`:regenerate,gemma3`; `:regenerate,gemma3,small` for the check) has no chat template, so its prompts
are a ShareGPT exchange's user text as plain text, its BOS first (`specjax.data.sequences.prompt_ids` with
chat=False, what the evaluation feeds it: `experiments.spec_bench.prompt_ids(..., chat=False)`,
configs/bench_peers.py:gemma), and its answers its greedy continuations, up to <eos> or <end_of_turn> or seq_len.
ShareGPT's own answers have no place after a plain prompt (specjax.data.sequences.check_data_answers), so `gemma3`
takes `regenerate`. The same conversations, split and seq_len as SmolLM2's, so the budgets compare; the features of
layers (2, 9, 15, 17) (`default_feature_layers(18)`: EAGLE-3's low/mid/high and the last); the answers are kept in
data/answers/gemma3-270m/. Decoding is the cost: a 262,144-token head and its top-K at every step, and a base model
rarely stops, so its answers fill the sequence (~215 answer tokens a prompt against SmolLM2's ~143). Measured with
`:regenerate,gemma3,small` on 2 cores beside a long decoding job (nice 5; this one at nice 15, given ~0.6 of a core):
19.0 answer tokens/s in batches of 16 (3,434 tokens of 16 prompts in 180 s), 17.0 in a batch of 7, 2026-12-07. SmolLM2's
~7,500 train prompts would be ~1.6M answer tokens, ~24 hours at that rate (less on an idle machine), ~20 GB of
float32 features (2.7 MB a sequence); a rebuild from the answers files is one forward, ~110 s per 16 sequences. The
budget's pool (1M answer positions, configs/train_budget.py) is reached after the first ~4,700 answers, so `gemma3`
takes 9,000 train conversations (~5,600 prompts, ~1.2M answer positions: the pool with a margin for shorter answers)
instead of 12,000: the same pool of positions as SmolLM2's in three quarters of the decoding.

The two caches come from the two sides of a split by conversation id (specjax.data.sharegpt.split), so no
held-out conversation is ever trained on. No Spec-Bench prompt is used.
"""

import ml_collections
from ml_collections import config_dict

VARIANTS = ("regenerate", "exits", "gemma3", "small")
MODELS = {"gemma3": "gemma3-270m"}  # model variants; none: SmolLM2-135M-Instruct


def get_config(arg=None):
  variants = [v.strip() for v in (arg or "").split(",") if v.strip()]
  unknown = sorted(set(variants) - set(VARIANTS))
  if unknown:
    raise ValueError(f"configs/train_data.py variants are {VARIANTS}, got {unknown}")
  gemma3 = "gemma3" in variants
  if gemma3 and ("regenerate" not in variants or "exits" in variants):
    raise ValueError("configs/train_data.py:gemma3 takes `regenerate` (a base model's plain prompt has no place for "
                     "ShareGPT's answers) and not `exits` (SmolLM2's layers; give --config.feature_layers), e.g. "
                     f"':regenerate,gemma3', got {arg!r}")
  variants = [v for v in VARIANTS if v in variants]  # the workdir's name in one order, however they were given
  config = ml_collections.ConfigDict()
  config.model = MODELS["gemma3"] if gemma3 else "smollm2-135m"
  config.dtype = "float32"  # the target's compute dtype (the reference)
  # The prompt format (specjax.data.sequences): True the chat template, False plain text (a base model); None: the
  # model's (chat where it has a template), which is how the evaluation prompts it.
  config.chat = config_dict.placeholder(bool)
  if gemma3:
    config.chat = False

  config.seq_len = 256
  # Conversations taken, in file order, from each side of the split. About 57% of ShareGPT's conversations
  # give a sequence (the others start with a non-human turn or have a short answer), each with ~146 answer
  # positions at seq_len 256: ~210k masked positions for train, ~13k held out.
  config.num_train = 2500
  config.num_held_out = 160
  config.held_out_fraction = 0.05
  config.seed = 0  # of the split
  config.max_pairs_per_conversation = 1

  # The target's own answers (`regenerate`): each takes what fits in seq_len after its prompt, kept whatever its
  # length; greedy at temperature 0, else sampled with `regenerate_seed`.
  config.regenerate = "regenerate" in variants
  config.regenerate_batch_size = 16  # prompts per decoding call
  config.regenerate_temperature = 0.0
  config.regenerate_seed = 0
  # Where the answers files (<split>.answers.npz: the answers' token ids, `experiments/regenerate.py`) are kept;
  # empty: the workdir. A rebuild finds the answers there and runs one forward over them instead of decoding. The
  # target's greedy answers are kept in the repository, so a rebuild (or the `exits` variant) decodes only the prompts
  # they do not cover; the `small` check decodes its few answers itself, into its workdir.
  config.answers_dir = (f"data/answers/{config.model}" if config.regenerate and "small" not in variants else "")

  config.feature_layers = (2, 15, 27, 29)  # specjax.data.features.default_feature_layers(30); () for the default
  if gemma3:
    config.feature_layers = (2, 9, 15, 17)  # default_feature_layers(18)
  if "exits" in variants:
    config.feature_layers = (3, 5, 7, 9, 11, 15, 29)
  config.top_k = 32
  config.feature_dtype = "float16"
  if gemma3:
    # Gemma 3's residual stream outgrows float16 (max 65,504): after its layers 9, 15 and 17, |h| reaches 88k, 101k and
    # 66k at the <bos> position and ~48k elsewhere (Spec-Bench prompts): twice the disk, ~2.6 MB a sequence.
    config.feature_dtype = "float32"
  config.batch_size = 8  # sequences per target forward
  config.chunk_batches = 16  # batches between progress records (what a killed build redoes at most)
  config.token_map_sizes = (4096, 8192, 16384, 32768)  # truncated draft vocabularies to report coverage for
  if gemma3:  # a vocabulary 5x SmolLM2's (262,144 tokens): experiments/draft_vocab.py's candidates
    config.token_map_sizes = tuple(2 ** i for i in range(11, 17))

  if config.regenerate:
    # 62.5% of the train side's conversations give a prompt, answered with ~143 tokens at seq_len 256 (64
    # prompts): past the 887k answer positions of the largest cache of ShareGPT's own answers even if the mean
    # answer is 17% shorter.
    config.num_train = 9000 if gemma3 else 12000

  name = "-".join(["train_data", *variants])
  config.workdir = f"workdirs/data/{name}"
  if "small" in variants:
    config.num_train = 24
    config.num_held_out = 8
  return config
