"""Per-device receive buffers of the MoE exchange at SMILE's sizes, worst case against bounded.

For each SMILE model of configs/mlm.py (16 nodes x 8 GPUs, 128 experts, one micro-batch of
sequences per GPU, top-1) and each transport, the rows and bytes of every hop's receive buffer
(`moejax.moe.path.hop_sizes`, the sizes the layer allocates; top-1, so one row per choice) with worst-case buffers
(`buffer_factor=None`) and with each bounded factor. One buffer of activations, forward only: the
expert FFN's hidden rows, the combine and the backward hold buffers of the same row count.

  python -m experiments.exchange_memory --out_json=/tmp/exchange_memory.json
"""

import json

from absl import app, flags

from configs import mlm
from moejax.moe import path as path_lib
from moejax.moe import transport as transport_lib
from moejax.runtime import mesh as mesh_lib

_FACTORS = flags.DEFINE_list("buffer_factors", ["1.25", "2.0"], "Bounded buffer factors to compare.")
_TRANSPORTS = flags.DEFINE_list("transports", ["ragged", "hierarchical", "bilevel"], "Transports.")
_NODES = flags.DEFINE_integer("nodes", 16, "Nodes of the mesh.")
_GPUS = flags.DEFINE_integer("gpus_per_node", 8, "GPUs per node.")
_OUT_JSON = flags.DEFINE_string("out_json", None, "Where to write the rows as JSON (optional).")

SEQ_LEN, TOP_K, BYTES = 128, 1, 2  # SMILE: sequences of 128 tokens, top-1 per level, bf16


def rows(nodes: int, gpus: int, factors: list[float], transports: list[str]) -> list[dict]:
  """One row per (model, transport, buffer factor): per-hop buffer rows and MiB on one device."""
  out = []
  for model, (_, d, _, _, per_gpu) in mlm.SIZES.items():
    local_rows = per_gpu * SEQ_LEN * TOP_K
    for transport in transports:
      hops = transport_lib.transport_hops(transport)
      for factor in [None, *factors]:
        sizes = [h.out_rows for h in path_lib.hop_sizes(hops, {mesh_lib.NODE: nodes, mesh_lib.GPU: gpus}, local_rows,
                                                        1, "ragged", transport_lib.buffer_bound(factor, local_rows))]
        out.append({"model": model, "d_model": d, "local_rows": local_rows, "transport": transport,
                    "buffer_factor": factor, "hop_rows": sizes,
                    "hop_mib": [r * d * BYTES / 2 ** 20 for r in sizes]})
  return out


def main(argv):
  del argv
  table = rows(_NODES.value, _GPUS.value, [float(f) for f in _FACTORS.value], _TRANSPORTS.value)
  print(f"receive buffer per hop and device, {_NODES.value} x {_GPUS.value} GPUs, bf16 (MiB)")
  print(f"{'model':<6} {'d':>5} {'rows/GPU':>9} {'transport':<13} {'factor':>6}  per-hop MiB")
  for r in table:
    factor = "worst" if r["buffer_factor"] is None else f"{r['buffer_factor']:g}"
    hops = " + ".join(f"{mib:,.0f}" for mib in r["hop_mib"])
    print(f"{r['model']:<6} {r['d_model']:>5} {r['local_rows']:>9,} {r['transport']:<13} {factor:>6}  {hops}")
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump(table, f, indent=1)
    print(f"wrote {_OUT_JSON.value}")


if __name__ == "__main__":
  app.run(main)
