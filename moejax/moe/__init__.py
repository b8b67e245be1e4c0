"""The expert-parallel MoE layer and its parts, one job per module.

config     `MoEConfig`: the one description of a layer, validated up front: its fields' types, then each choice's
           object (router, path, collective, schedule, expert sharding, expert backend) checks it
fields     the checks of the plain fields: types, ranges and the rules between fields that no choice owns
routing    the routers (top-k, node-limited, SMILE's bi-level) behind one interface: expert ids, combine
           weights, load-balance statistics, and each routing's plain reference
plan       index math of one exchange hop: sort order, sizes, ragged offsets
collective one exchange of rows between the devices of a hop (ragged, padded, capacity)
path       the hops of a path (flat, gpu_first, node_first); rows with slots through them, once per destination
           (dedup), the reduced way back
wire       the rows' dtype on the wire (bf16, FP8 with per-128 scales)
experts    grouped expert FFN backends (`BACKENDS`: ragged_dot, dense, pallas, tokamax, fp8, auto), whole or its two
           halves; the shared experts' dense FFN
local_experts  `Experts`: this device's experts as a schedule runs them
schedule   the order of exchanges and expert compute: sequential, chunked, comet (Comet)
replicas   running on a replication slot table: rows to replicas, weights per slot (Lina, EPLB)
expert_sharding  `SHARDINGS`: EP, and Parm's baseline / S1 / S2 (d_ff over 'gpu'): what a device routes, sends
           and sums; expert data parallelism
expert_parallel  the interface of expert sharding (`ExpertParallel`: whole experts, every hook the identity)
parm_sharding    Parm's schedules (baseline, S1, S2; auto, resolved when the config is made)
esp_ops    the MP-group operations of Parm's schedules (MP split, all-gathers, S2's dispatched tensor)
overflow   `apply_without_overflow`: bounded buffers, re-run with a doubled factor while rows overflow
params     the public parameter layout: shapes, shardings, initialisation
layout     `Layout`: how one call spreads over the mesh; the checks of a call's inputs
traffic    rows and bytes moved per hop between devices, split into inter- and intra-node
layer      `moe_apply`: the one assembly of the stages inside `shard_map`
module     `MoELayer`: the Flax nnx module holding the parameters and the layer's state
reference  the single-device reference every scheme is compared with
"""
