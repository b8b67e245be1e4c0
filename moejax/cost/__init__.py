"""Cluster cost model: prices the traffic the layer really produces on a described topology.

Multi-node communication cannot be measured on the machines this project tests on, so the model
takes exact per-peer row counts (the layer's `aux['traffic_rows']`, or analytic matrices for
paper-scale points) and prices them on a topology whose every number cites its source.

Modules: `topology` (presets with sources), `traffic` (peer masks and analytic traffic),
`collectives` (all-to-all as NCCL runs it, ring collectives), `model` (`price_from_traffic`, the
per-layer breakdown), `calibrate` (least-squares fits of latency/bandwidth terms), `overlap` (the
layer under the sequential / chunked / comet schedules, Comet), `parm` (Parm's baseline / S1 / S2
expert-sharding schedules and its Algorithm 1), `contention` (the backward all-to-all against the
data-parallel all-reduce: default / naive_overlap / prioritized, Lina), `decode` (a decode step's
exchanges and all-gather, vanilla vs exflow, ExFlow). The comparisons with the papers' numbers live
outside the library, in experiments/validation/ (one module per paper).
"""
