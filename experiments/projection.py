r"""The accelerator projection: a drafter's speedup on a TPU, from the tokens its rounds commit as measured on this
CPU and what a round's programs cost there, from one of two costs files with the same `projections`:

  results/cost_model/results.json  the analytic cost model (experiments/cost_model.py: every program's bytes, FLOPs,
                                   collectives and products counted from the model's config, and validated against
                                   this CPU's and an H200's measured c and r), per model, topology and batch
  results/tpu_compile/results.json XLA's counts of the programs as compiled for the chips (experiments/compile_for.py):
                                   copies of the cache between memory spaces included, so they differ between
                                   topologies more than the programs do

In the compiled file, each program's time is the roofline bound (Williams et al. 2009) of XLA's count of it as
compiled for the chip, per device: t = max(bytes accessed / HBM bandwidth, flops / peak bf16 flops). In units of one
decode step of the target (a 1-token forward over the KV cache), a round of gamma drafts costs

  c = t(draft of gamma tokens) / gamma,   r = t(verification of gamma + 1 tokens),   u = t(the drafter's update),

and with tau the tokens a round commits (bonus included: Leviathan et al. 2023's E(alpha, gamma), here measured),

  projected speedup = tau / (gamma c + r + u),

and the round pays from tau = gamma c + r + u on (`break_even_tau`: the round's cost in decode steps).

A draft tree of N nodes, gamma deep (specjax/trees.py), costs its whole proposal (c: that over gamma), one
verification of [pending, its N nodes] under the tree mask with the accepted path's keys and values moved where a
chain's would be (r), and the drafter's update over the accepted path (u); its tau is the tokens a tree round
commits, measured by a run of configs/trees.py (`<method>_tree<N>`). Without such a run a tree's costs are known and
its tau is not: `speedup` projects it at a tau the caller supplies.

A costs file's `projections` give each drafter's costs at the gamma of the fixed-gamma runs its acceptance comes
from (`acceptance_of`: a method name in those runs, one row per method drafting with the drafter's round, e.g. a
shipped checkpoint's and one trained on the budget; a tree's: the name of its tree method, `<method>_tree<N>`), for
each model shape and topology (and, in the cost model's, batch). The experiments report and the published tables of
the CPU runs and trees project the methods of a run with the same name, gamma and tree size, at fixed gamma (an
adaptive round's length varies, so fixed-gamma costs do not describe it), from the compiled file, which has trees;
README's answer ranks the trained drafters with the cost model's (chains only).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

COSTS_FILE = "results/tpu_compile/results.json"  # relative to the checkout's root
MODELED_FILE = "results/cost_model/results.json"  # the analytic cost model's projections (experiments/cost_model.py)
BATCH = 8  # the batch the modeled projection of the README is read at (configs/compile_tpu.py's)
MODEL = "smollm2-135m"  # the model the CPU runs decode, as shaped for the TPU (bf16)
# The slice the 8B-shaped target is fitted to (configs/compile_tpu.py). Not a single chip: there XLA's count of a
# decode step includes copies of the cache between memory spaces that a verification's does not, so a verification
# would count as cheaper than a decode step (results/tpu_compile/results.md). Communication between chips is left
# out of XLA's counts, and so of the projection.
TOPOLOGY = "v5e:2x4"


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
         batch: int | None = None) -> dict[str, dict[str, Any]]:
  """{method: its round costs} from a costs file (a compile_for or cost_model results.json; a relative path: from the
  checkout's root), for `model` on `topology` (and, in a file that projects several, `batch` rows), keyed by the
  method of the acceptance each drafter takes (`acceptance_of`); "source" names the file, model and topology."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, path)) as f:
    compiled = json.load(f)
  where = f"{model}, {topology}" + ("" if batch is None else f", batch {batch}")
  found = {p["acceptance_of"]: {**round_costs(p["gamma"], p["decode_step_seconds"], p["draft_seconds"],
                                             p["verify_seconds"], p["update_seconds"]),
                                "tree_nodes": p.get("tree_nodes"), "source": f"{path} ({where})"}
           for p in compiled["projections"] if p["model"] == model and p["topology"] == topology
           and (batch is None or p.get("batch") == batch)}
  if not found:
    raise ValueError(f"{path} projects no drafter of {where}; it has "
                     f"{sorted({(p['model'], p['topology'], p.get('batch')) for p in compiled['projections']})}")
  return found


def files_of(paths: str | Sequence[str]) -> list[str]:
  """A config's acceptance file or files (configs/compile_tpu.py's `acceptance`) as a list."""
  return [paths] if isinstance(paths, str) else list(paths)


def project(method: dict[str, Any], costs: dict[str, dict[str, Any]], name: str) -> float | None:
  """The projected speedup of a run's method (its summary: gamma, tree_nodes, mean_accepted, adaptive) from `read`'s
  costs, or None where the costs file has no such method at its gamma and tree size or the method drafts
  adaptively."""
  cost = costs.get(name)
  if (cost is None or method.get("adaptive") or method.get("gamma") != cost["gamma"]
      or method.get("tree_nodes") != cost.get("tree_nodes") or method.get("mean_accepted") is None):
    return None
  return speedup(method["mean_accepted"], cost)
