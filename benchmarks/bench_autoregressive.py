r"""Autoregressive decode speed of specjax against the memory-bandwidth roofline and HF transformers.

  python benchmarks/bench_autoregressive.py [--model=smollm2-135m] [--new_tokens=64] [--repeats=3]
      [--batch_sizes=1,8] [--dtypes=float32,bfloat16] [--hf=true] [--context=0]
  python benchmarks/bench_autoregressive.py --model=gemma3-270m --context=1024 --batch_sizes=1
  python benchmarks/bench_autoregressive.py --dtypes=float32,quantized --batch_sizes=1 --hf=false

The prompt is a Spec-Bench question (chat template where the model has one; plain text otherwise); with
`--context=N`, the question after the Spec-Bench questions before it, as plain text, until the prompt holds at
least N tokens (experiments/spec_bench.py `prompt_text`), so a model with sliding-window layers decodes past its
window.

"quantized" among the dtypes loads the GGUF with `quantized=True` (float32 arithmetic over the file's quantized
blocks, specjax.backends.cpu.quantized): its bytes per step count the blocks it reads.

For each case (dtype x batch size) it times greedy `specjax.generate` for exactly `new_tokens` tokens
(stop_ids=(), so no row stops early) and for 1 token (prefill only). Then
  decode step time     = (t(new_tokens) - t(1)) / (new_tokens - 1), the median over rounds of each round's pair,
                         with its range over rounds: the two calls prefill the prompt alike, but a long prompt's
                         prefill moves from call to call (a 1,447-token prefill of Gemma-3-270M in bfloat16 took
                         8.7-12.9 s in five rounds on a shared 2-core host), and divided over new_tokens - 1 steps
                         that noise can outweigh the step; the range says when it does
  compile time         = first call - median of the later calls (for each of the two programs)
  bytes per step       = the weights a step reads, as stored (quantized: the blocks and their scales; of an untied
                         embedding, the gathered rows) + the KV cache it reads and writes (experiments/cost_model.py
                         `step_bytes` with the model's params: per layer {K,V} x batch x the positions it reads, a
                         sliding layer at most its window, averaged over the decode, and the one it writes, x
                         kv_heads x head_dim x itemsize)
  roofline fraction    = bytes per step / step time / read bandwidth,
where read bandwidth is what a jitted sum over a large array reads per second (`experiments.costs`), measured in
the same run, interleaved with the cases.
A decode step reads every weight once whatever the batch, so at batch 1 on CPU the step is memory-bound and
the fraction says how close to the hardware limit the compiled program runs.
Cases run interleaved (one call of each per round), and every figure is a median over rounds. With
`--hf`, HF transformers (torch CPU, fp32, batch 1) decodes the same GGUF for the same number of tokens, with
the faster of 1 and all torch threads (shown as tN).
"""

from __future__ import annotations

import os
import statistics
import time

import jax
from absl import app, flags

import specjax
from experiments import cost_model, spec_bench
from experiments.costs import measure_read_bandwidth
from specjax.loading import resolve_path

_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds after the compile call.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"],
                            "Parameter dtypes; 'quantized': float32 over the GGUF's quantized blocks.")
_HF = flags.DEFINE_bool("hf", True, "Also time HF transformers (fp32, batch 1) when it is importable.")
_HF_THREADS = flags.DEFINE_integer("hf_threads", 0, "torch CPU threads for HF (0: the faster of 1 and all).")
_READ_MB = flags.DEFINE_integer("read_mb", 512, "Array size for the read-bandwidth measurement.")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model name or path for specjax.load.")
_CONTEXT = flags.DEFINE_integer("context", 0, "Least prompt length in tokens (0: one Spec-Bench question alone).")


class SpecjaxCase:
  """Greedy specjax decode of one prompt repeated `batch` times."""

  def __init__(self, model: specjax.Model, prompt: list[int], batch: int, label: str):
    self.model, self.prompts, self.batch, self.label = model, [prompt] * batch, batch, label
    self.name = f"specjax {label} b{batch}"
    self.params = model.params  # as stored (quantized: the blocks), what `cost_model.step_bytes` counts
    self.config = model.config

  def __call__(self, new_tokens: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = specjax.generate(self.model, self.prompts, max_new_tokens=new_tokens, stop_ids=())
    seconds = time.perf_counter() - start
    assert all(len(t) == new_tokens for t in out.tokens), "a row stopped early"
    return seconds, out.tokens[0]


class HFCase:
  """transformers' greedy `generate` on the same GGUF, fp32, batch 1, with its faster torch thread count."""

  def __init__(self, prompt: list[int], config):
    import torch
    from transformers import AutoModelForCausalLM
    path = resolve_path(_MODEL.value)
    self.torch = torch
    self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                      dtype=torch.float32).eval()
    self.input_ids = torch.tensor([prompt])
    # torch's CPU threads spin-wait: on a busy machine one thread can be ~5x faster than all cores.
    threads = _HF_THREADS.value or min({1, os.cpu_count()}, key=lambda n: self._probe(n))
    torch.set_num_threads(threads)
    self.name, self.batch = f"HF transformers float32 b1 t{threads}", 1
    self.config = config.replace(dtype="float32")  # the same model's shapes, read in float32
    self.params = None  # its weights counted from the config (float32)

  def _probe(self, threads: int) -> float:
    self.torch.set_num_threads(threads)
    self(4)
    return self(8)[0]

  def __call__(self, new_tokens: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    with self.torch.inference_mode():
      out = self.model.generate(self.input_ids, attention_mask=self.torch.ones_like(self.input_ids),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0)
    seconds = time.perf_counter() - start
    return seconds, out[0, self.input_ids.shape[1]:].tolist()


def main(argv):
  del argv
  n = _NEW_TOKENS.value
  if n < 2:
    raise app.UsageError("--new_tokens must be at least 2 (the decode step is t(n) - t(1) over n - 1 steps)")
  models = {dtype: specjax.load(_MODEL.value, quantized=True) if dtype == "quantized" else
            specjax.load(_MODEL.value, dtype=dtype) for dtype in _DTYPES.value}
  tokenizer = next(iter(models.values())).tokenizer
  questions = spec_bench.load_questions()
  question = spec_bench.select(questions, categories=["writing"], per_category=1)[0]
  if _CONTEXT.value:  # plain text: a chat template would wrap the whole context as one user turn
    prompt = spec_bench.prompt_ids(question, tokenizer, chat=False, min_tokens=_CONTEXT.value, questions=questions)
    described = f"Spec-Bench q{question.question_id} after the questions before it, plain text"
  else:
    chat = tokenizer.chat_template is not None
    prompt = spec_bench.prompt_ids(question, tokenizer, chat=chat)
    described = f"Spec-Bench q{question.question_id}, {'chat' if chat else 'plain text'}"
  cases = [SpecjaxCase(models[d], prompt, int(b), d) for d in _DTYPES.value for b in _BATCH_SIZES.value]
  if _HF.value:
    try:
      cases.append(HFCase(prompt, next(iter(models.values())).config))
    except ImportError as e:
      print(f"HF transformers not timed: {e}")

  first = {(c.name, k): c(k)[0] for c in cases for k in (n, 1)}  # compile (+ run)
  times = {key: [] for key in first}
  tokens = {}
  bandwidths = []
  for _ in range(_REPEATS.value):
    bandwidths.append(measure_read_bandwidth(_READ_MB.value, repeats=3))
    for c in cases:
      seconds, tokens[c.name] = c(n)
      times[(c.name, n)].append(seconds)
      times[(c.name, 1)].append(c(1)[0])
    bandwidths.append(measure_read_bandwidth(_READ_MB.value, repeats=3))
  bandwidth = statistics.median(bandwidths)

  print(f"\n{_MODEL.value} greedy decode, prompt {len(prompt)} tokens ({described}), {n} new tokens, median of "
        f"{_REPEATS.value} interleaved rounds")
  print(f"jax {jax.__version__} on {jax.devices()}, {os.cpu_count()} CPUs; read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (a jitted sum, median of {len(bandwidths)} medians)\n")
  header = (f"{'case':<31} {'tokens/s':>9} {'decode ms/step':>15} {'(range)':>13} {'decode tok/s':>13} "
            f"{'prefill s':>10} {'compile s':>10} {'MB/step':>8} {'floor ms':>9} {'GB/s':>6} {'roofline':>9}")
  print(header)
  print("-" * len(header))
  rows, steps = {}, {}
  for c in cases:
    t_n, t_1 = statistics.median(times[(c.name, n)]), statistics.median(times[(c.name, 1)])
    round_steps = [(a - b) / (n - 1) for a, b in zip(times[(c.name, n)], times[(c.name, 1)])]  # each round's pair
    step = steps[c.name] = statistics.median(round_steps)
    compile_s = first[(c.name, n)] - t_n + first[(c.name, 1)] - t_1
    positions_in_use = len(prompt) + n / 2  # mean over the decode steps
    step_bytes = cost_model.step_bytes(c.config, positions_in_use, rows=c.batch, params=c.params)
    rows[c.name] = c.batch * n / t_n
    compile_text = "–" if isinstance(c, HFCase) else f"{compile_s:.1f}"  # torch eager: nothing to compile
    spread = f"{1e3 * min(round_steps):.1f}-{1e3 * max(round_steps):.1f}"
    print(f"{c.name:<31} {c.batch * n / t_n:>9.1f} {1e3 * step:>15.1f} {spread:>13} {c.batch / step:>13.1f} "
          f"{t_1:>10.2f} {compile_text:>10} {step_bytes / 1e6:>8.0f} {1e3 * step_bytes / bandwidth:>9.1f} "
          f"{step_bytes / step / 1e9:>6.1f} "
          f"{step_bytes / step / bandwidth:>8.0%}")
  print("\ntokens/s: batch x new tokens / wall time of the whole call (prefill included); decode: per step, "
        "prefill excluded (median over rounds, and its range);\nprefill s: the 1-token call; compile s: first calls "
        "minus median calls (both programs); floor ms: MB/step / read bandwidth, the step at the bandwidth limit;\n"
        "roofline: (MB/step / step time) / read bandwidth.\n")
  hf = next((c for c in cases if isinstance(c, HFCase)), None)
  for b in _BATCH_SIZES.value:
    dense, packed = (next((c for c in cases if isinstance(c, SpecjaxCase) and c.label == label and c.batch == int(b)),
                          None) for label in ("float32", "quantized"))
    if dense and packed:
      weights = [cost_model.stored_weight_bytes(c.params, c.config) for c in (packed, dense)]
      print(f"specjax quantized / float32 (batch {b}): decode step {steps[packed.name] / steps[dense.name]:.2f}x "
            f"the time, {weights[0] / weights[1]:.2f}x the weight bytes; greedy tokens agree for "
            f"the first {_agreement(tokens[packed.name], tokens[dense.name])} of {n}")
  for dtype in ("float32", "bfloat16", "quantized"):
    ours = next((c for c in cases if isinstance(c, SpecjaxCase) and c.label == dtype and c.batch == 1), None)
    if hf and ours:
      print(f"specjax {dtype} / HF float32 (batch 1): {rows[ours.name] / rows[hf.name]:.2f}x tokens/s; "
            f"greedy tokens agree for the first {_agreement(tokens[ours.name], tokens[hf.name])} of {n}")


def _agreement(a: list[int], b: list[int]) -> int:
  """How many tokens two greedy continuations share before they first differ."""
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
  app.run(main)
