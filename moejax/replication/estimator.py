"""Lina's expert-popularity estimator (Lina, ATC'23, Sec. 5.2) and the two-phase replication it drives.

Profiling (on routing traces of the trained model): for each target MoE layer j >= l, group tokens by
their sample path, the experts they chose at the l layers j-l .. j-1 (the first choice of each), and
keep per path the expected rows per token at layer j, psi [P_j, E] (sums to K, the choices per
token), cut to its top_k experts: Lina keeps only a path's top-k (k=1 in inference) as the
popularity it schedules for. A path never seen in profiling falls back to layer j's marginal (Lina
leaves this open). With l=3 scheduling starts at the fourth layer, as in Lina Sec. 7.1.

Online, for a batch: estimated load [E] of layer j = sum over its tokens of psi[path(t)] (Eq. 1 up
to the factor N / N_t, which no slot table depends on). Phase 1 plans slots from the estimate
(`rebalance`, in place of Lina's first-fit-decreasing packing) before the gate runs; phase 2, after
the gate, keeps that plan when the sets of the 2k most loaded experts of estimate and true load are
equal, else re-plans on the true load (Lina Sec. 5.2: "comparing the overall top-2k experts"; whether
the lists are compared as ordered lists or sets is not stated, sets here). Estimation accuracy is that
same test (Lina Sec. 7.3.2 uses the phase-2 definition).

Traces: [M, T] or [M, T, K] int expert ids (`moejax.placement.affinity` layout), tokens in batch order.
"""

import dataclasses

import numpy as np

from moejax.replication import rebalance as rebalance_lib
from moejax.validation import ConfigError, is_int, require

POLICIES = ("no_replication", "moving_average", "lina_phase1", "lina_phase2", "oracle")


def check_traces(traces, num_experts: int) -> np.ndarray:
  """traces as int64 [M, T, K], or ConfigError naming the bad shape, dtype or id."""
  require(is_int(num_experts), "num_experts", num_experts, "a positive int")
  ids = np.asarray(traces)
  require(ids.ndim in (2, 3) and ids.size > 0, "traces.shape", ids.shape, "[M, T] or [M, T, K] with T, K >= 1")
  require(np.issubdtype(ids.dtype, np.integer), "traces.dtype", ids.dtype, "integer expert ids")
  if ids.min() < 0 or ids.max() >= num_experts:
    raise ConfigError(
      f"traces holds expert ids in [{ids.min()}, {ids.max()}], outside [0, {num_experts})",
      "traces",
      (int(ids.min()), int(ids.max())),
      f"ids in [0, {num_experts})",
    )
  return ids.reshape(ids.shape[0], ids.shape[1], -1).astype(np.int64)


def true_loads(traces, num_experts: int) -> np.ndarray:
  """[M, E] float64: rows each expert receives at each layer (every one of a token's K choices is a row)."""
  ids = check_traces(traces, num_experts)
  return np.stack([np.bincount(layer.ravel(), minlength=num_experts) for layer in ids]).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class PathTables:
  """Profiled distributions of target layers first_layer .. M-1 (index i holds layer first_layer + i).

  paths[i]: sorted path ids [P] seen in profiling (mixed radix: sum_s expert(j-l+s) * E^s);
  psi[i]: [P, E] expected rows per token at the layer for each path, cut to its top_k experts;
  marginal[i]: [E] the layer's rows per token over all profiled tokens (unseen paths).
  """

  num_experts: int
  path_length: int
  top_k: int
  paths: tuple[np.ndarray, ...]
  psi: tuple[np.ndarray, ...]
  marginal: tuple[np.ndarray, ...]

  @property
  def first_layer(self) -> int:
    return self.path_length


def path_ids(ids_MxTxK: np.ndarray, layer: int, path_length: int, num_experts: int) -> np.ndarray:
  """[T] int64: each token's path into `layer`, its first choices at layers layer-l .. layer-1."""
  radix = num_experts ** np.arange(path_length, dtype=np.int64)
  return ids_MxTxK[layer - path_length : layer, :, 0].T @ radix


def keep_top(rows: np.ndarray, top_k: int) -> np.ndarray:
  """rows [paths, E] with all but each row's top_k largest entries zeroed (ties to the lower expert id)."""
  order = np.argsort(-rows, axis=1, kind="stable")[:, :top_k]
  kept = np.zeros_like(rows)
  np.put_along_axis(kept, order, np.take_along_axis(rows, order, axis=1), axis=1)
  return kept


def profile(traces, num_experts: int, path_length: int = 3, top_k: int | None = None) -> PathTables:
  """Tables from profiling traces [M, T(, K)]; top_k (default K) experts kept per path, l = path_length."""
  ids = check_traces(traces, num_experts)
  layers, _, choices = ids.shape
  require(
    is_int(path_length) and path_length < layers,
    "path_length",
    path_length,
    f"an int in [1, L) with L={layers} MoE layers",
  )
  require(
    num_experts**path_length < 2**62,
    "path_length",
    path_length,
    f"small enough that E^l fits in int64 (E={num_experts})",
  )
  top_k = choices if top_k is None else top_k
  require(is_int(top_k) and top_k <= num_experts, "top_k", top_k, f"an int in [1, E={num_experts}]")
  paths, psi, marginal = [], [], []
  for layer in range(path_length, layers):
    unique, token_path = np.unique(path_ids(ids, layer, path_length, num_experts), return_inverse=True)
    rows = np.zeros((unique.size, num_experts))
    np.add.at(rows, (np.repeat(token_path, choices), ids[layer].ravel()), 1.0)
    tokens = np.bincount(token_path, minlength=unique.size)
    paths.append(unique)
    psi.append(keep_top(rows / tokens[:, None], top_k))
    marginal.append(rows.sum(0) / tokens.sum())
  return PathTables(num_experts, path_length, top_k, tuple(paths), tuple(psi), tuple(marginal))


def estimate_loads(tables: PathTables, traces) -> np.ndarray:
  """[M - l, E] float64: estimated rows per expert of layers l .. M-1 for the tokens of traces (one batch)."""
  ids = check_traces(traces, tables.num_experts)
  require(
    ids.shape[0] == tables.first_layer + len(tables.psi),
    "traces.shape",
    ids.shape,
    f"L={tables.first_layer + len(tables.psi)} MoE layers, as profiled",
  )
  out = []
  for i, layer in enumerate(range(tables.first_layer, ids.shape[0])):
    token_path = path_ids(ids, layer, tables.path_length, tables.num_experts)
    pos = np.minimum(np.searchsorted(tables.paths[i], token_path), tables.paths[i].size - 1)
    seen = tables.paths[i][pos] == token_path
    out.append(tables.psi[i][pos[seen]].sum(0) + (~seen).sum() * tables.marginal[i])
  return np.stack(out)


def moving_average(batch_loads, window: int) -> np.ndarray:
  """batch_loads [batches, E] -> [batches, E]: for batch b the mean load of batches max(0, b - window) .. b-1;
  uniform for b = 0 (no history)."""
  require(is_int(window), "window", window, "an int >= 1")
  loads = np.asarray(batch_loads, np.float64)
  sums = np.concatenate([np.zeros((1, loads.shape[1])), np.cumsum(loads, axis=0)])
  b = np.arange(loads.shape[0])
  start = np.maximum(b - window, 0)
  mean = (sums[b] - sums[start]) / np.maximum(b - start, 1)[:, None]
  mean[0] = 1.0
  return mean


def top_set(load_E, n: int) -> frozenset:
  """The n most loaded experts (ties to the lower id)."""
  return frozenset(np.argsort(-np.asarray(load_E, np.float64), kind="stable")[:n].tolist())


def same_top(estimate_E, true_E, n: int) -> bool:
  """Lina's phase-2 test and accuracy: the sets of the n (= 2k) most loaded experts agree."""
  return top_set(estimate_E, n) == top_set(true_E, n)


def l1_error(estimate_E, true_E) -> float:
  """sum_e |estimate share - true share| in [0, 2]: the popularity distributions' L1 distance."""
  est, true = np.asarray(estimate_E, np.float64), np.asarray(true_E, np.float64)
  return float(np.abs(est / est.sum() - true / true.sum()).sum())


def phase2(estimate_E, true_E, phase1_table, choices: int, plan) -> tuple[np.ndarray, bool]:
  """(slot table, re-planned): phase1_table if the top-2k sets of estimate and truth agree, else plan(true_E)."""
  if same_top(estimate_E, true_E, 2 * choices):
    return phase1_table, False
  return plan(true_E), True


def plan_batches(
  tables: PathTables, traces, batch_tokens: int, nodes: int, gpus_per_node: int, slots_per_device: int, window: int = 4
):
  """Slot tables of every policy for every (batch, target layer) of held-out traces [M, T(, K)].

  Batches are consecutive runs of batch_tokens tokens (a trailing partial batch is left out and counted).
  Returns (records, dropped_tokens): one dict per (batch, layer) with 'batch', 'layer', 'true' [E],
  'estimate' [E], 'moving_average' [E], 'tables' {policy: slot_expert}, 'accurate' (Lina's estimate),
  'accurate_moving_average', 'l1_lina', 'l1_moving_average', 'replanned'.
  """
  ids = check_traces(traces, tables.num_experts)
  require(
    is_int(batch_tokens) and batch_tokens <= ids.shape[1],
    "batch_tokens",
    batch_tokens,
    f"an int in [1, T={ids.shape[1]}]",
  )
  batches = ids.shape[1] // batch_tokens
  devices, choices = nodes * gpus_per_node, ids.shape[2]
  plain = rebalance_lib.identity_table(tables.num_experts, devices)

  def plan(load_E):
    return rebalance_lib.rebalance(load_E, nodes, gpus_per_node, slots_per_device)

  batch_ids = [ids[:, b * batch_tokens : (b + 1) * batch_tokens] for b in range(batches)]
  truth = np.stack([true_loads(x, tables.num_experts)[tables.first_layer :] for x in batch_ids])  # [B, L-l, E]
  records = []
  for b, batch in enumerate(batch_ids):
    estimates = estimate_loads(tables, batch)
    for i in range(truth.shape[1]):
      true, estimate = truth[b, i], estimates[i]
      average = moving_average(truth[: b + 1, i], window)[b]
      oracle, first = plan(true), plan(estimate)
      second, replanned = phase2(estimate, true, first, choices, lambda _: oracle)
      records.append(
        dict(
          batch=b,
          layer=tables.first_layer + i,
          true=true,
          estimate=estimate,
          moving_average=average,
          replanned=replanned,
          accurate=same_top(estimate, true, 2 * choices),
          l1_lina=l1_error(estimate, true),
          accurate_moving_average=same_top(average, true, 2 * choices),
          l1_moving_average=l1_error(average, true),
          tables=dict(
            no_replication=plain, moving_average=plan(average), lina_phase1=first, lina_phase2=second, oracle=oracle
          ),
        )
      )
  return records, ids.shape[1] - batches * batch_tokens
