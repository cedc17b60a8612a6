r"""Other implementations decoding the same weights, as methods of the experiments runner.

A method spec names a peer where a specjax method names a drafter (configs/bench_peers.py runs them all):

  {"name": "hf_assisted", "peer": "hf_assisted", "options": {"draft": "workdirs/train/draft4/smollm2-135m-draft"}}

  hf_autoregressive        HF transformers `generate`, torch CPU, float32, on the config's model: a GGUF file
                           loaded with `gguf_file=` (HF dequantizes it itself) or an HF directory
  hf_prompt_lookup         the same with `prompt_lookup_num_tokens=` (prompt lookup decoding, Saxena 2023)
  hf_assisted              the same with `assistant_model=` (assisted generation: speculative decoding with
                           greedy verification, Leviathan et al. 2023); option draft= an HF Llama directory, or
                           a specjax distilled draft ("smollm2-135m-draft", a .safetensors checkpoint), which is
                           exported to one with `specjax.export.save_hf`
  llamacpp_autoregressive  llama.cpp through `llama-cpp-python` on the same GGUF file, with its own kernels on
                           the file's quantized weights (it compiles llama.cpp, minutes: install it with
                           `LLAMACPP_INSTALL`, which builds it for this CPU's features without AMX)
  llamacpp_prompt_lookup   the same with `LlamaPromptLookupDecoding` drafting

llama.cpp runs in a process of its own (`SubprocessPeer`): its native code can die (an instruction the CPU lacks,
as an AMX build does on a host without AMX), and a peer that dies is reported (`PeerFailed`: the runner records why
under `summary.failed_peers` and goes on without it) instead of taking the run with it. Its build (version and the
CPU features it was compiled for, `llama_print_system_info`) is recorded with the run (`summary.peers`). The process
is spawned: it imports the main module again, so a script that makes a llama.cpp peer needs the
`if __name__ == "__main__":` guard (experiments.run has it).

What is held equal: the prompt token ids (the chat template as the runner renders it), greedy decoding, the
runner's `max_new_tokens` and the tokenizer's stop tokens (a row ends with its stop token, as in specjax).
What is not: rows are decoded one at a time (HF's assisted and prompt-lookup generation take batch 1 only,
llama.cpp's `generate` too), so with `batch_size` > 1 a peer's call is the sum of its rows; and each peer
runs its own kernels: HF float32 torch (argmax agrees with specjax's float32 on most tokens; a near tie can
flip), llama.cpp the GGUF's own quantization (Q4_1 for SmolLM2), which is why agreement with specjax is
reported rather than required. Drafts per round default to the method's `gamma`, as for specjax drafters,
with a fixed schedule; HF's own defaults (20 assistant tokens with a heuristic schedule and a confidence
threshold) are options. torch and llama.cpp run with the faster of 1 and all CPU threads (XLA uses all),
probed once per model on a short decode, unless the `threads` / `n_threads` option sets them: their workers
spin-wait, and on a busy machine one thread can be several times faster than all. llama.cpp's `n_threads=-1`
(`SAME_THREADS`) runs it on the threads specjax's programs run on (`specjax_threads`: XLA's CPU client sizes its
pool, which the CPU kernels share, to the cores this process may use), for a comparison at equal threads. There is
nothing to compile: `compile_seconds` is 0 and the runner's untimed warmup call absorbs first-call allocation.

Stats (the keys of `specjax.generate`'s) come from a trace of the target's forward passes: forward i reads
`inputs_i` tokens after `past_i` cached ones. Before forward i the committed sequence holds `committed_0` =
prompt length, then `committed_i = past_i + 1` (the newest token is read again with the drafts), so forward i
verified `drafts_i = past_i + inputs_i - committed_i` drafts and committed `gain_i = committed_{i+1} -
committed_i` tokens, of which `gain_i - 1` were accepted drafts. As in specjax: `acceptance_rate` = accepted /
proposed, `alpha` = accepted / (accepted + rounds with a rejection), `mean_accepted` = tokens committed per
forward after the first (the first is the prefill, which HF's assisted generation also uses to verify).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import importlib
import importlib.util
import os
import signal
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

from absl import logging

import specjax
from specjax.decoding import Output
from specjax.loading import resolve_path

HF_PEERS = ("hf_autoregressive", "hf_prompt_lookup", "hf_assisted")
LLAMACPP_PEERS = ("llamacpp_autoregressive", "llamacpp_prompt_lookup")
PEERS = HF_PEERS + LLAMACPP_PEERS
INSTALL_HINT = "pip install 'specjax[peers]'"
LLAMACPP_INSTALL = ('CMAKE_ARGS="$(python -m experiments.peers --cmake_args)" pip install --no-cache-dir '
                    "-e '.[peers]'")  # built for this CPU (`llamacpp_cmake_args`), not a cached wheel of another host's
# llama.cpp's CPU features by /proc/cpuinfo flag: each one the host has is switched on, the rest off. AMX is always
# off: a build with it died with SIGILL (`tilezero` in a worker thread) on a host that lists amx_tile, and a native
# build takes it from the compiler's flags whatever GGML_AMX_* say, so the build is never native.
LLAMACPP_FEATURES = (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
                     ("avx512f", "GGML_AVX512"), ("avx512_vnni", "GGML_AVX512_VNNI"),
                     ("avx512_bf16", "GGML_AVX512_BF16"), ("avx512vbmi", "GGML_AVX512_VBMI"))


def llamacpp_cmake_args(cpu_flags: Sequence[str] | None = None) -> str:
  """CMAKE_ARGS for building llama.cpp (llama-cpp-python) for this CPU: the features it lists (`cpu_flags`, default
  /proc/cpuinfo's), never AMX, not native."""
  if cpu_flags is None:
    with open("/proc/cpuinfo") as f:
      cpu_flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
  have = set(cpu_flags)
  args = ["-DGGML_NATIVE=OFF"] + [f"-D{option}={'ON' if flag in have else 'OFF'}"
                                  for flag, option in LLAMACPP_FEATURES]
  return " ".join(args + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


class Unavailable(Exception):
  """The peer's library is not installed: the runner leaves the method out and prints this reason."""


class PeerFailed(Exception):
  """A peer's process died or its decoding failed: the runner stops timing the method and reports this reason."""


@dataclasses.dataclass(frozen=True)
class Forward:
  """One forward pass of the target: it read `inputs` tokens after `past` cached ones."""
  past: int
  inputs: int


def trace_counts(forwards: Sequence[Forward], prompt_len: int, new_tokens: int) -> dict[str, int]:
  """Drafts proposed and accepted, rejecting rounds and tokens committed after the first forward, for one row
  (the module docstring has the bookkeeping)."""
  committed = [prompt_len] + [f.past + 1 for f in forwards[1:]] + [prompt_len + new_tokens]
  counts = {"target_calls": len(forwards), "proposed": 0, "accepted": 0, "rejections": 0, "from_rounds": 0}
  for i, f in enumerate(forwards):
    drafts = f.past + f.inputs - committed[i]
    accepted = committed[i + 1] - committed[i] - 1
    counts["proposed"] += drafts
    counts["accepted"] += max(accepted, 0)
    counts["rejections"] += int(accepted < drafts)
    if i:
      counts["from_rounds"] += committed[i + 1] - committed[i]
  return counts


def output(tokenizer, stop_ids: Sequence[int], rows: list[list[int]], traces: list[dict[str, int]],
           seconds: float, gamma: int | None, **extra) -> Output:
  """An `Output` with `specjax.generate`'s stats keys (None where the peer has no such figure)."""
  total = {k: sum(t[k] for t in traces) for k in traces[0]}
  rounds = total["target_calls"] - len(rows)  # forwards after each row's first
  new_tokens = sum(len(r) for r in rows)
  texts = [tokenizer.decode(r[:-1] if r and r[-1] in stop_ids else r) if tokenizer else "" for r in rows]
  speculative = gamma is not None
  stats = {
      "rounds": rounds, "target_calls": total["target_calls"], "new_tokens": new_tokens,
      "new_tokens_per_row": [len(r) for r in rows],
      "acceptance_rate": (total["accepted"] / total["proposed"] if total["proposed"] else float("nan"))
      if speculative else None,
      "alpha": (total["accepted"] / (total["accepted"] + total["rejections"])
                if total["accepted"] + total["rejections"] else float("nan")) if speculative else None,
      "mean_accepted": total["from_rounds"] / rounds if rounds else float("nan"),
      "proposed": total["proposed"], "accepted": total["accepted"],
      "compile_seconds": 0.0, "seconds": seconds, "tokens_per_second": new_tokens / seconds, **extra}
  return Output(tokens=rows, texts=texts, stats=stats)


# ------------------------------------------------------------------------------------------ HF transformers


def _import_torch():
  try:
    import torch
    import transformers
  except ImportError as e:
    raise Unavailable(f"HF transformers (torch CPU) is not installed ({e}); {INSTALL_HINT}") from e
  del transformers  # imported to check that it is installed
  return torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
  """transformers' model of a GGUF file (HF's own dequantization, `gguf_file=`) or an HF directory, float32,
  eval; loaded once per process and shared by the HF peers."""
  torch = _import_torch()
  from transformers import AutoModelForCausalLM
  if os.path.isfile(path):
    if not path.endswith(".gguf"):
      raise ValueError(f"HF peers read a .gguf file or an HF model directory, got {path}")
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()
  return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=4)
def torch_threads(path: str) -> int:
  """The faster of 1 and all CPU threads for HF greedy decoding of `path` (a 16-token prompt, 8 new tokens)."""
  torch = _import_torch()
  model = hf_model(path)
  ids = torch.arange(1, 17)[None]
  times = {}
  for threads in dict.fromkeys((1, os.cpu_count() or 1)):
    torch.set_num_threads(threads)
    with torch.inference_mode():
      for _ in range(2):  # the first call allocates
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
        times[threads] = time.perf_counter() - start
  best = min(times, key=times.get)
  logging.info("torch threads for HF peers: %d (8 tokens: %s)", best,
               ", ".join(f"{n} threads {t:.2f} s" for n, t in times.items()))
  return best


class HFPeer:
  """HF `generate` (greedy, batch 1 per row) on the target, with a trace of its forward passes."""

  def __init__(self, name: str, path: str, tokenizer, stop_ids: Sequence[int], gamma: int | None,
               generate_kwargs: dict[str, Any], threads: int = 0):
    self.torch = _import_torch()
    self.name, self.tokenizer, self.stop_ids, self.gamma = name, tokenizer, tuple(stop_ids), gamma
    self.model = hf_model(path)
    self.generate_kwargs = generate_kwargs
    self.threads = int(threads) or torch_threads(path)
    self._forwards: list[Forward] | None = None  # a list while this peer's generate runs
    self.model.register_forward_pre_hook(self._record, with_kwargs=True)

  def _record(self, module, args, kwargs):
    del module, args
    if self._forwards is None:
      return
    inputs = kwargs["input_ids"].shape[1]
    positions = kwargs.get("position_ids")
    past = int(positions[0, 0]) if positions is not None else int(kwargs["cache"].get_seq_length())
    self._forwards.append(Forward(past=past, inputs=inputs))

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Output:
    torch = self.torch
    torch.set_num_threads(self.threads)  # global to torch: HF peers share it
    rows, traces = [], []
    start = time.perf_counter()
    with torch.inference_mode():
      for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        self._forwards = []
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, num_beams=1, eos_token_id=list(self.stop_ids),
                                  pad_token_id=self.stop_ids[0] if self.stop_ids else 0, **self.generate_kwargs)
        rows.append(out[0, ids.shape[1]:].tolist())
        traces.append(trace_counts(self._forwards, len(prompt), len(rows[-1])))
    seconds = time.perf_counter() - start
    self._forwards = None  # HF peers share the model: each records only during its own calls
    return output(self.tokenizer, self.stop_ids, rows, traces, seconds, self.gamma, threads=self.threads)


def hf_draft_dir(draft: str, model: specjax.Model) -> str:
  """An HF Llama directory for the assistant: `draft` itself, or a specjax distilled draft ("<target>-draft",
  a .safetensors checkpoint) exported to a temporary directory (removed at exit). An HF Llama has no truncated
  draft vocabulary: the exported draft scores every token with the target's head, where specjax's scores V'."""
  draft = str(draft)
  if draft.endswith(".safetensors") or draft.lower().endswith("-draft"):
    from specjax import export
    from specjax.drafters import draft_model
    drafter = specjax.make_drafter("draft_model", model, draft=draft)
    path = tempfile.mkdtemp(prefix="hf-draft-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    export.save_hf(draft_model.as_model(model, drafter), path)
    logging.info("hf_assisted: exported the draft %s to %s", draft, path)
    return path
  if not os.path.isfile(os.path.join(draft, "config.json")):
    raise FileNotFoundError(
        f"hf_assisted: no HF draft model directory at {draft!r} (no config.json). Export one with `python -m "
        "experiments.train --config=configs/train_draft.py` (it writes workdirs/train/draft4/smollm2-135m-draft), "
        "or pass the method option draft=<HF Llama directory, 'smollm2-135m-draft' or a draft .safetensors>")
  return draft


def make_hf(name: str, model: specjax.Model, path: str, stop_ids, gamma: int, threads: int = 0,
            **options) -> HFPeer:
  _import_torch()
  if name == "hf_autoregressive":
    allowed, kwargs, draft_gamma = {}, {}, None
  elif name == "hf_prompt_lookup":
    allowed = {"prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": 3}  # specjax: ngram sizes 3, 2, 1
    kwargs, draft_gamma = {**allowed, **options}, gamma
  else:
    allowed = {"draft": None, "num_assistant_tokens": gamma, "num_assistant_tokens_schedule": "constant",
               "assistant_confidence_threshold": 0.0}
    kwargs, draft_gamma = {**allowed, **options}, gamma
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    raise TypeError(f"peer {name} takes options {sorted(allowed) + ['threads']}, got {unknown}")
  if name == "hf_assisted":
    if kwargs["draft"] is None:
      raise ValueError("hf_assisted needs options draft=<HF Llama directory, 'smollm2-135m-draft' or a .safetensors>")
    # Not the shared copy: the target's forward hooks must not see the assistant's forwards.
    assistant = hf_model.__wrapped__(hf_draft_dir(kwargs.pop("draft"), model))
    for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
      setattr(assistant.generation_config, key, kwargs.pop(key))  # HF reads these from the assistant's config
    kwargs = {"assistant_model": assistant}
    draft_gamma = int(assistant.generation_config.num_assistant_tokens)
  return HFPeer(name, path, model.tokenizer, stop_ids, draft_gamma, kwargs, threads=threads)


# ------------------------------------------------------------------------------------------------ llama.cpp


_LLAMACPP_THREADS: dict[str, int] = {}
SAME_THREADS = -1  # llama.cpp's n_threads option: as many threads as specjax's programs run on (`specjax_threads`)


def specjax_threads() -> int:
  """The threads specjax's CPU programs run on: XLA's CPU client sizes its thread pool (the CPU kernels' too) to the
  cores this process may use."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


class LlamaCppPeer:
  """llama-cpp-python's `Llama.generate` (greedy sampler) on the GGUF, with a trace of its `eval` calls."""

  def __init__(self, name: str, path: str, tokenizer, stop_ids: Sequence[int], draft, gamma: int | None,
               n_threads: int, n_ctx: int):
    import llama_cpp
    self.name, self.tokenizer, self.stop_ids, self.gamma, self.n_ctx = name, tokenizer, tuple(stop_ids), gamma, n_ctx
    # With a draft, llama.cpp keeps the logits of every position, but llama-cpp-python sizes that buffer from the
    # `logits_all` argument (n_batch rows unless it is set), so a prompt longer than n_batch overflowed it.
    self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, draft_model=draft, logits_all=draft is not None,
                               verbose=False)
    self._forwards: list[Forward] = []
    evaluate = self.llm.eval

    def traced_eval(tokens):
      self._forwards.append(Forward(past=self.llm.n_tokens, inputs=len(tokens)))
      return evaluate(tokens)
    self.llm.eval = traced_eval
    self.n_threads = 0
    if not n_threads:  # the faster of 1 and all, found once per model file
      if path not in _LLAMACPP_THREADS:
        _LLAMACPP_THREADS[path] = self._probe_threads()
      n_threads = _LLAMACPP_THREADS[path]
    self.n_threads = n_threads
    llama_cpp.llama_set_n_threads(self.llm.ctx, n_threads, n_threads)

  def _probe_threads(self) -> int:
    """The faster of 1 and all CPU threads for 8 greedy tokens after a 16-token prompt (llama.cpp's threads
    spin-wait at barriers too, so on a busy machine fewer can be much faster)."""
    import llama_cpp
    times = {}
    for threads in dict.fromkeys((1, os.cpu_count() or 1)):
      llama_cpp.llama_set_n_threads(self.llm.ctx, threads, threads)
      for _ in range(2):  # the first call allocates
        times[threads] = self.generate([list(range(100, 116))], max_new_tokens=8).stats["seconds"]
    best = min(times, key=times.get)
    logging.info("threads for llama.cpp peers: %d (8 tokens: %s)", best,
                 ", ".join(f"{n} threads {t:.2f} s" for n, t in times.items()))
    return best

  def info(self) -> dict[str, Any]:
    """The llama.cpp build this peer decodes with: its version and the CPU features it was compiled for."""
    import llama_cpp
    return {"library": f"llama-cpp-python {llama_cpp.__version__}", "threads": self.n_threads,
            "system_info": llama_cpp.llama_print_system_info().decode().strip()}

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Output:
    rows, traces, seconds = self.decode(prompts, max_new_tokens)
    return output(self.tokenizer, self.stop_ids, rows, traces, seconds, self.gamma, threads=self.n_threads)

  def decode(self, prompts: Sequence[Sequence[int]], max_new_tokens: int
             ) -> tuple[list[list[int]], list[dict[str, int]], float]:
    """Each prompt's new tokens, its trace counts (`trace_counts`) and the seconds all of them took."""
    rows, traces = [], []
    start = time.perf_counter()
    for prompt in prompts:
      if len(prompt) + max_new_tokens > self.n_ctx:
        raise ValueError(f"{self.name}: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceed the "
                         f"llama.cpp context n_ctx={self.n_ctx}; raise the method option n_ctx")
      self.llm.reset()  # no KV reuse across calls: every call prefills its whole prompt, as the others do
      self._forwards = []
      row = []
      for token in self.llm.generate(list(prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        row.append(int(token))
        if token in self.stop_ids or len(row) == max_new_tokens:
          break
      rows.append(row)
      traces.append(trace_counts(self._forwards, len(prompt), len(row)))
    return rows, traces, time.perf_counter() - start


LLAMACPP_MAKER = "experiments.peers:llamacpp_in_process"  # what builds a llama.cpp peer in its own process


def _llamacpp_options(name: str, gamma: int) -> dict[str, Any]:
  return {"num_pred_tokens": gamma, "max_ngram_size": 3} if name == "llamacpp_prompt_lookup" else {}


def llamacpp_installed() -> bool:
  """Whether llama-cpp-python is installed (found, not imported: its code runs in the peer's process only)."""
  return importlib.util.find_spec("llama_cpp") is not None


def make_llamacpp(name: str, model: specjax.Model, path: str, stop_ids, gamma: int, n_threads: int = 0,
                  n_ctx: int = 4096, **options) -> SubprocessPeer:
  """A llama.cpp peer in a process of its own (`llamacpp_in_process` builds it there)."""
  if not llamacpp_installed():
    raise Unavailable(f"llama-cpp-python is not installed; {LLAMACPP_INSTALL} (it compiles llama.cpp, minutes)")
  allowed = _llamacpp_options(name, gamma)
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    raise TypeError(f"peer {name} takes options {sorted(allowed) + ['n_ctx', 'n_threads']}, got {unknown}")
  if not path.endswith(".gguf"):
    raise ValueError(f"llama.cpp peers read a .gguf file; the config's model is {path}")
  draft_gamma = int({**allowed, **options}["num_pred_tokens"]) if allowed else None
  n_threads = specjax_threads() if int(n_threads) == SAME_THREADS else int(n_threads)
  if n_threads < 0:
    raise ValueError(f"peer {name}: n_threads is 0 (the faster of 1 and all), a count, or {SAME_THREADS} (as "
                     f"specjax's programs: {specjax_threads()}), got {n_threads}")
  return SubprocessPeer(name, model.tokenizer, stop_ids, draft_gamma, LLAMACPP_MAKER,
                        dict(name=name, path=path, stop_ids=tuple(stop_ids), gamma=gamma, n_threads=int(n_threads),
                             n_ctx=int(n_ctx), options=options))


def llamacpp_in_process(name: str, path: str, stop_ids: Sequence[int], gamma: int, n_threads: int, n_ctx: int,
                        options: dict[str, Any]) -> LlamaCppPeer:
  """The llama.cpp peer itself (in `SubprocessPeer`'s process)."""
  try:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
  except ImportError as e:
    raise Unavailable(f"llama-cpp-python is not installed ({e}); {LLAMACPP_INSTALL} (it compiles llama.cpp, "
                      "minutes)") from e
  allowed = _llamacpp_options(name, gamma)
  draft, draft_gamma = None, None
  if allowed:
    kwargs = {**allowed, **options}
    draft = LlamaPromptLookupDecoding(**kwargs)
    draft_gamma = int(kwargs["num_pred_tokens"])
  return LlamaCppPeer(name, path, None, stop_ids, draft, draft_gamma, n_threads=n_threads, n_ctx=n_ctx)


# ------------------------------------------------------------------------------------- a peer in its own process


def _serve(connection, maker: str, kwargs: dict[str, Any]) -> None:
  """The child of `SubprocessPeer`: builds the peer with `maker` ("module:function") and answers decode requests
  until it gets None. Replies are (kind, payload): "ready" with the peer's info, "ok" with a decode's (rows, traces,
  seconds), "unavailable" or "error" with a reason."""
  module, function = maker.split(":")
  try:
    peer = getattr(importlib.import_module(module), function)(**kwargs)
    connection.send(("ready", peer.info()))
  except Unavailable as e:
    connection.send(("unavailable", str(e)))
    return
  except Exception as e:  # noqa: BLE001 - any failure to build it is the peer's, reported to the runner
    connection.send(("error", f"{type(e).__name__}: {e}"))
    return
  while (request := connection.recv()) is not None:
    try:
      connection.send(("ok", peer.decode(*request)))
    except Exception as e:  # noqa: BLE001
      connection.send(("error", f"{type(e).__name__}: {e}"))


class SubprocessPeer:
  """A peer decoding in a process of its own (multiprocessing, spawned): its `generate` sends the prompts there and
  builds the `Output` here from the rows, traces and seconds it gets back. A process that dies (a signal, an exit)
  raises `PeerFailed` naming how, from the constructor or from `generate`; so does an exception there."""

  def __init__(self, name: str, tokenizer, stop_ids: Sequence[int], gamma: int | None, maker: str,
               kwargs: dict[str, Any]):
    import multiprocessing
    self.name, self.tokenizer, self.stop_ids, self.gamma = name, tokenizer, tuple(stop_ids), gamma
    context = multiprocessing.get_context("spawn")  # not a fork of a process running XLA's threads
    self._connection, child = context.Pipe()
    self._process = context.Process(target=_serve, args=(child, maker, kwargs), daemon=True,
                                    name=f"specjax-peer-{name}")
    self._process.start()
    child.close()
    kind, payload = self._receive()
    if kind == "unavailable":
      self._process.join(10)
      raise Unavailable(payload)
    if kind != "ready":
      raise PeerFailed(f"{name} failed to start: {payload}")
    self.info = payload
    atexit.register(self.close)

  def _receive(self):
    try:
      return self._connection.recv()
    except (EOFError, ConnectionError):
      self._process.join(10)
      code = self._process.exitcode
      how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
             else f"exited with status {code}")
      raise PeerFailed(f"{self.name}: its process {how}") from None

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Output:
    try:
      self._connection.send(([list(map(int, p)) for p in prompts], int(max_new_tokens)))
    except (BrokenPipeError, ConnectionError, OSError):
      pass  # the process is gone: _receive says how
    kind, payload = self._receive()
    if kind != "ok":
      raise PeerFailed(f"{self.name}: {payload}")
    rows, traces, seconds = payload
    return output(self.tokenizer, self.stop_ids, rows, traces, seconds, self.gamma, threads=self.info.get("threads"))

  def close(self) -> None:
    if self._process.is_alive():
      try:
        self._connection.send(None)
      except (BrokenPipeError, ConnectionError, OSError):
        pass
      self._process.join(10)
      if self._process.is_alive():
        self._process.kill()


# ----------------------------------------------------------------------------------------------------- entry


def make(name: str, model: specjax.Model, model_path: str, *, gamma: int, temperature: float,
         stop_ids: Sequence[int] | None = None, **options):
  """The peer `name` decoding `model_path` (the file or directory `model` was loaded from) greedily.

  Raises Unavailable when its library is not installed, ValueError/TypeError for bad input.
  """
  makers: dict[str, Callable] = {**{n: make_hf for n in HF_PEERS}, **{n: make_llamacpp for n in LLAMACPP_PEERS}}
  if name not in makers:
    raise ValueError(f"unknown peer {name!r}; peers: {', '.join(PEERS)}")
  if temperature != 0:
    raise ValueError(f"peer {name} decodes greedily; the config has temperature {temperature} (set it to 0)")
  if stop_ids is None:
    stop_ids = model.tokenizer.stop_ids if model.tokenizer else ()
  return makers[name](name, model, resolve_path(model_path), tuple(sorted(int(t) for t in stop_ids)), int(gamma),
                      **options)



if __name__ == "__main__":  # python -m experiments.peers --cmake_args: LLAMACPP_INSTALL's build arguments
  from absl import app, flags
  flags.DEFINE_bool("cmake_args", False, "Print the CMAKE_ARGS that build llama.cpp for this CPU.")
  app.run(lambda argv: print(llamacpp_cmake_args()) if flags.FLAGS.cmake_args else None)
