r"""The accelerator projection: a drafter's speedup on a TPU, from the tokens its rounds commit as measured on this
CPU and what a round's programs cost there, as the analytic cost model counts them (experiments/cost_model.py: every
program's bytes, FLOPs, collectives and products counted from the model's config and the mesh, timed with the chip's
published figures, and validated against this CPU's and an H200's measured costs), in results/cost_model/results.json
(`COSTS_FILE`), per model, topology and batch. XLA's counts of the programs as compiled for a TPU
(experiments/compile_for.py) count copies of the cache between memory spaces, which move a program's costs between
topologies more than the program itself does; they size the programs against a chip's HBM and project in that run's
own results.md only.

In units of one decode step of the target (a 1-token forward over the KV cache), a round of gamma drafts costs

  c = t(draft of gamma tokens) / gamma,   r = t(verification of gamma + 1 tokens),   u = t(the drafter's update),

and with tau the tokens a round commits (bonus included: Leviathan et al. 2023's E(alpha, gamma), here measured),

  projected speedup = tau / (gamma c + r + u),

and the round pays from tau = gamma c + r + u on (`break_even_tau`: the round's cost in decode steps).

A draft tree of N nodes, gamma deep (specjax/trees.py), costs its whole proposal (c: that over gamma), one
verification of [pending, its N nodes] under the tree mask with the accepted path's keys and values moved where a
chain's would be (r), and the drafter's update over the accepted path (u); its tau is the tokens a tree round
commits, measured by a run of configs/trees.py (`<method>_tree<N>`). Without such a run a tree's costs are known and
its tau is not: `speedup` projects it at a tau the caller supplies.

The costs file's `projections` give each drafter's costs at the gamma of the fixed-gamma runs its acceptance comes
from (`acceptance_of`: a method name in those runs, configs/compile_tpu.py's `acceptance`, one row per method
drafting with the drafter's round, e.g. a shipped checkpoint's and one trained on the budget; a tree's: the name of
its tree method, `<method>_tree<N>`, in `tree_acceptance`), for each model shape, topology and batch. The experiments
report, the published tables of the CPU runs and trees and README's answer project the methods of a run with the same
name, gamma and tree size, at fixed gamma (an adaptive round's length varies, so fixed-gamma costs do not describe
it), at `MODEL` on `TOPOLOGY` with `BATCH` rows.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COSTS_FILE = "results/cost_model/results.json"  # the analytic cost model's projections, relative to the checkout
MODEL = "smollm2-135m"  # the model the CPU runs decode, as shaped for the TPU (bf16)
# configs/compile_tpu.py's slice and batch: 8 rows over a (data 2, model 4) mesh of 8 v5e chips.
TOPOLOGY = "v5e:2x4"
BATCH = 8


def round_costs(gamma: int, decode_step: float, draft: float, verify: float, update: float) -> dict[str, float]:
  """c, r and u (the module docstring) from the programs' times in seconds."""
  return {"gamma": gamma, "draft_cost": draft / gamma / decode_step, "verify_cost": verify / decode_step,
          "update_cost": update / decode_step}


def break_even_tau(costs: dict[str, float]) -> float:
  """gamma c + r + u: a round's cost in decode steps, the tokens per target forward at which it breaks even."""
  return costs["gamma"] * costs["draft_cost"] + costs["verify_cost"] + costs["update_cost"]


def speedup(tau: float, costs: dict[str, float]) -> float:
  """tau / (gamma c + r + u)."""
  return tau / break_even_tau(costs)


def read(path: str = COSTS_FILE, model: str = MODEL, topology: str = TOPOLOGY,
         batch: int = BATCH) -> dict[str, dict[str, Any]]:
  """{method: its round costs} from the cost model's results.json (a relative path: from the checkout's root), for
  `model` on `topology` with `batch` rows, keyed by the method of the acceptance each drafter takes (`acceptance_of`),
  with its tree size (None: a chain); "source" names the file, model, topology and batch."""
  path = os.path.relpath(os.path.join(ROOT, path), ROOT)
  with open(os.path.join(ROOT, path)) as f:
    projected = json.load(f)["projections"]
  where = f"{model}, {topology}, batch {batch}"
  found = {p["acceptance_of"]: {**round_costs(p["gamma"], p["decode_step_seconds"], p["draft_seconds"],
                                             p["verify_seconds"], p["update_seconds"]),
                                "tree_nodes": p["tree_nodes"], "source": f"{path} ({where})"}
           for p in projected if (p["model"], p["topology"], p["batch"]) == (model, topology, batch)}
  if not found:
    raise ValueError(f"{path} projects no drafter of {where}; it has "
                     f"{sorted({(p['model'], p['topology'], p['batch']) for p in projected})}")
  return found


def files_of(paths: str | Sequence[str]) -> list[str]:
  """A config's acceptance file or files (configs/compile_tpu.py's `acceptance`) as a list."""
  return [paths] if isinstance(paths, str) else list(paths)


def measured_acceptance(paths: str | Sequence[str]) -> dict[str, dict[str, Any]]:
  """{method: {"gamma", "tau", "tree_nodes"}} from experiments/run.py results.json files (one path or several, a
  relative one from the checkout's root; a method in several files is taken from the first): tau = tokens per target
  forward (the round's accepted drafts and the target's own token), at the method's gamma (a tree's depth) and tree
  size (None: a chain)."""
  found = {}
  for path in reversed(files_of(paths)):
    with open(os.path.join(ROOT, path)) as f:
      methods = json.load(f)["summary"]["methods"]
    found.update((name, {"gamma": int(m["gamma"]), "tau": float(m["mean_accepted"]),
                         "tree_nodes": m.get("tree_nodes")})
                 for name, m in methods.items() if m.get("gamma") and m.get("mean_accepted") is not None)
  return found


def methods_of(recipe: dict) -> tuple[str, ...]:
  """The methods whose acceptance a drafter's round is projected at (its `acceptance_of`: one name or several, each
  a method of the acceptance files drafting with this drafter's round: e.g. a shipped checkpoint and one trained on
  the budget)."""
  names = recipe["acceptance_of"]
  return (names,) if isinstance(names, str) else tuple(names)


def tree_acceptance(path: str) -> dict[str, dict[str, Any]] | None:
  """The tree methods of `path` (`measured_acceptance`; a run of configs/trees.py), or None where there is no such
  file: trees are then projected by their round's cost and the tau at which they break even, with no speedup."""
  if not os.path.exists(os.path.join(ROOT, path)):
    return None
  return {name: m for name, m in measured_acceptance(path).items() if m["tree_nodes"]}


def tree_method(acceptance_of: str, tree_nodes: int) -> str:
  """The name of a drafter's tree method of `tree_nodes` nodes in a run of configs/trees.py."""
  return f"{acceptance_of}_tree{tree_nodes}"


def project(method: dict[str, Any], costs: dict[str, dict[str, Any]], name: str) -> float | None:
  """The projected speedup of a run's method (its summary: gamma, tree_nodes, mean_accepted, adaptive) from `read`'s
  costs, or None where the costs file has no such method at its gamma and tree size or the method drafts
  adaptively."""
  cost = costs.get(name)
  if (cost is None or method.get("adaptive") or method.get("gamma") != cost["gamma"]
      or method.get("tree_nodes") != cost.get("tree_nodes") or method.get("mean_accepted") is None):
    return None
  return speedup(method["mean_accepted"], cost)
