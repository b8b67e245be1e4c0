"""Parm's schedules of an expert-sharded MoE layer and its Algorithm 1 (arXiv 2407.00599, Sec. IV-V).

Notation of the paper (Table I): B samples per GPU of L tokens, embedding M, expert hidden H, E experts,
top-k, capacity factor f, capacity T = k f B L / E, group sizes N_EP, N_ESP, N_MP. Every collective
costs alpha + beta x for x elements (Eq. 12); x is the per-device input of an all-to-all and the full
buffer of an all-gather / all-reduce. With BLM = B L M and ETM = E T M = k f B L M, forward only:

  baseline (Eq. 1)   t_B  = AG_ESP(BLM N_ESP) + AR_ESP(ETM N_ESP) + 2 A2A_EP(ETM N_ESP)
  S1       (Eq. 13)  t_D1 = 2 A2A_EP&ESP(y') + AG_MP(BLM)
  S2       (Eq. 7)   t_D2 = A2A_EP&ESP(y') + Overlap(y'),   y' = ETM N_ESP / N_MP

Readings taken where the paper disagrees with itself:
  (a) T = k f B L / E (Sec. II-A), not Algorithm 1 line 2's k f B L M / E, whose y would hold M twice;
  (b) S1's all-to-alls move ETM N_ESP / N_MP (Eq. 13's first line), not ETM / N_MP (its second line);
  (c) Overlap(y') is the second all-to-all and the MP all-gather of the expert outputs (ETM) run together
      (SAA, Sec. III-D), priced alpha_o + beta_o y'; Eq. 14's extra AG_MP(ETM) would count the all-gather
      twice, and Algorithm 1 line 5's beta_o y (not y / N_MP) is read as y'.
`choose_schedule` is Algorithm 1 with these readings: S1 if t_D1 <= t_D2, else S2.

`alpha_beta_from_topology` derives each collective's alpha and beta from `collectives` on a topology
(exact: those models are affine in the bytes): ranks fill nodes in order, ESP and MP groups are blocks
of consecutive ranks (the paper's SAA code), EP groups take one rank of every ESP block. SAA's two
collectives run in one sequence of phases: their latencies add, their bytes share each link.

`layer_times` adds the expert compute the paper's model leaves out (its t_B, t_D1 and t_D2 are communication only): the baseline computes
every token N_MP times, 4 k f B L M H FLOPs per GPU (2 matmuls, H / N_ESP columns of E T N_ESP rows),
S1 and S2 a 1 / N_MP of that.
"""

import dataclasses
import json
import math
import os

import jax.numpy as jnp
import numpy as np

from moejax.cost import collectives
from moejax.cost import topology as topology_lib
from moejax.cost.topology import Topology
from moejax.moe import expert_sharding as sharding_lib
from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError, is_int, is_number, require

# The concrete ones of moejax.moe.config.ESP_SCHEDULES: baseline, s1, s2.
ESP_SCHEDULES = tuple(n for n, s in sharding_lib.SHARDINGS.items() if s.splits_d_ff and not s.needs_resolving)
COLLECTIVES = ("ag_esp", "ar_esp", "a2a_ep", "a2a_epesp", "ag_mp", "overlap")


@dataclasses.dataclass(frozen=True)
class AlphaBeta:
  """t(x) = alpha_s + beta_s x: seconds for x elements."""

  alpha_s: float
  beta_s: float

  def __post_init__(self):
    for name in ("alpha_s", "beta_s"):
      value = getattr(self, name)
      require(
        is_number(value) and math.isfinite(value) and value >= 0, f"AlphaBeta.{name}", value, "a finite number >= 0"
      )

  def __call__(self, elements: float) -> float:
    return self.alpha_s + self.beta_s * elements


@dataclasses.dataclass(frozen=True)
class ParmLayer:
  """One configured MoE layer of Parm's Table III (names as in its Table I)."""

  B: int
  L: int
  M: int
  H: int
  E: int
  k: int
  f: float
  n_ep: int
  n_esp: int
  n_mp: int

  def __post_init__(self):
    for name in ("B", "L", "M", "H", "E", "k", "n_ep", "n_esp", "n_mp"):
      require(is_int(getattr(self, name)), name, getattr(self, name), "a positive int")
    require(is_number(self.f) and self.f > 0, "f", self.f, "a capacity factor > 0")
    require(self.E % self.n_ep == 0, "E", self.E, f"a multiple of n_ep={self.n_ep} (experts over the EP group)")

  @property
  def blm(self) -> float:
    """Elements of a GPU's layer input B x L x M."""
    return float(self.B * self.L * self.M)

  @property
  def etm(self) -> float:
    """Elements of its dispatched tensor E x T x M, T = k f B L / E (reading (a))."""
    return self.k * self.f * self.B * self.L * self.M

  @property
  def y_fused(self) -> float:
    """y' = ETM N_ESP / N_MP: per-device input of each EP&ESP all-to-all of S1 and S2."""
    return self.etm * self.n_esp / self.n_mp

  @property
  def baseline_flops(self) -> float:
    return 4 * self.etm * self.H


def collective_calls(layer: ParmLayer) -> dict[str, list[tuple[str, float, int]]]:
  """Each schedule's forward collectives as (collective, elements x, calls): Eq. 1, 13 and 7 with the readings above."""
  y = layer.y_fused
  return {
    "baseline": [
      ("ag_esp", layer.blm * layer.n_esp, 1),
      ("ar_esp", layer.etm * layer.n_esp, 1),
      ("a2a_ep", layer.etm * layer.n_esp, 2),
    ],
    "s1": [("a2a_epesp", y, 2), ("ag_mp", layer.blm, 1)],
    "s2": [("a2a_epesp", y, 1), ("overlap", y, 1)],
  }


def communication_times(layer: ParmLayer, ab: dict[str, AlphaBeta]) -> dict[str, float]:
  """Seconds of each schedule's forward collectives."""
  missing = sorted(set(COLLECTIVES) - set(ab))
  require(not missing, "alpha_beta", sorted(ab), f"alpha-beta terms of all of {COLLECTIVES} (missing {missing})")
  return {s: sum(calls * ab[name](x) for name, x, calls in plan) for s, plan in collective_calls(layer).items()}


def choose_schedule(layer: ParmLayer, ab: dict[str, AlphaBeta]) -> str:
  """Parm's Algorithm 1: 's1' if t_D1 <= t_D2 else 's2'."""
  times = communication_times(layer, ab)
  return "s1" if times["s1"] <= times["s2"] else "s2"


def layer_times(layer: ParmLayer, ab: dict[str, AlphaBeta], rate: float) -> dict[str, float]:
  """Seconds of each schedule's forward: its collectives plus its expert FLOPs at `rate` FLOP/s."""
  require(is_number(rate) and rate > 0, "rate", rate, "FLOP/s > 0")
  comm = communication_times(layer, ab)
  # Each GPU computes 1 / N_MP of the baseline's rows, except where it gathers the node's tokens (the baseline).
  split = {s: layer.n_mp / sharding_lib.SHARDINGS[s].gathered(layer.n_mp) for s in ESP_SCHEDULES}
  return {s: comm[s] + layer.baseline_flops / rate / split[s] for s in ESP_SCHEDULES}


def _blocks(size: int, block: int, stride: int = 1) -> np.ndarray:
  """[size, size] bool: ranks r, q share a group of `block` ranks spaced `stride` apart."""
  r = np.arange(size)
  key = (r // (block * stride)) * stride + r % stride
  return key[:, None] == key[None, :]


def _ring(kind: str, buffer_bytes: float, group: int, m: int, topology: Topology) -> collectives.ExchangeCost:
  nodes, gpus = (1, group) if group <= m else (group // m, m)
  return collectives.ring(kind, buffer_bytes, nodes, gpus, topology, concurrent=m // gpus if nodes > 1 else 1)


def _affine(cost) -> AlphaBeta:
  """alpha and beta of a collective priced affinely in its elements by `cost(elements)`."""
  alpha, at_unit = cost(0.0), cost(1e9)
  return AlphaBeta(alpha, (at_unit - alpha) / 1e9)


def alpha_beta_from_topology(
  topology: Topology, n_ep: int, n_esp: int, n_mp: int, bytes_per_element: float
) -> dict[str, AlphaBeta]:
  """The six collectives' alpha-beta terms on `topology` for P = n_ep x n_esp ranks (placement above)."""
  for name, value in (("n_ep", n_ep), ("n_esp", n_esp), ("n_mp", n_mp)):
    require(is_int(value), name, value, "a positive int")
  size, m = n_ep * n_esp, int(topology["gpus_per_node"])
  require(size % n_mp == 0, "n_mp", n_mp, f"a divisor of P = n_ep x n_esp = {size}")
  for name, group in (("n_esp", n_esp), ("n_mp", n_mp)):
    require(m % group == 0 or group % m == 0, name, group, f"a divisor or a multiple of {m} GPUs per node")
  m_mesh = min(m, size)
  require(size % m_mesh == 0, "n_ep", n_ep, f"n_ep x n_esp a multiple of {m_mesh} GPUs per node")

  def a2a(group_AxA, elements):
    per_peer = elements * bytes_per_element / group_AxA[0].sum()
    return collectives.all_to_all(group_AxA * per_peer, group_AxA, m_mesh, topology)

  ep, fused = _blocks(size, n_ep, n_esp), np.ones((size, size), bool)

  def saa(y):
    a, g = a2a(fused, y), _ring("all_gather", y * n_mp / n_esp * bytes_per_element, n_mp, m, topology)
    bandwidth = max(
      (a.nic_bytes + g.nic_bytes) / topology["nic_bw"], (a.intra_bytes + g.intra_bytes) / topology["intra_bw"]
    )
    return a.launch_s + a.latency_s + g.latency_s + bandwidth

  ring = lambda kind, group: lambda x: _ring(kind, x * bytes_per_element, group, m, topology).time_s  # noqa: E731
  return {
    "ag_esp": _affine(ring("all_gather", n_esp)),
    "ar_esp": _affine(ring("all_reduce", n_esp)),
    "a2a_ep": _affine(lambda x: a2a(ep, x).time_s),
    "a2a_epesp": _affine(lambda x: a2a(fused, x).time_s),
    "ag_mp": _affine(ring("all_gather", n_mp)),
    "overlap": _affine(saa),
  }


# experiments/bench_collectives.py variant -> (Parm collectives, bytes sent to other devices per byte of x
# given G the group size): all-to-all (G - 1) / G, ring all-gather (G - 1) / G of its output, ring all-reduce
# 2 (G - 1) / G.
_BENCH = {
  "flat": (("a2a_epesp",), "all", 1),
  "node_a2a": (("a2a_ep",), "node", 1),
  "gpu_all_gather": (("ag_esp", "ag_mp"), "gpu", 1),
  "gpu_all_reduce": (("ar_esp",), "gpu", 2),
}


def alpha_beta_from_bench(record: dict, bytes_per_element: float) -> dict[str, AlphaBeta]:
  """Parm's terms from an experiments/bench_collectives.py record on an n x m mesh (EP = 'node', ESP = MP = 'gpu',
  so the layer must have n_ep = n, n_esp = n_mp = m). Its fits are t = latency + bytes sent / bandwidth; x is
  converted with the ring / pairwise factors above. Overlap (SAA) is taken as the all-to-all and the MP all-gather
  run one after the other (AAS), which Parm measures as within about 1% of SAA (Sec. III-D)."""
  n, m = record["mesh"]
  sizes = {"all": n * m, "node": n, "gpu": m}
  missing = sorted(set(_BENCH) - set(record["fits"]))
  require(not missing, "record['fits']", sorted(record["fits"]), f"fits of all of {sorted(_BENCH)} (missing {missing})")
  terms = {}
  for variant, (names, axis, factor) in _BENCH.items():
    fit = record["fits"][variant]
    group = sizes[axis]
    require(fit["physical"], f"fits.{variant}", fit["latency_s"], "a fit with latency >= 0 and a finite bandwidth")
    beta = bytes_per_element * factor * (group - 1) / group / fit["bandwidth"]
    terms.update({name: AlphaBeta(fit["latency_s"], beta) for name in names})
  # the all-gather's x is N_MP / N_ESP = 1 times the all-to-all's y'
  terms["overlap"] = AlphaBeta(
    terms["a2a_epesp"].alpha_s + terms["ag_mp"].alpha_s, terms["a2a_epesp"].beta_s + terms["ag_mp"].beta_s
  )
  return terms


def resolve_auto(cfg: MoEConfig, tokens: int, nodes: int, gpus_per_node: int) -> MoEConfig:
  """cfg with esp_schedule='auto' replaced by the schedule Parm's Algorithm 1 picks
  (`choose_schedule`) for `tokens` global tokens per layer call: EP = n nodes, ESP = MP = m GPUs, B x L = a
  node's tokens, alpha-beta terms from cfg.esp_cost. Call it when the config is made (the trainer does): the
  layer refuses 'auto'. Other configs come back unchanged."""
  if not cfg.sharding_kind.needs_resolving:
    return cfg
  n, m = nodes, gpus_per_node
  bytes_per_element = jnp.dtype(cfg.dtype).itemsize
  if os.path.exists(cfg.esp_cost):
    with open(cfg.esp_cost) as f:
      terms = alpha_beta_from_bench(json.load(f), bytes_per_element)
  else:
    try:
      preset = topology_lib.get(cfg.esp_cost)
    except ValueError as e:  # names the known presets
      raise ConfigError(
        f"esp_cost={cfg.esp_cost!r} is neither a file nor a topology preset: {e}", "esp_cost", cfg.esp_cost
      ) from e
    terms = alpha_beta_from_topology(preset, n, m, m, bytes_per_element)
  layer_shape = ParmLayer(
    B=max(tokens // n, 1),
    L=1,
    M=cfg.d_model,
    H=cfg.d_ff,
    E=cfg.num_experts,
    k=cfg.choices_per_token,
    f=cfg.capacity_factor or 1.0,
    n_ep=n,
    n_esp=m,
    n_mp=m,
  )
  return dataclasses.replace(cfg, esp_schedule=choose_schedule(layer_shape, terms))
