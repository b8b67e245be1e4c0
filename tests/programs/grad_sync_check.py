"""Run with XLA_FLAGS dumping the SPMD-partitioned program into DUMP_DIR (argv[1]): compiles the gradient
of a 4-block GPT-MoE (2 MoE layers, padded exchange) on a simulated 2x4 mesh under grad_sync='default'
and 'prioritized', and prints one JSON line: for each mode, the number of the partitioned program's
all-reduces that precede each exchange (a call holding collective permutes), and the largest
difference between the two modes' gradients."""

import glob
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.models import state as state_lib
from moejax.models.config import ModelConfig
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from tests.hlo_graph import contains, entry_graph


def main(dump_dir):
  mesh_lib.simulate_cpu_devices(8)
  mesh = mesh_lib.make_mesh(2, 4)
  tokens = jax.random.randint(jax.random.key(3), (8, 16), 0, 96)
  moe = MoEConfig(num_experts=8, top_k=1, d_model=32, d_ff=64)
  out, grads = {}, {}
  for mode in ("default", "prioritized"):
    cfg = ModelConfig(kind="gpt", vocab_size=96, num_layers=4, d_model=32, num_heads=4, d_ff=64,
                      max_len=16, dropout=0.0, grad_sync=mode)
    graphdef, _, _ = state_lib.abstract_state(cfg, moe, mesh)
    params, rest = state_lib.init_state(cfg, moe, mesh)

    def loss(params, graphdef=graphdef, rest=rest):
      logits, aux = nnx.merge(graphdef, params, rest)(tokens)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + aux["aux_loss"]

    before = set(glob.glob(f"{dump_dir}/*after_spmd-partitioning*"))
    grads[mode] = jax.jit(jax.value_and_grad(loss)).lower(params).compile()(params)[1]
    (path,) = [p for p in set(glob.glob(f"{dump_dir}/*after_spmd-partitioning*")) - before if "jit_loss" in p]
    with open(path) as f:
      nodes, ancestors, bodies = entry_graph(f.read())
    all_reduces = [n for n, v in nodes.items() if v[0] == "all-reduce"]
    exchanges = [n for n, v in nodes.items() if any(contains(bodies, c, "collective-permute") for c in v[3])]
    out[mode] = [sum(a in ancestors[e] for a in all_reduces) for e in exchanges]
  out["max_grad_difference"] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                                   for a, b in zip(jax.tree.leaves(grads["default"]), jax.tree.leaves(grads["prioritized"])))
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
