"""Run with XLA_FLAGS dumping the SPMD-partitioned program into DUMP_DIR (argv[1]): compiles the gradient
of a 4-block GPT-MoE (2 MoE layers, padded exchange) on a simulated 2x4 mesh under grad_sync='default'
and 'prioritized', with its layers unrolled and scanned, and prints one JSON line: for each mode, unrolled, the
number of the partitioned program's all-reduces that precede each exchange (a call holding collective permutes);
scanned (one loop over the layers' backward), whether the loop carries into its next iteration's exchanges a value
computed after the iteration's all-reduces (the gradient passed to the layer below, released with the layer's
bucket); the largest difference between the two modes' gradients, and between the scanned and unrolled ones."""

import glob
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.models import layers
from moejax.models import state as state_lib
from moejax.models.config import ModelConfig
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from tests.hlo_graph import called_computations, contains, entry_graph


def _graph(lines: list[str]):
  """{name: (opcode, operands, called, tuple index of a get-tuple-element, is the root)}, {name: ancestors} of
  one computation's lines."""
  nodes = {}
  for line in lines:
    name, op, rest = re.match(r"(?:ROOT )?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) ([a-z\-]+)\((.*)", line).groups()
    called = called_computations(line)
    index = re.search(r"index=(\d+)", rest) if op == "get-tuple-element" else None
    nodes[name] = (
      op,
      [o for o in re.findall(r"%([\w.\-]+)", rest) if o not in called],
      called,
      int(index.group(1)) if index else None,
      line.startswith("ROOT"),
    )
  ancestors = {}
  for name in nodes:  # instructions are printed after their operands
    ancestors[name] = set().union(*([{o} | ancestors.get(o, set()) for o in nodes[name][1] if o in nodes] or [set()]))
  return nodes, ancestors


def carries_after_reduce(hlo: str) -> bool:
  """Whether the backward loop over the layers (the entry's last loop holding exchanges) carries into its
  exchanges a value its body computes after an all-reduce."""
  nodes, _, bodies = entry_graph(hlo)
  loops = [v[3] for v in nodes.values() if v[0] == "while"]
  body = [c for called in loops for c in called if contains(bodies, c, "collective-permute")][-1]
  graph, ancestors = _graph(bodies[body])
  parameters = {n for n, v in graph.items() if v[0] == "parameter"}
  element = {n: v[3] for n, v in graph.items() if v[0] == "get-tuple-element" and set(v[1]) <= parameters}
  exchanges = [n for n, v in graph.items() if any(contains(bodies, c, "collective-permute") for c in v[2])]
  into_exchanges = {element[a] for e in exchanges for a in ancestors[e] if a in element}
  reduces = {n for n, v in graph.items() if v[0] == "all-reduce"}
  (root,) = [v for v in graph.values() if v[4]]
  return any(i in into_exchanges and reduces & (ancestors[out] | {out}) for i, out in enumerate(root[1]))


def main(dump_dir):
  mesh_lib.simulate_cpu_devices(8)
  mesh = mesh_lib.make_mesh(2, 4)
  tokens = jax.random.randint(jax.random.key(3), (8, 16), 0, 96)
  moe = MoEConfig(num_experts=8, top_k=1, d_model=32, d_ff=64)
  out, grads = {}, {}
  for scan in (False, True):
    for mode in ("default", "prioritized"):
      cfg = ModelConfig(
        kind="gpt",
        vocab_size=96,
        num_layers=4,
        d_model=32,
        num_heads=4,
        d_ff=64,
        max_len=16,
        dropout=0.0,
        grad_sync=mode,
        scan_layers=scan,
      )
      graphdef, _, _ = state_lib.abstract_state(cfg, moe, mesh)
      params, rest = state_lib.init_state(cfg, moe, mesh)

      def loss(params, graphdef=graphdef, rest=rest):
        logits, aux = nnx.merge(graphdef, params, rest)(tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + aux["aux_loss"]

      before = set(glob.glob(f"{dump_dir}/*after_spmd-partitioning*"))
      g = jax.jit(jax.value_and_grad(loss)).lower(params).compile()(params)[1]
      grads[scan, mode] = jax.tree.leaves(
        (layers.per_layer(g, cfg), {k: v for k, v in g.items() if k not in ("blocks", "segments")})
      )
      (path,) = [p for p in set(glob.glob(f"{dump_dir}/*after_spmd-partitioning*")) - before if "jit_loss" in p]
      with open(path) as f:
        hlo = f.read()
      if scan:
        out[f"scanned_{mode}"] = carries_after_reduce(hlo)
        continue
      nodes, ancestors, bodies = entry_graph(hlo)
      all_reduces = [n for n, v in nodes.items() if v[0] == "all-reduce"]
      exchanges = [n for n, v in nodes.items() if any(contains(bodies, c, "collective-permute") for c in v[3])]
      out[mode] = [sum(a in ancestors[e] for a in all_reduces) for e in exchanges]
  difference = lambda a, b: max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))
  out["max_grad_difference"] = max(
    difference(grads[scan, "default"], grads[scan, "prioritized"]) for scan in (False, True)
  )
  out["scanned_relative_difference"] = max(
    float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / np.linalg.norm(np.asarray(y)))
    for x, y in zip(grads[True, "prioritized"], grads[False, "prioritized"])
  )
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
