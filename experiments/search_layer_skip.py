r"""Searches which layers a layer-skip drafter should skip, and saves the record (experiments/layer_skip_search.py).

  python -m experiments.search_layer_skip --model=smollm2-135m --out=configs/layer_skip_sets/smollm2-135m.json \
      --prompts=4 --max_new_tokens=48 --budget=10 [--objective=measured|proxy] [--gamma=2]
  python -m experiments.search_layer_skip --method=teacher_forced --model=smollm2-135m \
      --out=configs/layer_skip_sets/smollm2-135m-deep.json --sequences=16 --gamma=3 [--verify_cost=1.35] \
      [--candidate_pool=14]

`--method=generate` (the default) decodes calibration prompts with every candidate set; they are Spec-Bench
questions of the dev side of the dev/test split (experiments/spec_bench.py `in_split`; the comparisons report the
test side), taken from the END of each category. `--method=teacher_forced`
scores deep sets on ShareGPT training sequences and touches no evaluation prompt.
"""

from __future__ import annotations

from absl import app, flags
from tqdm import tqdm

import specjax
from specjax.decoding import prepare_batch
from experiments.layer_skip_search import deep_search, drafter_options, save_skip_set, search, training_sequences
from experiments import spec_bench


def calibration_prompts(model, questions, num_prompts: int, *, max_new_tokens: int, gamma: int
                        ) -> tuple[list, list[list[int]]]:
  """Chat prompts from Spec-Bench questions that share one compiled shape, spread over categories.

  Takes questions of the dev side of the dev/test split round-robin over categories from the END of each category,
  keeping those whose padded width and cache lengths (autoregressive and speculative) equal the first
  one's, so each candidate compiles one program. Returns (questions, token ids).
  """
  by_category: dict[str, list] = {}
  for q in (q for q in questions if spec_bench.in_split(q, questions, "dev")):
    by_category.setdefault(q.category, []).append(q)
  pools = [list(reversed(qs)) for qs in by_category.values()]
  order = [pool[i] for i in range(max(map(len, pools))) for pool in pools if i < len(pool)]

  def shape(ids):
    spec = prepare_batch(model, [ids], max_new_tokens, extra_positions=gamma + 1)
    return spec.tokens.shape, spec.cache_len, prepare_batch(model, [ids], max_new_tokens).cache_len

  chosen, key = [], None
  for q in order:
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": q.turns[0]}], add_generation_prompt=True)
    if key is None:
      key = shape(ids)
    if shape(ids) == key:
      chosen.append((q, ids))
    if len(chosen) == num_prompts:
      break
  return [q for q, _ in chosen], [ids for _, ids in chosen]



def main(argv):
  del argv
  f = flags.FLAGS
  model = specjax.load(f.model, dtype="float32")
  if f.method == "teacher_forced":
    return main_teacher_forced(model, f)
  if model.tokenizer is None:
    raise ValueError(f"{f.model} has no tokenizer; calibration prompts are Spec-Bench text")
  questions, prompts = calibration_prompts(model, spec_bench.load_questions(), f.prompts,
                                           max_new_tokens=f.max_new_tokens, gamma=f.gamma)
  exit_layers = [int(k) for k in f.exit_layers]
  budget = 10 if f.budget is None else f.budget
  bar = tqdm(total=budget, desc=f"{f.objective} skip-set search", unit="candidate")

  def progress(skip, evaluation):
    bar.update(1)
    bar.set_postfix(skip=drafter_options(model.config.num_layers, skip), speedup=f"{evaluation.speedup:.3f}",
                    alpha=f"{evaluation.alpha:.2f}")
    bar.write(f"skip {list(skip)}: speedup {evaluation.speedup:.3f}, α {evaluation.alpha:.3f}, "
              f"tokens/round {evaluation.mean_accepted:.2f}, c {evaluation.draft_cost:.2f}, "
              f"compile {evaluation.compile_seconds:.0f} s")

  record = search(model, prompts, gamma=f.gamma, max_new_tokens=f.max_new_tokens, budget=budget,
                  objective=f.objective, repeats=f.repeats, exit_layers=exit_layers,
                  candidate_pool=f.candidate_pool, verify_cost=f.verify_cost, on_evaluation=progress,
                  calibration={"source": "Spec-Bench, last questions of each category, chat template",
                               "question_ids": [q.question_id for q in questions],
                               "categories": [q.category for q in questions]})
  bar.close()
  save_skip_set(f.out, record)
  speedup = record["measured_speedup"] if record["objective"] == "measured" else record["proxy_speedup"]
  print(f"best: {record['options']} gamma={record['gamma']}: {record['objective']} speedup {speedup:.3f} "
        f"(acceptance rate {record['acceptance_rate']:.3f}, α {record['alpha']:.3f}, tokens/round "
        f"{record['mean_accepted']:.2f}) after {record['search']['evaluations']} evaluations "
        f"({record['search']['greedy_stopped']}); saved to {f.out}")
  if speedup < 1:
    print("speedup < 1: on this model every skip set tried is slower than autoregressive decoding.")


def main_teacher_forced(model, f):
  tokens, mask, source = training_sequences(model, f.sequences, seq_len=f.seq_len)
  print(f"calibration: {source}")
  bar = tqdm(desc="teacher-forced skip-set search", unit="candidate")

  def progress(skip, evaluation):
    bar.update(1)
    bar.set_postfix(skipped=len(skip), speedup=f"{evaluation.speedup:.3f}", alpha=f"{evaluation.alpha:.2f}")

  record = deep_search(model, tokens, mask, gamma=f.gamma, max_skip_fraction=f.max_skip_fraction,
                       acceptance=f.acceptance, verify_cost=f.verify_cost, budget=f.budget,
                       candidate_pool=f.candidate_pool, calibration=source,
                       on_evaluation=progress)
  bar.close()
  save_skip_set(f.out, record)
  for step in record["search"]["path"]:
    print(f"skip {len(step['skip_layers'])}: {step['skip_layers']}: α {step['alpha']:.3f}, "
          f"c {step['draft_cost']:.2f}, predicted speedup {step['speedup']:.3f}")
  print(f"best: {record['options']} gamma={record['gamma']}: predicted speedup {record['proxy_speedup']:.3f} "
        f"(α {record['alpha']:.3f}) after {record['search']['evaluations']} evaluations; saved to {f.out}")


def _define_flags():
  flags.DEFINE_string("model", "smollm2-135m", "Model name or path for specjax.load (fp32).")
  flags.DEFINE_string("out", None, "Where to save the JSON record.", required=True)
  flags.DEFINE_integer("prompts", 4, "Calibration prompts (Spec-Bench, one compiled shape).")
  flags.DEFINE_integer("max_new_tokens", 48, "Tokens generated per calibration prompt.")
  flags.DEFINE_integer("gamma", 2, "Draft tokens per round.")
  flags.DEFINE_enum("method", "generate", ["generate", "teacher_forced"],
                    "generate: score sets by decoding Spec-Bench prompts (greedy search from single layers); "
                    "teacher_forced: deep sets scored on ShareGPT training text (deep_search).")
  flags.DEFINE_integer("budget", None, "Most candidate evaluations (generate: each compiles a program, sweep "
                       "included; default 10. teacher_forced: default the whole path).")
  flags.DEFINE_integer("sequences", 16, "teacher_forced: ShareGPT train conversations to calibrate on.")
  flags.DEFINE_integer("seq_len", 256, "teacher_forced: tokens per calibration sequence.")
  flags.DEFINE_float("max_skip_fraction", 0.5, "teacher_forced: the path goes on to this fraction of layers.")
  flags.DEFINE_enum("acceptance", "greedy", ["greedy", "sampling"], "teacher_forced: which α (see the docs).")
  flags.DEFINE_enum("objective", "measured", ["measured", "proxy"], "Timed speedup or Leviathan-model proxy.")
  flags.DEFINE_integer("repeats", 2, "Interleaved timing rounds per candidate (measured objective).")
  flags.DEFINE_list("exit_layers", ["28"], "Early-exit points swept before the greedy search.")
  flags.DEFINE_integer("candidate_pool", 0, "Greedy (both methods): only the N least-influential layers (0: all).")
  flags.DEFINE_float("verify_cost", 1.0, "Proxy: verification cost in AR steps (experiments/costs.py measures it).")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
