"""experiments/compare_sweeps.py on two tiny synthetic sweep workdirs (one results.json, one results.csv only)."""

import json
import subprocess
import sys

from experiments import compare_sweeps
from moejax.study import report
from tests.helpers import ENV


def _row(model, scheme, nodes, samples, label="modelled", topology="dgx_h100_ib", device=""):
  return dict(label=label, model=model, scaling="weak", nodes=nodes, gpus_per_node=8, scheme=scheme,
              samples_per_s=samples, layer_ms=1000.0 / samples, topology=topology, device=device)


def _workdirs(tmp_path):
  a, b = tmp_path / "h100", tmp_path / "p4d"
  a.mkdir()
  b.mkdir()
  rows_a = [_row("tiny", s, n, v) for s, f in (("switch", 100.0), ("smile", 150.0)) for n, v in ((1, f), (4, 3 * f))]
  (a / "results.json").write_text(json.dumps({"config": {"topology": "dgx_h100_ib"}, "rows": rows_a}))
  rows_b = [_row("small", "smile", n, 10.0 * n, topology="p4d_efa") for n in (1, 2, 4, 8)]
  rows_b.append(_row("small", "smile", 1, 7.0, label="measured", device="cpu"))
  report.write_csv(rows_b, str(b / "results.csv"))
  return a, b


def test_curves_are_split_by_config_and_labelled(tmp_path):
  a, b = _workdirs(tmp_path)
  found = compare_sweeps.curves([str(a), str(b)])
  assert len(found) == 4  # h100: switch, smile; p4d: modelled smile, measured smile
  by_label = {c["label"]: c for c in found}
  assert len(by_label) == 4
  h100_smile = next(c for c in found if c["name"] == "h100" and c["scheme"] == "smile")
  assert h100_smile["points"] == [(1, 150.0), (4, 450.0)]
  assert "dgx_h100_ib" in h100_smile["label"] and "modelled" in h100_smile["label"]
  measured = next(c for c in found if c["kind"] == "measured")
  assert measured["points"] == [(1, 7.0)] and "measured on cpu" in measured["label"]
  modelled_csv = next(c for c in found if c["name"] == "p4d" and c["kind"] == "modelled")
  assert modelled_csv["points"] == [(1, 10.0), (2, 20.0), (4, 40.0), (8, 80.0)]  # read back from the CSV as numbers

  table = compare_sweeps.format_table(found, "samples_per_s").splitlines()
  assert table[1].split()[1:] == ["1", "2", "4", "8"]
  line = next(x for x in table if x.startswith(h100_smile["label"]))
  assert line[len(h100_smile["label"]):].split() == ["150", "-", "450", "-"]


def test_command_prints_the_table_and_writes_one_png(tmp_path):
  a, b = _workdirs(tmp_path)
  out = tmp_path / "cmp.png"
  done = subprocess.run([sys.executable, "-m", "experiments.compare_sweeps", f"--workdirs={a},{b}",
                         "--labels=H100 run,P4d run", f"--out={out}"], env=ENV, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "H100 run: tiny switch x8 GPUs/node, weak, modelled on dgx_h100_ib" in done.stdout
  assert "P4d run: small smile x8 GPUs/node, weak, measured on cpu" in done.stdout
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paper_points_only_where_the_sweep_is_the_papers_setting(tmp_path):
  from configs import scaling_smile
  config = scaling_smile.get_config()
  points = report.paper_points(config, "smile_3_7b", "weak", "p4d_efa")
  assert {(p["scheme"], p["samples_per_s"]) for p in points} == {("switch", 8112.0), ("smile", 20011.0)}
  assert {p["samples_per_s"] for p in report.paper_points(config, "smile_48b", "strong", "p4d_efa+nic_bw=2e10")} \
      == {889.0, 2223.0}
  assert report.paper_points(config, "smile_48b", "weak", "p4d_efa") == []  # micro batch 64: weak is not Table 2
  assert report.paper_points(config, "smile_3_7b", "weak", "dgx_h100_ib") == []
  config.global_batch = 4096
  assert report.paper_points(config, "smile_13b", "strong", "p4d_efa") == []
  config.global_batch = 16384
  rows = [dict(_row("smile_3_7b", s, n, 1000.0 * n, topology="p4d_efa"), scaling=sc)
          for s in ("switch", "smile") for n in (1, 16) for sc in ("weak", "strong")]
  report.plot_throughput(rows, str(tmp_path / "t.png"), config)
  assert (tmp_path / "t.png").stat().st_size > 0
