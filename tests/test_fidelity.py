"""The fidelity table (experiments/fidelity.py): its rows' errors and roles, the fit discipline and the plot."""

import pytest

from experiments import fidelity
from moejax.cost import topology as topology_lib
from moejax.study.papers import fidelity_row, lina, smile


def test_row_error_is_model_over_paper_minus_one():
  row = fidelity_row("X", "q", 4.0, 5.0, "held out", "Table 9")
  assert row["rel_err"] == pytest.approx(0.25)
  assert fidelity_row("X", "q", 8.0, None, "not modelled", "Fig. 1")["rel_err"] is None
  with pytest.raises(ValueError):
    fidelity_row("X", "q", 1.0, None, "held out", "s")  # a held-out row needs a model value
  with pytest.raises(ValueError):
    fidelity_row("X", "q", 1.0, 1.0, "guessed", "s")


def test_table_flags_held_out_rows_beyond_tolerance_and_counts_them():
  rows = [
    fidelity_row("P", "close", 100.0, 120.0, "held out", "s"),
    fidelity_row("P", "far", 100.0, 60.0, "held out", "s"),
    fidelity_row("P", "fitted", 100.0, 40.0, "fit", "s", variant="v", note="fit: 3 widgets"),
  ]
  lines = fidelity.format_table(rows).splitlines()
  assert "+20.0% " in lines[1] and "*" not in lines[1]
  assert "-40.0% *" in lines[2]
  assert "*" not in lines[3]  # a fitted entry is never flagged: it tests nothing
  assert any(x.startswith("held out: 1 of 2 within 25%") for x in lines)
  assert any(x.startswith("  P far") for x in lines) and not any(x.startswith("  P close") for x in lines)
  assert "  P v, on fitted: fit: 3 widgets" in lines  # every fitted parameter listed with its value


def test_lina_fits_tokens_and_gradient_bytes_on_fig7c():
  """Two numbers Lina does not give, each fitted on one Fig. 7c time; the gradient's bytes by hand from NCCL's ring
  over 16 GPUs on 4 nodes: 30 steps, 6 of them across nodes, 2 x 15/16 of the buffer over the 12.5 GB/s NIC."""
  fit = [r for r in lina.fidelity_rows() if r["role"] == "fit"]
  assert [r["quantity"] for r in fit] == [
    "backward A2A, 16 experts, alone (ms)",
    "all-reduce of 3 gradients, alone (ms)",
  ]
  assert all(abs(r["rel_err"]) < 1e-9 for r in fit)
  t = topology_lib.A100_IB100
  fixed = t["launch"] + 24 * t["intra_latency"] + 6 * t["inter_latency"]
  assert lina.fitted_gradient_bytes() == pytest.approx((5.8e-3 / 3 - fixed) * t["nic_bw"] / (2 * 15 / 16), rel=1e-9)
  assert f"{lina.fitted_gradient_bytes() / 1e6:.2f} MB" in fit[1]["note"]


def test_smile_fits_two_entries_and_reproduces_them():
  """Two terms fitted on two Table 3 entries: those rows match by construction, every other is held out."""
  rows = smile.fidelity_rows()
  fit = [r for r in rows if r["role"] == "fit"]
  assert [r["quantity"] for r in fit] == ["Table 3 switch_a2a (ms)", "Table 3 smile_inter (ms)"]
  assert all(abs(r["rel_err"]) < 1e-9 for r in fit)
  assert {r["role"] for r in rows} == {"fit", "held out"}
  by_name = {r["quantity"]: r for r in rows}
  assert by_name["Table 1 smile 16 nodes (samples/s)"]["paper_value"] == 20011.0


def test_plot_writes_a_png(tmp_path):
  rows = [
    fidelity_row("P", "a", 2.0, 2.2, "held out", "s"),
    fidelity_row("P", "b", 300.0, 100.0, "fit", "s"),
    fidelity_row("Q", "c", 0.5, None, "not modelled", "s"),
  ]
  fidelity.plot(rows, str(tmp_path / "f.png"))
  assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smile_self_contradiction_by_hand():
  """Table 1's step against Table 3's lower bound, computed by hand from the paper's numbers."""
  c = smile.paper_consistency()
  assert c["smile"]["table1_step_s"] == pytest.approx(16384 / 20011)
  assert c["smile"]["bound_s"]["exchanges"] == pytest.approx(6 * (0.146 + 0.077 + 0.009))
  assert c["smile"]["ratio"]["exchanges"] == pytest.approx(1.392 / 0.81875, rel=1e-3)
  assert c["switch"]["ratio"]["with_ffn"] == pytest.approx(6 * (0.535 + 0.382 + 0.306) / (16384 / 8112), rel=1e-6)
  table1 = [r for r in smile.fidelity_rows() if r["quantity"].startswith("Table 1")]
  assert all("contradicts Table 3" in r["note"] for r in table1)


@pytest.mark.slow
def test_command_writes_the_table_and_names_an_unknown_paper(tmp_path):
  import json
  import subprocess
  import sys

  from tests.helpers import ENV

  command = [sys.executable, "-m", "experiments.fidelity", f"--workdir={tmp_path}"]
  done = subprocess.run(
    [*command, "--config.papers=SMILE,ExFlow"], env=ENV, capture_output=True, text=True, timeout=300
  )
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads((tmp_path / "fidelity.json").read_text())
  assert {r["paper"] for r in rows} == {"SMILE", "ExFlow"} and (tmp_path / "fidelity.png").exists()
  done = subprocess.run([*command, "--config.papers=SMILE,Smile"], env=ENV, capture_output=True, text=True, timeout=300)
  assert done.returncode == 1 and done.stderr.strip().splitlines() == [
    "error: config field papers=('SMILE', 'Smile') is not allowed: some of ['SMILE', 'Comet', 'Parm', 'Lina', 'ExFlow']"
  ]
