"""The cost model against published papers, one module per paper: its numbers (table or figure cited), the
setting it reproduces and `section()`, which prints the comparison and returns a JSON record.

  smile  moejax.cost.model: SMILE's Table 3, Table 1 and Fig. 8 on AWS P4d nodes;
  comet  moejax.cost.overlap: Comet's hidden-communication shares and single-layer speedups (Fig. 10, 11, 14);
  parm   moejax.cost.parm: Algorithm 1 and the baseline / S1 / S2 times on Table III's layers, against Table IV;
  lina   moejax.cost.contention: Lina's Fig. 7 timeline and its all-to-all and step speedups (Fig. 3, 13, 14).

experiments/validate_cost_model.py runs them, experiments/fidelity.py tabulates their `fidelity_rows()`. Files of the
repository are found from `ROOT`, not from the working directory.
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]  # moejax/study/papers/__init__.py -> the repository


def display_path(path) -> str:
  """`path` as printed and recorded: relative to the repository if inside it (so that the output does not depend
  on where the checkout lives), else as given."""
  try:
    return str(pathlib.Path(path).resolve().relative_to(ROOT))
  except ValueError:
    return str(path)


ROLES = ("fit", "held out", "input", "not modelled")


def fidelity_row(
  paper: str, quantity: str, paper_value, model_value, role: str, source: str, variant: str = "", note: str = ""
) -> dict:
  """One line of the fidelity table (experiments/fidelity.py): a paper's number, the model's counterpart and
  their relative error model / paper - 1.

  role: 'fit' (a parameter was fitted on this entry: it tests nothing), 'held out' (no parameter saw it),
    'input' (the entry is one of the model's inputs, e.g. a solo time read off a figure), 'not modelled' (the
    paper's setting is not reported well enough to price it; model_value None).
  variant: which model of the testbed (e.g. its fitted topology); note: what the row assumes or lacks.
  """
  if role not in ROLES:
    raise ValueError(f"role {role!r} is not one of {ROLES}")
  if (model_value is None) != (role == "not modelled"):
    raise ValueError(f"{paper} {quantity}: a model value is given exactly when the role is not 'not modelled'")
  error = None if model_value is None else float(model_value) / float(paper_value) - 1.0
  return dict(
    paper=paper,
    quantity=quantity,
    paper_value=float(paper_value),
    model_value=None if model_value is None else float(model_value),
    rel_err=error,
    role=role,
    source=source,
    variant=variant,
    note=note,
  )
