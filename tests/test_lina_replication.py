"""experiments.lina_replication on small synthetic traces: every policy planned and priced, the oracle's load the
most balanced, the record and plot written to the workdir; a bad field named before anything runs."""

import json

import pytest

from configs import lina_replication as replay_config
from experiments import lina_replication
from moejax.validation import ConfigError


def test_replay_on_synthetic_traces_writes_the_record(tmp_path):
  config = replay_config.get_config()
  config.synthetic.update(layers=5, tokens=32768)
  config.batch_tokens = 4096
  lina_replication.check(config)
  record = lina_replication.run(config, str(tmp_path))
  rows = {r["policy"]: r for r in record["rows"]}
  assert list(rows) == [
    "no_replication",
    "moving_average",
    "lina_phase1",
    "lina_phase2",
    "oracle",
    "lina_phase2+overheads",
  ]
  assert rows["oracle"]["busiest_over_mean"] <= rows["no_replication"]["busiest_over_mean"]
  assert rows["no_replication"]["speedup_layer_p50"] == 1.0 and 0.0 <= record["accuracy"] <= 1.0
  assert (
    record["synthetic"]
    and record["shape"] == [5, 32768, 1]
    and record["profiled_tokens"] == 16384
    and record["num_experts"] == 16
  )
  assert json.loads((tmp_path / "lina_replication.json").read_text())["rows"] == record["rows"]
  assert (tmp_path / "lina_replication.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("top_k", 0, r"^config field top_k=0 is not allowed: None or a positive int"),
    ("profile_fraction", 1.0, r"^config field profile_fraction=1.0 .*\(0, 1\)"),
    ("traces", "/nonexistent.npy", r"^config field traces='/nonexistent.npy' .*existing \.npy"),
    ("topology", "dgx", r"^config field topology='dgx' .*one of"),
  ],
)
def test_a_bad_field_is_named(field, value, message):
  config = replay_config.get_config()
  config[field] = value
  with pytest.raises(ConfigError, match=message):
    lina_replication.check(config)
