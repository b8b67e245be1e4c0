"""Expert replication for inference: which logical expert each physical slot of a device holds.

Modules: `rebalance` (`rebalance`, the planner: replica counts, packing with local search and a
node-locality tie-break; `device_loads`, `max_load_ratio`; `identity_table`, the slots without
replication), `eplb` (DeepSeek's EPLB hierarchical placement, re-implemented as the baseline to compare
with), `estimator` (Lina's next-layer popularity estimate from tokens' expert paths, its two-phase
planning, and a moving-average baseline).
"""
