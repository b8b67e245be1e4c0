"""The cost model against published papers, one module per paper: its numbers (table or figure cited), the
setting it reproduces and `section()`, which prints the comparison and returns a JSON record.

  smile  moejax.cost.model: SMILE's Table 3, Table 1 and Fig. 8 on AWS P4d nodes;
  comet  moejax.cost.overlap: Comet's hidden-communication shares and single-layer speedups (Fig. 10, 11, 14);
  parm   moejax.cost.parm: Algorithm 1 and the baseline / S1 / S2 times on Table III's layers, against Table IV;
  lina   moejax.cost.contention: Lina's Fig. 7 timeline and its all-to-all and step speedups (Fig. 3, 13, 14).

experiments/validate_cost_model.py runs them.
"""
