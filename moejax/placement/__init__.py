"""Affinity-aware expert placement (ExFlow): which device holds each expert of each MoE layer.

traces    `routing_traces`: a model's expert ids per MoE layer on token batches -> [M, T, K]
affinity  `affinity_counts`: routing traces -> transition counts [M-1, E, E]; `transitions`: the
          cross-node and cross-GPU transitions a placement leaves
solve     `solve`: ExFlow's ILP (Eqs. 8-12, aggregated), nodes first, then GPUs inside each node
          (HiGHS MILP with a time limit; exact linear assignment at one expert per part) -> `Placement`;
          routing='node_limited' / 'bilevel' keeps every node's experts together (only whole nodes move)
apply     `apply_placement`: permutes experts and router columns so the layer's layout realises it;
          refuses placements that would change a node routing's decisions
"""
