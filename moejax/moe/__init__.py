"""The expert-parallel MoE layer and its parts, one job per module.

  config     `MoEConfig`: the one description of a layer, validated up front
  routing    router -> expert ids, combine weights, load-balance statistics
  plan       index math of one exchange hop: sort order, sizes, ragged offsets
  transport  moving rows to their experts' devices and back (ragged, padded, capacity; 1 or 2 hops)
  experts    grouped expert FFN backends (ragged_dot, dense, pallas)
  layer      `moe_apply` and `MoELayer`: the pieces composed inside `shard_map`
  reference  the single-device reference every scheme is compared with
"""
