"""Replication planner: which logical expert each physical slot holds, so that no device is busy.

A = nodes * gpus_per_node devices hold slots_per_device slots each; an expert's load (tokens) is split
evenly over its replicas; a device's load sums its slots. `rebalance` lowers the busiest one's load:
  1. Counts: one replica per expert; of the spare slots, `fillers` go to the least loaded experts
     (weighing almost nothing, they let a heavy expert sit nearly alone on a device, the optimum's
     shape on small cases), the rest by D'Hondt (each to the largest load per replica). SPLITS splits
     are tried, from all D'Hondt to all fillers. Counts are capped at A (a replica per device).
  2. Packing: replicas largest first (LPT), each onto the least loaded device with a free slot that
     lacks the expert, preferring a node that already holds it; dead ends are repaired by swaps.
  3. Steepest descent on (busiest load, sum of squared loads), over the moves that touch a busiest
     device: swap two replicas, or re-label a slot to another expert (which resizes both experts'
     replicas everywhere). The split with the lowest result wins.
  4. Two replicas of one expert on a device take a double share of its tokens, a split distinct
     replicas cannot give; a plan allowing it (no cap) is kept only if its busiest load is lower.
  5. Node locality at no cost: swaps across nodes that reduce the (expert, node) pairs, i.e. keep an
     expert's replicas in fewer nodes, without lifting any device above the busiest load.
No proven bound: the tests compare it with brute force on small sizes and with EPLB.
"""

import numpy as np

from moejax.validation import require

SPLITS = 9  # filler/D'Hondt splits tried: past 9 the busiest load barely moves, while time grows linearly


def check_size(field: str, value) -> int:
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1
  require(ok, field, value, "an int >= 1")
  return int(value)


def check_loads(load_E) -> np.ndarray:
  """load [E] as float64, or ConfigError: a non-empty 1-D array of finite, non-negative numbers."""
  load = np.asarray(load_E)
  require(
    load.ndim == 1 and load.size >= 1 and load.dtype.kind in "iuf",
    "load_E",
    f"shape {load.shape} dtype {load.dtype}",
    "a non-empty 1-D array of numbers [E]",
  )
  load = load.astype(np.float64)
  require(bool(np.all(np.isfinite(load))), "load_E", load, "finite loads")
  require(bool(np.all(load >= 0)), "load_E", f"min {load.min()}", "non-negative loads")
  return load


def check_inputs(load_E, nodes, gpus_per_node, slots_per_device):
  """(load [E], nodes, gpus_per_node, slots_per_device), validated; there must be a slot for every expert."""
  load, nodes, gpus = check_loads(load_E), check_size("nodes", nodes), check_size("gpus_per_node", gpus_per_node)
  slots, devices = check_size("slots_per_device", slots_per_device), nodes * gpus
  require(
    slots * devices >= load.size,
    "slots_per_device",
    slots,
    f">= ceil(E / A) = {-(-load.size // devices)}: a slot for each of E={load.size} experts on A={devices}",
  )
  return load, nodes, gpus, slots


def identity_table(num_experts: int, holders: int) -> np.ndarray:
  """slot_expert [A, E / A]: expert e on holder e // (E / A) only, the layout without replication."""
  require(num_experts % holders == 0, "num_experts", num_experts, f"a multiple of the A={holders} holders")
  return np.arange(num_experts).reshape(holders, num_experts // holders)


def device_loads(load_E, slot_expert) -> np.ndarray:
  """[A] float64: each expert's load split evenly over its replicas in slot_expert [A, slots], summed per device."""
  load = check_loads(load_E)
  slots = np.asarray(slot_expert)
  require(
    slots.ndim == 2 and slots.size >= 1 and slots.dtype.kind in "iu",
    "slot_expert",
    f"shape {slots.shape} dtype {slots.dtype}",
    "a non-empty 2-D int array [A, slots_per_device]",
  )
  require(
    slots.min() >= 0 and slots.max() < load.size,
    "slot_expert",
    f"ids {slots.min()}..{slots.max()}",
    f"expert ids in [0, {load.size})",
  )
  counts = np.bincount(slots.ravel(), minlength=load.size)
  require(
    bool(np.all(counts > 0)),
    "slot_expert",
    f"missing experts {np.flatnonzero(counts == 0).tolist()}",
    "every expert held at least once",
  )
  return (load / counts)[slots].sum(axis=1)


def max_load_ratio(load_E, slot_expert) -> float:
  """Busiest device's load over the mean (1.0 is perfect balance, and the value when nothing is loaded)."""
  loads = device_loads(load_E, slot_expert)
  return float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0


def replica_counts(load_E: np.ndarray, slots: int, cap: int | None = None, fillers: int = 0) -> np.ndarray:
  """[E] replicas filling `slots`, each at most cap: one each, `fillers` to the least loaded, the rest by D'Hondt."""
  cap = cap or slots
  counts = np.ones(load_E.size, np.int64)
  for e in np.argsort(load_E, kind="stable"):
    extra = min(fillers, cap - 1, slots - counts.sum())
    counts[e], fillers = counts[e] + extra, fillers - extra
  for _ in range(slots - counts.sum()):
    counts[np.argmax(np.where(counts < cap, load_E / counts, -1.0))] += 1
  return counts


def _pack(load, counts, gpus, slots, distinct):
  """placed [E, A] replicas per device by LPT (see step 2), then duplicates swapped away if distinct."""
  per_replica = load / counts
  placed = np.zeros((load.size, counts.sum() // slots), np.int64)
  for e in np.argsort(-per_replica, kind="stable"):
    for _ in range(counts[e]):
      free = placed.sum(0) < slots
      ok = free & (placed[e] == 0) if distinct and np.any(free & (placed[e] == 0)) else free
      local = np.repeat(placed[e].reshape(-1, gpus).any(1), gpus)
      d = np.flatnonzero(ok)
      placed[e, d[np.lexsort((d, ~local[d], (per_replica @ placed)[d]))[0]]] += 1
  while distinct and np.any(placed > 1):  # every device is full: some o lacks e and holds an f that d lacks
    e, d = np.argwhere(placed > 1)[0]
    loads = per_replica @ placed
    shift = per_replica[e] - per_replica
    _, o, f = min(
      (max(loads[d] - shift[f], loads[o] + shift[f]), o, f)
      for o in np.flatnonzero(placed[e] == 0)
      for f in np.flatnonzero((placed[:, o] > 0) & (placed[:, d] == 0))
    )
    _swap(placed, e, d, f, o)
  return placed


def _swap(placed, e, d, f, o):
  """One replica of e moves from device d to o, one of f from o to d."""
  np.add.at(placed, ([e, e, f, f], [d, o, o, d]), [-1, 1, -1, 1])


def _descend(load, placed, cap, distinct, tol):
  """Step 3 in place, until no swap or re-label touching a busiest device lowers (busiest, sum of squares)."""
  while True:
    counts = placed.sum(1)
    per_replica = load / counts
    loads = per_replica @ placed
    busiest, squares = loads.max(), np.square(loads).sum()
    busy = loads >= busiest - tol
    dev, exp = np.nonzero(placed.T)  # occupied (device, expert) pairs, each standing for one replica
    i, j = (g.ravel() for g in np.meshgrid(np.flatnonzero(busy[dev]), np.arange(dev.size), indexing="ij"))
    ok = (dev[i] != dev[j]) & (exp[i] != exp[j])  # swaps: exp[i] on busiest dev[i] <-> exp[j] on dev[j]
    ok &= (not distinct) | ((placed[exp[i], dev[j]] == 0) & (placed[exp[j], dev[i]] == 0))
    i, j = i[ok], j[ok]
    delta = per_replica[exp[j]] - per_replica[exp[i]]
    swapped = np.repeat(loads[None], i.size, 0)
    swapped[np.arange(i.size), dev[i]] += delta
    swapped[np.arange(i.size), dev[j]] -= delta
    k, b = (g.ravel() for g in np.meshgrid(np.arange(dev.size), np.arange(load.size), indexing="ij"))
    a, x = exp[k], dev[k]  # re-labels: the replica of a on x becomes one of b; x or a holder of b is busiest
    ok = (a != b) & (counts[a] >= 2) & (counts[b] < cap) & (busy[x] | (placed[:, busy].sum(1) > 0)[b])
    ok &= (not distinct) | (placed[b, x] == 0)
    a, b, x = a[ok], b[ok], x[ok]
    fewer, more = load[a] / np.maximum(counts[a] - 1, 1), load[b] / (counts[b] + 1)
    relabelled = loads + placed[a] * (fewer - per_replica[a])[:, None] + placed[b] * (more - per_replica[b])[:, None]
    relabelled[np.arange(a.size), x] += more - fewer
    new = np.concatenate([swapped, relabelled])
    if not new.size:
      return
    worst = np.where(np.abs(new.max(1) - busiest) <= tol, busiest, new.max(1))  # rounding is a tie
    sq = np.square(new).sum(1)
    best = np.lexsort((sq, worst))[0]
    if not (worst[best] < busiest or (worst[best] == busiest and sq[best] < squares - tol * busiest)):
      return
    if best < i.size:
      _swap(placed, exp[i[best]], dev[i[best]], exp[j[best]], dev[j[best]])
    else:
      np.add.at(placed, ([a[best - i.size], b[best - i.size]], x[best - i.size]), [-1, 1])


def _plan(load, devices, gpus, slots, distinct):
  """placed [E, A] by steps 1-3, with or without distinct experts per device: the best split after descent."""
  cap, tol = devices if distinct else devices * slots, 1e-12 * max(load.sum(), 1e-300)
  best = best_key = None
  for fillers in np.unique(np.linspace(0, devices * slots - load.size, SPLITS).round().astype(int)):
    placed = _pack(load, replica_counts(load, devices * slots, cap, fillers), gpus, slots, distinct)
    _descend(load, placed, cap, distinct, tol)
    loads = (load / placed.sum(1)) @ placed
    key = loads.max(), np.square(loads).sum()
    if best is None or key[0] < best_key[0] - tol or (key[0] <= best_key[0] + tol and key[1] < best_key[1]):
      best, best_key = placed, key
  return best


def _localise(load, placed, gpus):
  """Step 5: the cross-node swap that removes most (expert, node) pairs, never adding a duplicate."""
  nodes = placed.shape[1] // gpus
  while nodes > 1:
    per_replica = load / placed.sum(1)
    loads = per_replica @ placed
    in_node = placed.reshape(placed.shape[0], nodes, gpus).sum(2)
    dev, exp = np.nonzero(placed.T)
    i, j = np.triu_indices(dev.size, 1)
    di, dj, ei, ej = dev[i], dev[j], exp[i], exp[j]
    ni, nj, delta = di // gpus, dj // gpus, per_replica[ej] - per_replica[ei]
    gain = (in_node[ei, ni] == 1).astype(int) - (in_node[ei, nj] == 0) + (in_node[ej, nj] == 1) - (in_node[ej, ni] == 0)
    gain[(ni == nj) | (ei == ej) | (placed[ei, dj] > 0) | (placed[ej, di] > 0)] = 0
    gain[np.maximum(loads[di] + delta, loads[dj] - delta) > loads.max() * (1 + 1e-12)] = 0  # equal up to rounding
    if not gain.size or gain.max() <= 0:
      return
    m = np.argmax(gain)
    _swap(placed, ei[m], di[m], ej[m], dj[m])


def slot_table(placed: np.ndarray) -> np.ndarray:
  """[A, slots] expert ids, ascending on each device, from replica counts placed [E, A]."""
  return np.stack([np.repeat(np.arange(placed.shape[0]), placed[:, d]) for d in range(placed.shape[1])])


def rebalance(load_E, nodes, gpus_per_node, slots_per_device, duplicates: bool = True) -> np.ndarray:
  """slot_expert [A, slots_per_device] int64 for load [E] (steps in the module docstring). A device holds two
  replicas of one expert only where E < slots_per_device forces it, or with `duplicates` where strictly better."""
  load, nodes, gpus, slots = check_inputs(load_E, nodes, gpus_per_node, slots_per_device)
  devices, distinct = nodes * gpus, load.size >= slots
  placed = _plan(load, devices, gpus, slots, distinct)
  if distinct and duplicates:
    other = _plan(load, devices, gpus, slots, distinct=False)
    if ((load / other.sum(1)) @ other).max() < ((load / placed.sum(1)) @ placed).max() * (1 - 1e-9):
      placed = other
  _localise(load, placed, gpus)
  return slot_table(placed)
