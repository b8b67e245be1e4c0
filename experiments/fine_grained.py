"""Fine-grained experts: the layer forward from E = 8 to 256 at equal active parameters, phase by phase.

DeepSeekMoE's segmentation: E = 8 s experts of width f / s and k = 2 s choices (k at most 8, then f
stays), so every token runs k x f = const hidden units. Each point runs the real layer on a simulated
2 x 4 CPU mesh and times it with `moejax.study.phase_timing.measure_phases`: the whole forward, its
exchanges, the expert FFN and the rest (routing, plan, sorts, gathers, the combine).

  python -m experiments.fine_grained --out=fine_grained.json
"""

import json
import time

from absl import app, flags

from moejax.runtime import mesh as mesh_lib

_OUT = flags.DEFINE_string("out", "fine_grained.json", "where to write the JSON record")
_EXPERTS = flags.DEFINE_list("experts", ["8", "16", "32", "64", "128", "256"], "numbers of experts E")
_TOKENS = flags.DEFINE_integer("tokens_per_device", 256, "tokens each of the 8 devices routes")
_D_MODEL = flags.DEFINE_integer("d_model", 64, "model width d")
_ACTIVE = flags.DEFINE_integer("active_hidden", 512, "k x f: hidden units each token runs through")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed repetitions (median)")
_TRANSPORT = flags.DEFINE_string("transport", "padded", "moe.transport of every point")


def shape_of(num_experts: int, active_hidden: int) -> tuple[int, int]:
  """(k, f) of DeepSeekMoE's segmentation of 8 experts of top-2: k = 2 E / 8 up to 8, k f = active."""
  k = min(2 * num_experts // 8, 8)
  return k, active_hidden // k


def main(argv):
  del argv
  mesh_lib.simulate_cpu_devices(8)
  import jax

  from moejax.moe.config import MoEConfig
  from moejax.moe.params import init_params
  from moejax.study.phase_timing import measure_phases

  mesh = mesh_lib.make_mesh(2, 4)
  rows = []
  record = {"device": jax.devices()[0].device_kind, "mesh": [2, 4], "tokens_per_device": _TOKENS.value,
                      "d_model": _D_MODEL.value, "active_hidden": _ACTIVE.value, "transport": _TRANSPORT.value,
                      "date": time.strftime("%Y-%m-%d"), "points": rows}
  print(f"{'E':>4} {'k':>2} {'f':>4}  {'layer ms':>9} {'exchange':>9} {'experts':>9} {'other':>9}  other share")
  for num_experts in map(int, _EXPERTS.value):
    k, f = shape_of(num_experts, _ACTIVE.value)
    cfg = MoEConfig(num_experts=num_experts, top_k=k, d_model=_D_MODEL.value, d_ff=f, transport=_TRANSPORT.value,
                    gated=True, activation="silu")
    params = init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (8 * _TOKENS.value, _D_MODEL.value))
    phases = measure_phases(params, x, cfg, mesh, warmup=1, repeats=_REPEATS.value)
    exchange = phases["layer_inter_node_ms"] + phases["layer_intra_node_ms"]
    point = {"num_experts": num_experts, "top_k": k, "d_ff": f, **phases, "exchange_ms": exchange}
    rows.append(point)
    share = phases["layer_other_ms"] / phases["layer_ms"]
    print(f"{num_experts:>4} {k:>2} {f:>4}  {phases['layer_ms']:9.2f} {exchange:9.2f} {phases['layer_expert_ms']:9.2f} "
          f"{phases['layer_other_ms']:9.2f}  {share:6.1%}", flush=True)
  with open(_OUT.value, "w") as out:
    json.dump(record, out, indent=1)
  print(f"wrote {_OUT.value}; CPU times are ratios within one run (2-core machine, simulated devices)")


if __name__ == "__main__":
  app.run(main)
