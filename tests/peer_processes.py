"""Peers that `experiments.peers.SubprocessPeer` builds in its process for the tests (it imports them by name there):
one whose library is missing, and one that answers and then dies as a llama.cpp built for another CPU does."""

from __future__ import annotations

import os
import signal

from experiments import peers


def not_installed(**kwargs):
  raise peers.Unavailable("llama-cpp-python is not installed (in the test's peer process)")


class Echo:
  """Answers each prompt with its last token, max_new_tokens times; its decode number `dies_at` kills its process
  with SIGILL (an illegal instruction) instead."""

  def __init__(self, dies_at: int | None):
    self.calls, self.dies_at = 0, dies_at

  def info(self):
    return {"library": "echo", "threads": 1}

  def decode(self, prompts, max_new_tokens):
    self.calls += 1
    if self.calls == self.dies_at:
      os.kill(os.getpid(), signal.SIGILL)
    rows = [[p[-1]] * max_new_tokens for p in prompts]
    traces = [peers.trace_counts([peers.Forward(0, len(p))] + [peers.Forward(len(p) + i, 1)
                                                               for i in range(max_new_tokens - 1)],
                                 len(p), max_new_tokens) for p in prompts]
    return rows, traces, 0.001


def echo(**kwargs):
  return Echo(dies_at=None)


def dies_on_third_decode(**kwargs):
  return Echo(dies_at=3)


def dies_at_start(**kwargs):
  os.kill(os.getpid(), signal.SIGILL)
