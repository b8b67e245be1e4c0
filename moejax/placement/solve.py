"""ExFlow's placement ILP (Eqs. 8-12) in aggregated form, solved top-down in two stages.

Per stage the experts of every layer are split into P equal parts (nodes, then the GPUs of a node):
  minimise   sum_j sum_{a,b} C[j, a, b] * R[j, a, b]
  subject to sum_e x[j, e, p] = E / P   (9)      sum_p x[j, e, p] = 1   (10)
             R[j, a, b] >= +-(x[j, a, p] - x[j+1, b, p])   for every p   (11, 12)
with x binary and R in [0, 1] (integral at the optimum). The paper writes R per token k with the
same index i at both layers; tokens enter only through their expert pair (a, b), so summing them into
counts C gives the same optimum with E^2 (L-1) R variables (ExFlow §IV-D, Eqs. 8-12). Stage 1 splits over nodes;
stage 2 splits each node's stage-1 experts over its GPUs (independent per node), so the staging is
the paper's heuristic decomposition, not a joint optimum of both objectives.

With one expert per part (P = E) a placement is a permutation per layer and the objective depends
only on consecutive relative permutations, so the stage splits exactly into L-1 linear assignments.
Otherwise a layer-at-a-time local search (each step an exact assignment) gives the incumbent that
HiGHS must beat, and per-layer-pair b-matching LPs add a lower bound to HiGHS's for the gap.

The node routings fix which experts share a node (`moejax.placement.apply`), so only whole nodes may
move: stage 1 becomes the same ILP over the nodes' summed counts with one part per node's experts,
i.e. the exact assignment, and stage 2 is unchanged ('bilevel': once, on all nodes' summed counts,
since every node must get the same GPU layout).
"""

import dataclasses
import math
import time

import numpy as np
from scipy import optimize, sparse

from moejax.moe.routing import ROUTERS
from moejax.placement import affinity
from moejax.validation import require


@dataclasses.dataclass(frozen=True)
class Placement:
  """placement [L, E]: flat device (node * gpus_per_node + gpu) of expert e of MoE layer j.

  transitions: all counted transitions. cross_node, cross_gpu: those the placement sends across
  nodes / across devices (cross_gpu includes cross_node); identity_*: the same for expert e on device
  e // (E / D). node_bound: a proven lower bound on cross_node; node_gap = (cross_node - node_bound)
  / cross_node (0 when optimal). gpu_bound, gpu_gap: the same for the intra-node cross-GPU transitions
  (cross_gpu - cross_node) given the stage-1 node sets. methods: how each stage was solved
  ('assignment': exact; 'milp': local search then HiGHS; 'search': local search alone, when it met
  the pair bound or time_limit_s <= 0; 'trivial': one part; stage 2 joins its nodes' with '+').
  routing: the bounds and gaps are over the placements that keep this routing's outputs.
  """

  placement: np.ndarray
  nodes: int
  gpus_per_node: int
  transitions: int
  cross_node: int
  cross_gpu: int
  identity_cross_node: int
  identity_cross_gpu: int
  node_bound: int
  node_gap: float
  gpu_bound: int
  gpu_gap: float
  methods: tuple[str, str]
  seconds: float  # wall time of both stages
  routing: str = "topk"  # the routing whose output-preserving placements were searched (see `solve`)

  @property
  def optimal(self) -> bool:
    """Both stages proven optimal (the staged objective, not a joint one)."""
    return self.node_gap == 0 and self.gpu_gap == 0


def _assignment(counts):
  """One expert per part: layer j+1's expert matched to layer j's a is the one sharing a's part."""
  part = np.empty((counts.shape[0] + 1, counts.shape[1]), np.int64)
  part[0] = np.arange(counts.shape[1])
  for j, c in enumerate(counts):
    rows, cols = optimize.linear_sum_assignment(c, maximize=True)
    part[j + 1, cols] = part[j, rows]
  return part


def _descend(counts, part, parts, forward_only=False):
  """Local search: re-places one layer at a time, optimally given its neighbours' parts (a linear
  assignment of its experts to the parts' E / P slots each), until no layer improves. forward_only:
  one pass placing layer j+1 given layer j alone (a starting point)."""
  part, layers = part.copy(), counts.shape[0] + 1
  slots = np.repeat(np.arange(parts), counts.shape[1] // parts)
  improved = True
  while improved:
    improved = False
    for j in range(1 if forward_only else 0, layers):
      stay = np.zeros((counts.shape[1], parts))  # [E, P]: transitions kept inside part p if e goes there
      if j > 0:
        stay += counts[j - 1].T @ np.eye(parts)[part[j - 1]]
      if j < layers - 1 and not forward_only:
        stay += counts[j] @ np.eye(parts)[part[j + 1]]
      _, cols = optimize.linear_sum_assignment(stay[:, slots], maximize=True)
      gain = stay[np.arange(len(cols)), slots[cols]].sum() - stay[np.arange(len(cols)), part[j]].sum()
      if forward_only or gain > 0:  # strict gains only, so the search ends
        part[j], improved = slots[cols], not forward_only
  return part


def _milp(counts, parts, time_limit_s, mip_rel_gap, cutoff):
  """(part [L, E] or None, lower bound) of the stage's ILP restricted to objectives <= cutoff; the
  bound is cutoff + 1 when HiGHS proves no such placement exists."""
  layers, num, cap = counts.shape[0] + 1, counts.shape[1], counts.shape[1] // parts
  x = lambda j, e, p: (j * num + e) * parts + p
  js, As, Bs = np.nonzero(counts)
  weights, pairs, nx = counts[js, As, Bs].astype(float), js.size, layers * num * parts
  r = nx + np.arange(pairs)
  j, e, p = np.meshgrid(np.arange(layers), np.arange(num), np.arange(parts), indexing="ij")
  rows9 = (j * parts + p).ravel()  # (9): row per (layer, part)
  rows10 = layers * parts + (j * num + e).ravel()  # (10): row per (layer, expert)
  base = layers * (parts + num)
  # (11) and (12): row base + s * pairs * parts + pair * parts + p for sign s; then the cutoff row.
  pair, pp = np.repeat(np.arange(pairs), parts), np.tile(np.arange(parts), pairs)
  xa, xb = x(js[pair], As[pair], pp), x(js[pair] + 1, Bs[pair], pp)
  link = [base + s * pairs * parts + pair * parts + pp for s in (0, 1)]
  cut = base + 2 * pairs * parts
  rows = np.concatenate([rows9, rows10, *[np.concatenate([lr, lr, lr]) for lr in link], np.full(pairs, cut)])
  cols = np.concatenate([x(j, e, p).ravel()] * 2 + [np.concatenate([r[pair], xa, xb])] * 2 + [r])
  vals = np.concatenate(
    [np.ones(2 * nx), np.repeat([1.0, -1.0, 1.0], pair.size), np.repeat([1.0, 1.0, -1.0], pair.size), weights]
  )
  matrix, links = sparse.csr_array((vals, (rows, cols)), shape=(cut + 1, nx + pairs)), 2 * pairs * parts
  lower = np.concatenate([np.full(layers * parts, cap), np.ones(layers * num), np.zeros(links), [-np.inf]])
  upper = np.concatenate([np.full(layers * parts, cap), np.ones(layers * num), np.full(links, np.inf), [cutoff]])

  # Parts are interchangeable: relabel them in order of first use by layer 0's experts, so expert e
  # of layer 0 needs a part <= e. Cuts the symmetric copies of every solution from the search.
  ub = np.ones(nx + pairs)
  ub[:nx].reshape(layers, num, parts)[0] = np.arange(parts)[None, :] <= np.arange(num)[:, None]
  res = optimize.milp(
    np.concatenate([np.zeros(nx), weights]),
    integrality=np.r_[np.ones(nx), np.zeros(pairs)],
    bounds=optimize.Bounds(np.zeros(nx + pairs), ub),
    constraints=optimize.LinearConstraint(matrix, lower, upper),
    options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False},
  )
  if res.status == 2:  # infeasible: nothing beats the cutoff
    return None, cutoff + 1
  dual = getattr(res, "mip_dual_bound", None)
  bound = 0 if dual is None or not np.isfinite(dual) else max(0, math.ceil(dual - 1e-6))  # integer objective
  if res.x is None:
    return None, bound
  return np.argmax(np.round(res.x[:nx]).reshape(layers, num, parts), axis=-1), bound


def _pair_bound(counts, parts):
  """A lower bound on the stage's crossings: layer pairs apart, each layer-j expert shares its part
  with only E / P experts of layer j+1 and vice versa, so at most a maximum b-matching of counts[j]
  (an integral LP) stays inside parts."""
  num, cap = counts.shape[1], counts.shape[1] // parts
  eye, ones = sparse.eye_array(num), sparse.csr_array(np.ones((1, num)))
  degree = sparse.vstack([sparse.kron(eye, ones), sparse.kron(ones, eye)])  # row and column sums of y [E, E]
  kept = [-optimize.linprog(-c.ravel(), A_ub=degree, b_ub=np.full(2 * num, cap), bounds=(0, 1)).fun for c in counts]
  return int(counts.sum()) - sum(math.floor(k + 1e-6) for k in kept)


def _stage(counts, parts, time_limit_s, mip_rel_gap):
  """Splits every layer's experts into `parts` equal parts -> (part [L, E], objective, bound, method)."""
  contiguous = affinity.identity_placement(counts.shape[0] + 1, counts.shape[1], parts)
  if parts == 1:
    return contiguous, 0, 0, "trivial"
  if parts == counts.shape[1]:
    part = _assignment(counts)
    objective = affinity.crossings(counts, part)
    return part, objective, objective, "assignment"
  starts = [contiguous, _descend(counts, contiguous, parts, forward_only=True)]  # the search's incumbent
  part = min((_descend(counts, s, parts) for s in starts), key=lambda s: affinity.crossings(counts, s))
  objective, bound = affinity.crossings(counts, part), _pair_bound(counts, parts)
  if objective <= bound or time_limit_s <= 0:
    return part, objective, min(bound, objective), "search"
  found, milp_bound = _milp(counts, parts, time_limit_s, mip_rel_gap, cutoff=objective - 1)
  if found is not None:
    part = _descend(counts, found, parts)
  objective = affinity.crossings(counts, part)
  return part, objective, min(max(bound, milp_bound), objective), "milp"


def _node_stage(counts, nodes: int, chooses_nodes: bool, time_limit_s, mip_rel_gap):
  """Stage 1: every layer's experts over the nodes -> (node [L, E], cross-node transitions, bound, method). Where
  the routing chooses nodes, only whole routing nodes move: the stage runs on their summed counts [L-1, n, n]."""
  if not chooses_nodes:
    return _stage(counts, nodes, time_limit_s, mip_rel_gap)
  layers, num = counts.shape[0] + 1, counts.shape[1]
  per_node = num // nodes  # routing node g = experts g * per_node .. (g + 1) * per_node - 1
  between = counts.reshape(layers - 1, nodes, per_node, nodes, per_node).sum((2, 4))  # [L-1, n, n]
  node_of_group, cross_node, node_bound, node_method = _stage(between, nodes, time_limit_s, mip_rel_gap)
  return np.repeat(node_of_group, per_node, axis=1), cross_node, node_bound, node_method


def _gpu_stages(counts, node_of, nodes: int, gpus_per_node: int, shared: bool, time_limit_s, mip_rel_gap):
  """Stage 2 -> (members [n][L] (each node's E / n experts per layer), stages (one per node, or one shared by
  all: each (gpu [L, E / n], crossings, bound, method)))."""
  layers = counts.shape[0] + 1
  members = [[np.flatnonzero(row == node) for row in node_of] for node in range(nodes)]  # [n][L]: E / n experts
  local = [np.stack([counts[j][np.ix_(m[j], m[j + 1])] for j in range(layers - 1)]) for m in members]
  # bilevel: a node's experts in index order are its local experts 0 .. E / n - 1 (whole nodes moved), so
  # one layout for all nodes crosses sum_node crossings(local[node]) = crossings(sum(local)).
  stages = [_stage(c, gpus_per_node, time_limit_s, mip_rel_gap) for c in ([sum(local)] if shared else local)]
  return members, stages


def _device_of(members, stages, gpus_per_node: int, shared: bool, num: int) -> np.ndarray:
  """[L, E] flat device of every layer's experts: its node's index, then its GPU within the node."""
  placement = np.empty((len(members[0]), num), np.int64)
  for node in range(len(members)):
    gpu_of = stages[0 if shared else node][0]
    for j in range(len(members[node])):
      placement[j, members[node][j]] = node * gpus_per_node + gpu_of[j]
  return placement


def _gap(objective, bound) -> float:
  """The relative gap of an objective over its lower bound (0 where it meets it)."""
  return 0.0 if objective <= bound else (objective - bound) / objective


def solve(
  counts, nodes: int, gpus_per_node: int, time_limit_s: float = 60.0, mip_rel_gap: float = 1e-4, routing: str = "topk"
) -> Placement:
  """counts [M-1, E, E] (`affinity_counts`) -> Placement for a nodes x gpus_per_node mesh.

  Stage 1 minimises cross-node transitions; stage 2, per node, the cross-GPU transitions among the
  node's own experts. time_limit_s: wall-time limit of each MILP (stage 1, and stage 2 per node);
  on reaching it the best placement found is kept and its gap reported; <= 0 skips the MILP.
  mip_rel_gap: HiGHS stops below this relative gap (with integer counts, below 1 / objective is optimal).
  routing: the layers' routing, which limits the placements that keep their outputs (`apply_placement`).
  'topk': any balanced placement. 'node_limited' and 'bilevel' (nodes = the routing's num_nodes): every
  node's E / n experts stay together, so stage 1 only permutes whole nodes per layer (one part per
  node's experts: the exact assignment on the nodes' summed counts). 'bilevel' also shares one local
  router among the nodes, so stage 2 gives every node the same GPU layout (one stage on the nodes'
  summed counts instead of one per node). Bounds and gaps are over the placements the routing allows.
  """
  start = time.perf_counter()
  require(routing in ROUTERS, "routing", routing, f"one of {tuple(ROUTERS)}")
  router = ROUTERS[routing]
  counts = affinity.check_counts(counts, nodes, gpus_per_node)
  layers, num = counts.shape[0] + 1, counts.shape[1]
  node_of, cross_node, node_bound, node_method = _node_stage(
    counts, nodes, router.chooses_nodes, time_limit_s, mip_rel_gap
  )
  shared = router.shares_local_router
  members, stages = _gpu_stages(counts, node_of, nodes, gpus_per_node, shared, time_limit_s, mip_rel_gap)
  placement = _device_of(members, stages, gpus_per_node, shared, num)
  intra, intra_bound = sum(s[1] for s in stages), sum(s[2] for s in stages)

  identity = affinity.transitions(
    counts, affinity.identity_placement(layers, num, nodes * gpus_per_node), gpus_per_node
  )
  return Placement(
    placement=placement,
    nodes=nodes,
    gpus_per_node=gpus_per_node,
    transitions=int(counts.sum()),
    cross_node=cross_node,
    cross_gpu=cross_node + intra,
    identity_cross_node=identity[0],
    identity_cross_gpu=identity[1],
    node_bound=node_bound,
    node_gap=_gap(cross_node, node_bound),
    gpu_bound=intra_bound,
    gpu_gap=_gap(intra, intra_bound),
    methods=(node_method, "+".join(sorted({s[3] for s in stages}))),
    seconds=time.perf_counter() - start,
    routing=routing,
  )
