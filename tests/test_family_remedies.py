"""experiments.family_remedies on the qwen3_moe fixture: every accepted scheme's logits are the baseline's (exactly
up to float32 rounding without a narrower wire, within FP8's error with one), dedup moves no more rows than one row
per choice, and a refused scheme is recorded with its reason instead of stopping the study."""

import json

import pytest

from experiments import family_remedies as fr
from tests.helpers import ROOT

FIXTURE = ROOT / "tests" / "data" / "hf" / "qwen3_moe"


@pytest.mark.slow
def test_study_on_the_fixture(tmp_path, devices):
  del devices
  schemes = {name: fr.scheme_overrides(name, 2, 2) for name in ("flat_nodedup", "flat", "node_first+fp8")}
  schemes["s2_dedup"] = {"esp_schedule": "s2", "dedup": True}  # refused: S2 holds one row per token-choice
  record = fr.run(str(FIXTURE), schemes, batch=8, iters=2)
  out = tmp_path / "family_remedies.json"
  out.write_text(json.dumps(record))
  record = json.loads(out.read_text())
  assert record["baseline"] == "flat_nodedup" and record["reference_rows"] == 2
  by_name = {e["scheme"]: e for e in record["schemes"]}
  assert list(by_name) == list(schemes)

  for name in ("flat_nodedup", "flat", "node_first+fp8"):
    entry = by_name[name]
    assert entry["status"] == "ok", entry
    tol = 1e-5 if entry["lossless"] else 5e-2
    assert entry["rel_err_vs_baseline"] < tol, (name, entry["rel_err_vs_baseline"])
    assert entry["rel_err_vs_reference"] < tol, (name, entry["rel_err_vs_reference"])
    assert entry["traffic_rows_match_model"] and entry["layer_loop_rel_err"] < 1e-6 and entry["jit_rel_err"] < 1e-5
    assert entry["tokens_overflowed"] == 0 and entry["tokens_dropped"] == 0
    assert entry["forward"]["median_s"] > 0 and entry["forward"]["ratio_to_baseline"] > 0
  assert by_name["flat_nodedup"]["rel_err_vs_baseline"] == 0.0
  assert not by_name["node_first+fp8"]["lossless"]
  assert [h["hop"] for h in by_name["node_first+fp8"]["hops"]] == ["node", "gpu"]

  # dedup: no more rows on any hop than one per choice, and fewer over all.
  flat, dedup = by_name["flat_nodedup"], by_name["flat"]
  for side in ("inter", "intra"):
    assert dedup[f"{side}_rows_per_token"] <= flat[f"{side}_rows_per_token"] + 1e-12
  assert dedup["inter_rows_per_token"] + dedup["intra_rows_per_token"] < (
    flat["inter_rows_per_token"] + flat["intra_rows_per_token"]
  )
  # FP8 out makes each row's payload smaller than the float32 baseline's (the node_first path's node hop crosses nodes only).
  fp8 = by_name["node_first+fp8"]
  assert fp8["hops"][0]["intra_rows_per_token"] == 0 and fp8["hops"][1]["inter_rows_per_token"] == 0
  assert fp8["inter_bytes_per_token"] / fp8["inter_rows_per_token"] < (
    flat["inter_bytes_per_token"] / flat["inter_rows_per_token"]
  )

  refused = by_name["s2_dedup"]
  assert refused["status"] == "refused" and "dedup" in refused["reason"] and "s2" in refused["reason"]
  assert "rel_err_vs_baseline" not in refused
  assert "s2_dedup" in fr.table(record) and "refused" in fr.table(record)


def test_schemes_come_from_the_table_baseline_first_and_errors_name_the_field():
  from configs import family_remedies as study_config
  from moejax.validation import ConfigError

  config = study_config.get_config()
  config.schemes = ("node_first+fp8", "flat+chunked", "flat_nodedup")
  config.extra_schemes = '{"s2_dedup": {"esp_schedule": "s2", "dedup": true}}'
  chosen = fr.chosen_schemes(config)
  assert list(chosen) == ["flat_nodedup", "node_first+fp8", "flat+chunked", "s2_dedup"]
  assert chosen["flat_nodedup"] == {"path": "flat", "collective": "auto", "dedup": False}
  assert chosen["node_first+fp8"] == {"path": "node_first", "collective": "auto", "dispatch_dtype": "float8_e4m3fn"}
  assert chosen["flat+chunked"] == {"path": "flat", "collective": "auto", "schedule": "chunked", "num_chunks": 2}
  assert set(fr.chosen_schemes(study_config.get_config())) == set(study_config.SCHEMES)
  config.schemes = ("flat", "bilevel_dedup")
  with pytest.raises(ConfigError, match=r"^config field schemes='bilevel_dedup' .*unknown scheme 'bilevel_dedup'"):
    fr.chosen_schemes(config)
  config.schemes, config.extra_schemes = ("flat",), '{"mine": transport}'
  with pytest.raises(ConfigError, match=r"^config field extra_schemes="):
    fr.chosen_schemes(config)
