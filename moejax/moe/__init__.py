"""The expert-parallel MoE layer and its parts, one job per module.

  config     `MoEConfig`: the one description of a layer, validated up front
  routing    router -> expert ids, combine weights, load-balance statistics
  plan       index math of one exchange hop: sort order, sizes, ragged offsets
  transport  moving rows to their experts' devices and back (ragged, padded, capacity; 1 or 2 hops)
  experts    grouped expert FFN backends (ragged_dot, dense, pallas, tokamax), whole or its two halves;
             the shared experts' dense FFN
  schedule   the order of exchanges and expert compute: sequential, chunked, comet (Comet)
  replicas   running on a replication slot table: rows to replicas, weights per slot (Lina, EPLB)
  expert_sharding  Parm: experts over 'node', d_ff over 'gpu'; what baseline / S1 / S2 route, send and sum
  overflow   `apply_without_overflow`: bounded buffers, re-run with a doubled factor while rows overflow
  params     the public parameter layout: shapes, shardings, initialisation
  layout     `Layout`: how one call spreads over the mesh; the checks of a call's inputs
  traffic    rows moved per hop between devices, split into inter- and intra-node
  layer      `moe_apply`: the one assembly of the stages inside `shard_map`
  module     `MoELayer`: the Flax nnx module holding the parameters and the layer's state
  reference  the single-device reference every scheme is compared with
"""
