"""One process of the multi-process check in tests/test_distributed.py (and its single-process reference).

  launch/local_multiprocess.sh -n 2 -d 2 -- python tests/distributed_worker.py OUT_DIR

Each process joins the run (`specjax.distributed.initialize`, from the SPECJAX_* environment), builds the
same tiny random model, runs a sharded greedy generate (autoregressive and layer-skip speculative) and two
sharded training steps on a global (data=2, model=2) mesh, and writes OUT_DIR/process_<i>.json.
`compute(mesh=None)` is the same computation on one device, unsharded: the reference.
"""

from __future__ import annotations

import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run as a script from anywhere

from specjax import distributed  # noqa: E402  (initialize() must come before any JAX computation)

GLOBAL_BATCH = 4
MAX_NEW_TOKENS = 8


def compute(mesh=None) -> dict:
  """Greedy tokens (autoregressive and speculative) and per-step training metrics, on `mesh` or unsharded."""
  import jax
  import numpy as np

  import specjax
  from specjax import sharding, train
  from specjax.config import ModelConfig
  from specjax.loading import Model
  from specjax.model import init_params

  config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, tie_embeddings=False)
  # Same seed on every process: identical parameters. std 0.2 spreads the logits so that argmax is not
  # decided by reduction-order rounding.
  model = Model(config, init_params(config, jax.random.PRNGKey(0), std=0.2), None, "tiny")
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(2, 14, size=GLOBAL_BATCH)]
  if mesh is not None:
    model = sharding.shard_model(model, mesh)
  result = {"tokens": specjax.generate(model, prompts, max_new_tokens=MAX_NEW_TOKENS, mesh=mesh).tokens}
  drafter = specjax.make_drafter("layer_skip", model, exit_layer=1)
  result["speculative_tokens"] = specjax.generate(model, prompts, max_new_tokens=MAX_NEW_TOKENS, mesh=mesh,
                                                  drafter=drafter, gamma=3).tokens

  optimizer = train.make_optimizer(1e-2, warmup_steps=1, total_steps=10, weight_decay=0.1)
  trainable, frozen = train.split_params(model.params, lambda path, _: path != "embed")
  state = train.init_train_state(trainable, optimizer, mesh)
  kwargs = {} if mesh is None else dict(state_sharding=sharding.sharding_of(state),
                                        frozen_sharding=sharding.sharding_of(frozen))
  step = train.make_train_step(train.lm_loss(config), optimizer, mesh, **kwargs)
  rows = slice(None) if mesh is None else distributed.process_batch_slice(GLOBAL_BATCH, mesh)
  result["rows"], result["losses"], result["grad_norms"] = [rows.start, rows.stop], [], []
  for i in range(2):
    batch = {"tokens": np.random.default_rng(100 + i).integers(0, 256, (GLOBAL_BATCH, 16)).astype(np.int32)}
    if mesh is not None:  # each process contributes only the rows its devices hold
      batch = distributed.make_global_batch({"tokens": batch["tokens"][rows]}, mesh, GLOBAL_BATCH)
    state, metrics = step(state, frozen, batch)
    metrics = distributed.to_host(metrics)
    result["losses"].append(float(metrics["loss"]))
    result["grad_norms"].append(float(metrics["grad_norm"]))
  wq = distributed.to_host(state.params["layers"][1]["wq"])
  result["wq_after"] = np.asarray(wq, np.float64).ravel()[:32].tolist()
  return result


def main(out_dir: str) -> None:
  how = distributed.initialize(initialization_timeout=60)
  import jax

  from specjax import sharding

  mesh = sharding.make_mesh(data=2, model=2)
  result = compute(mesh)
  result.update(how=how, process_index=jax.process_index(), process_count=jax.process_count(),
                local_devices=jax.local_device_count(), global_devices=jax.device_count(),
                is_main_process=distributed.is_main_process())
  distributed.barrier("distributed_worker_done")
  with open(os.path.join(out_dir, f"process_{jax.process_index()}.json"), "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(sys.argv[1])
