r"""Every drafter's draft cost c and verification cost r on this machine's default backend (CPU, GPU or TPU), and
the speedup Leviathan's model gives with them for the acceptance a `compare_drafters` run measured.

  python benchmarks/bench_costs.py [--alpha_from=results/compare_drafters/results.json] [--dtype=float32]
  python benchmarks/bench_costs.py --write_shape=model_shape.json          # where the model's weights are
  python benchmarks/bench_costs.py --shape=model_shape.json                # elsewhere: random weights, same shape

c and r are timed as `experiments.costs` times them in the runner (compiled loops, interleaved, medians,
compilation excluded): c = one draft token / one 1-token target step, r = a forward over gamma + 1 tokens / a
1-token step, for the methods of `configs/compare_drafters.py` at the gamma that run used. A step's time does
not depend on the weights' values, so on a machine without the model's checkpoint `--shape` times a model of the
same shape with random weights (the drafters' shipped checkpoints load onto it: they check the shape and name).
Acceptance does depend on the weights: alpha comes from `--alpha_from`, a results.json measured with the real
model, and predicted speedup = (1 - alpha^(gamma+1)) / (1 - alpha) / (gamma c + r) with this machine's c and r.
On XLA:CPU that prediction was within 1-15% of the measured speedup (README, Results).

Also printed: r for a forward over T = 1, 2, 5, 8, 16, 32, 64 tokens and a batch-8 step against a batch-1 step
(how close to free extra rows are on this backend), and the 1-token step against the bandwidth floor (bytes per
step / the copy bandwidth measured in the same run). Writes everything to `--out` (JSON); `--costs_json` prints
such a file again with another run's alpha.

`--decode=N` also decodes N prompts (random tokens) with every method and autoregressively on the model at hand,
interleaved: whether each output equals autoregressive decoding's, and the measured speedup beside the one the
formula predicts from that run's own alpha and these costs, which checks the cost model on this backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import app, flags

import specjax
from configs import common, compare_drafters
from experiments import costs as cost_lib
from experiments.run import method_options
from specjax import leviathan
from specjax.config import ModelConfig
from specjax.loading import Model
from specjax.model import init_params

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model name or path for specjax.load.")
_SHAPE = flags.DEFINE_string("shape", "", "A model-shape JSON (--write_shape): random weights of that shape.")
_WRITE_SHAPE = flags.DEFINE_string("write_shape", "", "Write --model's shape JSON here and exit.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Parameter and compute dtype.")
_ALPHA_FROM = flags.DEFINE_string("alpha_from", "results/compare_drafters/results.json",
                                  "A compare_drafters results.json: each method's alpha and gamma.")
_CONTEXT = flags.DEFINE_integer("context", 145, "Tokens in the cache when timing (the runner's median context).")
_CACHE_LEN = flags.DEFINE_integer("cache_len", 256, "Cache positions.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timing rounds.")
_TOKENS = flags.DEFINE_list("tokens", ["1", "2", "5", "8", "16", "32", "64"], "Forward widths T for the r table.")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows of the batched step compared with a 1-row step.")
_COPY_MB = flags.DEFINE_integer("copy_mb", 0, "MB copied to measure the memory bandwidth in this run (0: 256 on CPU, "
                                 "2048 on an accelerator).")
_DECODE = flags.DEFINE_integer("decode", 0, "Also decode this many prompts (random tokens of --context length, "
                                "one per call) with every method and autoregressively: identical outputs, measured "
                                "speedup against the one predicted from this run's alpha and costs.")
_METHODS = flags.DEFINE_list("methods", [], "Only these methods (default: all of compare_drafters', and with "
                              "--decode the --extra_skip one).")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens per --decode call.")
_EXTRA_SKIP = flags.DEFINE_list("extra_skip", ["15"], "--decode also runs layer_skip without these layers (a draft "
                                "that agrees with the target most of the time, whatever the weights).")
_OUT = flags.DEFINE_string("out", "", "JSON output path (default: print only).")
_COSTS_JSON = flags.DEFINE_string("costs_json", "", "Time nothing: print an --out JSON's costs with "
                                  "--alpha_from's alpha.")


def model_shape(model: Model) -> dict:
  return {"name": model.name, "config": dataclasses.asdict(model.config)}


def random_model(path: str, dtype: str) -> Model:
  with open(path) as f:
    shape = json.load(f)
  fields = dict(shape["config"], dtype=dtype)
  for key in ("rope_scaling", "rope_freq_factors"):
    if fields.get(key) is not None:
      fields[key] = tuple(tuple(v) if isinstance(v, list) else v for v in fields[key])
  config = ModelConfig(**fields)
  params = init_params(config, jax.random.PRNGKey(0))
  return Model(config=config, params=params, tokenizer=None, name=shape["name"])


def measured_alpha(path: str) -> dict[str, dict]:
  """{method: {"alpha", "gamma"}} from a runner's results.json (methods without alpha left out)."""
  if not path or not os.path.exists(path):
    return {}
  with open(path) as f:
    summary = json.load(f)["summary"]["methods"]
  return {m: {"alpha": s["alpha"], "gamma": s["gamma"]} for m, s in summary.items() if s.get("alpha") is not None}


def forward_widths(model: Model, context: list[int], widths: list[int], rows: int) -> dict[str, float]:
  """Seconds of a forward over T tokens (1 row) for each T, and of a 1-token step over `rows` rows."""
  runs = {f"T{t}": cost_lib.forward_run(model, context, _CACHE_LEN.value, tokens=t) for t in widths}
  runs[f"B{rows}"] = cost_lib.forward_run(model, context, _CACHE_LEN.value, rows=rows)
  return cost_lib.interleaved_seconds(runs, _REPEATS.value)


def decode(model: Model, methods: list, measured: dict, num_prompts: int, new_tokens: int, repeats: int) -> dict:
  """Decodes `num_prompts` prompts with each method (fixed gamma) and autoregressively, interleaved per prompt and
  repeat; returns per method: identical (every output equals autoregressive decoding's), alpha (pooled),
  speedup (median over prompts of the median seconds ratio) and the speedup predicted from alpha and `measured`."""
  rng = np.random.default_rng(1)
  prompts = [[int(t) for t in rng.integers(100, model.config.vocab_size, size=_CONTEXT.value)]
             for _ in range(num_prompts)]
  runs = {"autoregressive": lambda p: specjax.generate(model, [p], max_new_tokens=new_tokens, stop_ids=())}
  for name, drafter, gamma in methods:
    runs[name] = (lambda d, g: lambda p: specjax.generate(model, [p], max_new_tokens=new_tokens, drafter=d, gamma=g,
                                                          adaptive=False, stop_ids=()))(drafter, gamma)
  compile_seconds = {name: run(prompts[0]).stats["compile_seconds"] for name, run in runs.items()}
  seconds = {name: [[] for _ in prompts] for name in runs}
  outputs: dict[str, list] = {name: [None] * len(prompts) for name in runs}
  stats: dict[str, list] = {name: [] for name in runs}
  for _ in range(repeats):
    for i, prompt in enumerate(prompts):
      for name, run in runs.items():
        out = run(prompt)
        seconds[name][i].append(out.stats["seconds"])
        outputs[name][i] = [int(t) for t in out.tokens[0]]
        stats[name].append(out.stats)
  result = {"prompts": num_prompts, "new_tokens": new_tokens, "repeats": repeats, "compile_seconds": compile_seconds,
            "autoregressive_tokens_per_second": new_tokens / float(np.median(seconds["autoregressive"])),
            "methods": {}}
  for name, drafter, gamma in methods:
    pooled = {key: np.concatenate([np.ravel(s[key]) for s in stats[name]])
              for key in ("accepted_per_row", "rejections_per_row")}
    alpha = leviathan.alpha_from_stats(pooled, gamma)
    ratios = [np.median(a) / np.median(m) for a, m in zip(seconds["autoregressive"], seconds[name])]
    cost = measured["methods"][name]
    result["methods"][name] = {
        "gamma": gamma, "alpha": alpha, "identical": outputs[name] == outputs["autoregressive"],
        "mean_accepted": float(np.mean([s["mean_accepted"] for s in stats[name]])),
        "speedup": float(np.median(ratios)),
        "predicted_speedup": leviathan.predicted_speedup(alpha, gamma, cost["draft_cost"], cost["verify_cost"])}
  return result


def main(argv):
  del argv
  if _WRITE_SHAPE.value:
    with open(_WRITE_SHAPE.value, "w") as f:
      json.dump(model_shape(specjax.load(_MODEL.value, dtype=_DTYPE.value)), f, indent=1)
    print(f"wrote {_WRITE_SHAPE.value}")
    return
  alphas = measured_alpha(_ALPHA_FROM.value)
  if _COSTS_JSON.value:
    with open(_COSTS_JSON.value) as f:
      report(json.load(f), alphas)
    return
  device = jax.devices()[0]
  print(f"backend {jax.default_backend()} ({device.device_kind}), jax {jax.__version__}, dtype {_DTYPE.value}")
  model = random_model(_SHAPE.value, _DTYPE.value) if _SHAPE.value else specjax.load(_MODEL.value, dtype=_DTYPE.value)
  print(f"{model} ({'random weights of the real shape' if _SHAPE.value else 'real weights'})")
  rng = np.random.default_rng(0)
  context = [int(t) for t in rng.integers(100, model.config.vocab_size, size=_CONTEXT.value)]

  methods, skipped = [], []
  for method in common.methods(*compare_drafters.METHODS):
    if "drafter" not in method:
      continue
    try:
      options, own_gamma = method_options(method)
      drafter = specjax.make_drafter(method["drafter"], model, **options)
    except ValueError as e:  # a missing shipped checkpoint (CheckpointError), a layer the model lacks: time the rest
      skipped.append(f"{method['name']}: {e}")
      continue
    gamma = alphas.get(method["name"], {}).get("gamma") or own_gamma or 4
    methods.append((method["name"], drafter, int(gamma)))
  for line in skipped:
    print(f"skipped {line}")
  if _DECODE.value and _EXTRA_SKIP.value:
    skip = [int(l) for l in _EXTRA_SKIP.value]
    methods.append((f"layer_skip_without_{'_'.join(map(str, skip))}",
                    specjax.make_drafter("layer_skip", model, skip_layers=skip), 4))
  unknown = sorted(set(_METHODS.value) - {m[0] for m in methods} - {line.split(":")[0] for line in skipped})
  if unknown:
    raise app.UsageError(f"--methods names unknown methods {unknown}; known: {[m[0] for m in methods]}")
  methods = [m for m in methods if not _METHODS.value or m[0] in _METHODS.value]

  start = time.perf_counter()
  measured = cost_lib.measure(model, methods, context, _CACHE_LEN.value, repeats=_REPEATS.value, count_bytes=True)
  seconds = forward_widths(model, context, [int(t) for t in _TOKENS.value], _BATCH.value)
  bandwidth = cost_lib.measure_copy_bandwidth(_COPY_MB.value or (256 if jax.default_backend() == "cpu" else 2048),
                                               repeats=7)
  result = {
      "backend": jax.default_backend(), "device_kind": device.device_kind, "jax": jax.__version__,
      "dtype": _DTYPE.value, "weights": "random (the real model's shape)" if _SHAPE.value else "real",
      "model": model.name, "context": _CONTEXT.value, "cache_len": _CACHE_LEN.value, "repeats": _REPEATS.value,
      "date": time.strftime("%Y-%m-%d"), "width_seconds": seconds,
      "batch": _BATCH.value, "bandwidth_gbs": bandwidth / 1e9, "costs": measured,
      "skipped": skipped}
  if _DECODE.value:
    result["decode"] = decode(model, methods, measured, _DECODE.value, _NEW_TOKENS.value, max(1, _REPEATS.value // 2))
  result["wall_seconds"] = time.perf_counter() - start
  report(result, alphas)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1, default=str)
    print(f"wrote {_OUT.value}")


def report(result: dict, alphas: dict[str, dict]) -> None:
  """Prints the width table and the per-method costs with Leviathan's prediction for `alphas`."""
  measured, seconds, batch = result["costs"], result["width_seconds"], result["batch"]
  widths = sorted(int(k[1:]) for k in seconds if k.startswith("T"))
  t_1 = seconds["T1"]
  step_bytes = measured["target_step_bytes_xla"]
  print(f"\n{result['backend']} ({result['device_kind']}), jax {result['jax']}, {result['dtype']}, "
        f"{result['weights']} weights; 1-token target step {t_1 * 1e3:.3f} ms, {step_bytes / 1e6:.0f} MB per step")
  floor = step_bytes / (result["bandwidth_gbs"] * 1e9)
  print(f"copy bandwidth {result['bandwidth_gbs']:.0f} GB/s measured in the run: bandwidth floor {floor * 1e3:.3f} ms, "
        f"roofline fraction {floor / t_1:.0%}")
  print("\n| tokens T (1 row) | " + " | ".join(str(t) for t in widths) + f" | batch {batch} (1 token) |")
  print("|---|" + "---:|" * (len(widths) + 1))
  print("| ms | " + " | ".join(f"{seconds[f'T{t}'] * 1e3:.3f}" for t in widths)
        + f" | {seconds[f'B{batch}'] * 1e3:.3f} |")
  print("| / 1-token step | " + " | ".join(f"{seconds[f'T{t}'] / t_1:.2f}" for t in widths)
        + f" | {seconds[f'B{batch}'] / t_1:.2f} |")

  fmt = lambda x, spec: "–" if x is None else format(x, spec)  # noqa: E731
  print("\n| method | γ | c | r | c from bytes | alpha | predicted speedup |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for name, cost in measured["methods"].items():
    gamma, alpha = cost["gamma"], alphas.get(name, {}).get("alpha")
    predicted = None
    if alpha is not None:
      predicted = leviathan.predicted_speedup(alpha, gamma, cost["draft_cost"], cost["verify_cost"])
    print(f"| {name} | {gamma} | {cost['draft_cost']:.3f} | {cost['verify_cost']:.2f} | "
          f"{cost['draft_cost_bytes']:.3f} | {fmt(alpha, '.2f')} | {fmt(predicted, '.2f')}x |")
  if "decode" in result:
    d = result["decode"]
    print(f"\nDecoding {d['prompts']} prompts x {d['new_tokens']} tokens, batch 1, fixed gamma, {d['repeats']} "
          f"interleaved repeats (this run's weights; autoregressive {d['autoregressive_tokens_per_second']:.0f} "
          "tokens/s):\n")
    print("| method | γ | output equals autoregressive | alpha (this run) | mean accepted | speedup | predicted | "
          "compile s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name, m in d["methods"].items():
      print(f"| {name} | {m['gamma']} | {m['identical']} | {m['alpha']:.2f} | {m['mean_accepted']:.2f} | "
            f"{m['speedup']:.2f}x | {m['predicted_speedup']:.2f}x | {d['compile_seconds'][name]:.1f} |")
  print(f"\ntimed in {result['wall_seconds']:.0f} s, compilation included (excluded from every figure)")


if __name__ == "__main__":
  app.run(main)
