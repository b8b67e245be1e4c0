"""The cost model against published papers, one module per paper: its numbers (table or figure cited), the
setting it reproduces and `section()`, which prints the comparison and returns a JSON record.

  smile  moejax.cost.model: SMILE's Table 3, Table 1 and Fig. 8 on AWS P4d nodes;
  comet  moejax.cost.overlap: Comet's hidden-communication shares and single-layer speedups (Fig. 10, 11, 14);
  parm   moejax.cost.parm: Algorithm 1 and the baseline / S1 / S2 times on Table III's layers, against Table IV;
  lina   moejax.cost.contention: Lina's Fig. 7 timeline and its all-to-all and step speedups (Fig. 3, 13, 14).

experiments/validate_cost_model.py runs them. Files of the repository are found from `ROOT`, not from the working
directory.
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]  # experiments/validation/__init__.py -> the repository


def display_path(path) -> str:
  """`path` as printed and recorded: relative to the repository if inside it (so that the output does not depend
  on where the checkout lives), else as given."""
  try:
    return str(pathlib.Path(path).resolve().relative_to(ROOT))
  except ValueError:
    return str(path)
