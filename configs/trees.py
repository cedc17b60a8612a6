r"""Draft trees: every drafter as a chain and as trees of 7, 8, 16 and 32 nodes.

  python -m experiments.run --config=configs/trees.py:small    # 1 prompt x 13 categories, 64 tokens
  python -m experiments.run --config=configs/trees.py          # 5 prompts x 13 categories, 128 tokens
  python -m experiments.run --config=configs/trees.py:mtp      # the MTP drafters' chains and the CPU's tree (7 nodes)

A tree method (`<method>_tree<N>`) drafts a tree of N nodes, gamma 4 deep, every round (EAGLE-2's dynamic trees from
the model drafters, specjax/drafters/draft_tree.py; earlier matches as branches from prompt lookup; layer skip at
its best, the searched skip set and the trained exit) and verifies it in one target forward under a tree mask
(specjax/trees.py); its chain drafts gamma tokens every round (fixed rounds for both, `config.adaptive` False).
Greedy, so every method is checked token for token against autoregressive decoding. The table gives tokens per
target forward (mean accepted + 1), per-depth acceptance and paired speedups with intervals; costs (c, r) are
measured for the chains, and the accelerator projection (the cost model's) covers chains and trees. A tree of 7
nodes is verified over 8 rows, one pass of the CPU kernels' 8-row products (benchmarks/bench_verify.py: the cost
steps up past each multiple of 8 rows); 8 nodes take 9. `:small` compiles 31 programs per prompt-length bucket
(about 20 s each on 2 cores). `:mtp` (also with `small`: `:mtp,small`) times only the two MTP drafters, each as a
chain and as a tree of 7 nodes, on the full prompt set: whether the tree the CPU can afford beats the chain, with
enough pairs to tell.
"""

from configs import common

DRAFTERS = ("prompt_lookup", "layer_skip_best_set", "layer_skip_trained_exit", "mtp_parallel", "mtp_sequential",
            "draft_model")
TREE_NODES = (7, 8, 16, 32)
MTP = ("mtp_parallel", "mtp_sequential")
CPU_TREE = 7  # nodes: with the pending token one 8-row pass of the CPU kernels


def get_config(arg=None):
  variants = common.parse_variants(arg, "configs/trees.py", ("small", "mtp"))
  config = common.drafter_comparison(small="small" in variants, split="dev")  # fixed rounds
  drafters, sizes = (MTP, (CPU_TREE,)) if "mtp" in variants else (DRAFTERS, TREE_NODES)
  trees = tuple({**method, "name": f"{method['name']}_tree{nodes}", "tree_nodes": nodes}
                for method in common.methods(*drafters) for nodes in sizes)
  config.methods = common.methods("autoregressive", *drafters) + trees
  if "mtp" in variants:
    config.costs.enabled = False  # the chains' costs are the fixed-γ comparison's; this run is about paired speed
  return config
