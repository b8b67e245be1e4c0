"""Parm's expert-sharding schemes ('esp_baseline', 's1', 's2') in a sweep point (`moejax.study.price`): priced from the
config by `cost.parm`, without a small run."""

from moejax.cost import model as cost_model
from moejax.cost import parm
from moejax.moe import expert_sharding as sharding_lib
from moejax.study import points
from moejax.study.points import ESP_SCHEMES, Point

INTER_NODE = ("a2a_ep", "a2a_epesp", "overlap")  # Parm's collectives that cross nodes (`cost.parm.COLLECTIVES`)


def esp_layer(point: Point, config, cfg) -> parm.ParmLayer:
  """The point's layer in Parm's notation: B x L tokens per GPU, N_EP = nodes, N_ESP = N_MP = GPUs per node."""
  model = config.models[point.model]
  return parm.ParmLayer(
    B=model.micro_batch,
    L=model.seq_len,
    M=model.d_model,
    H=model.d_ff,
    E=cfg.num_experts,
    k=cfg.top_k,
    f=cfg.capacity_factor,
    n_ep=point.nodes,
    n_esp=point.gpus_per_node,
    n_mp=point.gpus_per_node,
  )


def esp_breakdowns(
  cfg, point: Point, config, bytes_per_element, other_flops, non_expert_s: float, rate: tuple[float, str]
) -> dict:
  """Parm's schedules (`cost.parm`): their collectives' alpha-beta terms on the topology, the expert FLOPs of
  the rows each GPU computes (every token N_MP times in the baseline). The backward is priced as the forward's
  collectives once more (reversed) and twice its FLOPs; Parm models the forward only. rate: (FLOP/s, source)."""
  n, m = point.nodes, point.gpus_per_node
  cluster, (rate, rate_source) = points.topology(config), rate
  layer, schedule = esp_layer(point, config, cfg), ESP_SCHEMES[point.scheme]
  terms = parm.alpha_beta_from_topology(cluster, n, m, m, bytes_per_element)
  seconds = {True: 0.0, False: 0.0}  # by whether the collective crosses nodes
  for name, x, calls in parm.collective_calls(layer)[schedule]:
    seconds[n > 1 and name in INTER_NODE] += calls * terms[name](x)
  inter, intra = seconds[True], seconds[False]
  # Each GPU computes 1 / N_MP of the node's rows, or all of them where it gathers the node's tokens (the baseline).
  rows = layer.etm / layer.M * layer.n_esp / (layer.n_mp / sharding_lib.SHARDINGS[schedule].gathered(layer.n_mp))
  flops = float(cost_model.expert_flops(rows, layer.M, layer.H / layer.n_esp, cfg.gated))
  out = {"esp_choice": parm.choose_schedule(layer, terms)}
  for name, passes in (("forward", 1), ("train", 2)):
    out[name] = cost_model.Breakdown(
      inter_node_a2a_s=passes * inter,
      intra_node_a2a_s=passes * intra,
      expert_compute_s=(2 * passes - 1) * flops / rate,
      other_s=(2 * passes - 1) * (other_flops / rate + non_expert_s),
      hops=(),
      device_rate=rate,
      rate_source=rate_source,
      topology=cluster.name,
    )
  return out
