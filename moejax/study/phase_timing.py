"""Per-phase wall-clock of one MoE layer forward, all from the layer's own compiled program.

The layer is timed as a whole (`moejax.study.repeats.timed`); one more run of the same program under the profiler
splits it (`moejax.study.profiled_phases`): its collectives over the 'node' axis (of a mesh of more than one node) are
inter-node, its other collectives intra-node (the exchanges and the small ones: the plans' size exchanges, the losses'
reductions), the experts' ops the expert FFN, the rest 'other' (routing, plans, permutations, the weighted combine).
Each phase is its share of that run times the layer's median, so the phases add up to the layer. Where the profile
fails (no profiler on the device) the phases are NaN, said in a warning, and the layer's time stands. Given terms
measured on the mesh (`moejax.study.program_calibration`), the same compiled program is also priced
(`moejax.cost.program_price.price_measured`): the prediction of the program that ran, held out.
"""

import logging
import statistics

import jax

from moejax.cost import program_price
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.study import profiled_phases
from moejax.study.repeats import Repeats, timed


def measure_phases(
  params: dict, x: jax.Array, cfg: MoEConfig, mesh, warmup: int, repeats: Repeats | int, terms=None
) -> dict:
  """Median milliseconds of the layer forward on x [T, d] (sharded over the mesh), timed `repeats` times, and its
  phases' shares of it (module docstring): {'layer_ms', 'layer_ms_min', 'layer_repeats', 'layer_inter_node_ms',
  'layer_intra_node_ms', 'layer_expert_ms', 'layer_other_ms'}; with `terms` also 'priced_layer_ms', the compiled
  program's price, split as the phases are ('priced_layer_collectives_ms' beside the two exchanges' phases,
  'priced_layer_compute_ms' beside the expert FFN's and the rest's)."""
  compiled = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh)).lower(params, x).compile()
  layer = timed(lambda: compiled(params, x), warmup, repeats, mesh)
  try:
    share = profiled_phases.shares(compiled, (params, x), mesh)
  except Exception as e:  # pylint: disable=broad-except  # no profiler here (a GPU without CUPTI): the time counts
    logging.warning("the layer's phases are not split (NaN): its profile failed: %s: %s", type(e).__name__, e)
    share = dict.fromkeys(profiled_phases.PHASES, float("nan"))
  layer_ms = 1e3 * statistics.median(layer)
  priced = {}
  if terms is not None:
    price = program_price_or_none(compiled, mesh, terms)
    split = (price.serial_s, price.communication_s, price.compute_s) if price else (float("nan"),) * 3
    names = ("priced_layer_ms", "priced_layer_collectives_ms", "priced_layer_compute_ms")
    priced = {name: 1e3 * seconds for name, seconds in zip(names, split)}
  return {
    "layer_ms": layer_ms,
    "layer_ms_min": 1e3 * min(layer),
    "layer_repeats": len(layer),
    **{f"layer_{phase}_ms": share[phase] * layer_ms for phase in profiled_phases.PHASES},
    **priced,
  }


def program_price_or_none(compiled, mesh, terms):
  """`program_price.price_measured(compiled, mesh, terms)`; None, said in a warning, where the program holds what the
  terms cannot price (a collective kind they did not time, a loop of unknown trips)."""
  try:
    return program_price.price_measured(compiled, mesh, terms)
  except ValueError as e:
    logging.warning("the program is not priced (NaN): %s", e)
    return None


def priced_seconds(compiled, mesh, terms) -> float:
  """`program_price_or_none`'s serial seconds; NaN where the program is not priced."""
  price = program_price_or_none(compiled, mesh, terms)
  return float("nan") if price is None else price.serial_s
