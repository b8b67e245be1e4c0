"""Granite MoE SWA (`granitemoe_swa`) against transformers: granitemoe's decoder (muP scalars, stacked experts) with a
sink logit per head in every layer, sliding layers by layer_types and a RoPE theta per layer (layer_rope_theta, 0:
NoPE), held as one theta per layer kind (the sliding layers' by `DecoderConfig.sliding_overrides`) and
`DecoderConfig.nope_layers`. The fixture (tests/data/hf/granitemoe_swa, transformers' GraniteMoeSWAForCausalLM: 4
layers [full, sliding, full, sliding] with a window of 4 keys, thetas [1e4, 500, 0, 500], 8 experts top-2) gives
logits on the 2 x 4 mesh scanned and unrolled under another MoE path, greedy tokens through the cache and ExFlow's
decode, and the checkpoint written back bit for bit; the export loads back in transformers with the fixture's logits
(`make_hf_fixtures.py --check-export granitemoe_swa`, docs/models.md). Here too what its config.json says its own
way."""

import functools
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moejax.models as models
from moejax.models import hf_config
from moejax.validation import ConfigError
from tests import hf_family_checks as checks
from tests.helpers import relative_error
from tests.hf_family_checks import (
  SHAPES,
  check_against_reference,
  check_export_refuses,
  check_greedy_generation,
  check_round_trip,
  from_hf_under,
)
from tests.test_hf_models import fixture_copy, group, reference, tiled

FAMILY = "granitemoe_swa"
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
FULL, SLIDING = "full_attention", "sliding_attention"
FIELDS = (  # config.json fields transformers' GraniteMoeSWAConfig reads, beyond the shapes every family has
  "layer_types",
  "sliding_window",
  "layer_rope_theta",
  "num_local_experts",
  "num_experts_per_tok",
  "intermediate_size",
  "num_key_value_heads",
  "shared_intermediate_size",
  "embedding_multiplier",
  "residual_multiplier",
  "attention_multiplier",
  "logits_scaling",
)
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
  cfg = model.cfg
  assert (cfg.sliding_window, cfg.sliding_layers, cfg.nope_layers) == (4, (0, 1, 0, 1), (0, 0, 1, 0))
  assert (cfg.rope_theta, cfg.sliding_overrides, cfg.attention_sinks) == (1e4, (("rope_theta", 500.0),), True)
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_unrolled_under_another_path(mesh_2x4):
  other = from_hf_under(FAMILY, mesh_2x4, OTHER_PATH, model={"scan_layers": False})
  check_against_reference(other, reference(FAMILY))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["vanilla", "exflow"])
def test_greedy_generation_matches_transformers(model, mode):
  check_greedy_generation(model, FAMILY, mode=mode)


@pytest.mark.slow
def test_round_trip(model, tmp_path, mesh_2x4):
  """The export holds the fixture's tensors bit for bit under the same names, and the config.json fields
  transformers reads (layer_rope_theta among them); loaded again, the same parameters."""
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


@pytest.mark.slow
@pytest.mark.parametrize("change", ["window", "sliding_theta", "nope", "sinks"])
def test_each_feature_acts(tmp_path, mesh_2x4, change):
  """The controls: without the window, with the sliding layers on the full layers' theta, with layer 2 rotating, or
  without the sinks (their logits at -1e9), the logits move, so each is what matches transformers."""
  directory = fixture_copy(tmp_path, FAMILY)
  hf = config()
  if change == "window":
    hf["layer_types"] = [FULL] * 4
    hf["layer_rope_theta"] = [1e4, 1e4, 0, 1e4]  # one theta per kind: all four layers are full now
  elif change == "sliding_theta":
    hf["layer_rope_theta"] = [1e4, 1e4, 0, 1e4]
  elif change == "nope":
    hf["layer_rope_theta"] = [1e4, 500.0, 1e4, 500.0]
  else:
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    sinks = {name: np.full_like(value, -1e9) for name, value in tensors.items() if name.endswith(".sinks")}
    save_file({**tensors, **sinks}, os.path.join(directory, "model.safetensors"))
  open(os.path.join(directory, "config.json"), "w").write(json.dumps(hf))
  ref = reference(FAMILY)
  logits, _ = models.from_hf(directory, mesh_2x4)(tiled(ref["tokens"]), details=True)
  assert relative_error(np.asarray(logits)[:2], ref["logits"]) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# What GraniteMoeSWA's config.json says its own way


@pytest.mark.slow
def test_defaults_are_granitemoe_swa_configs():
  """What config.json leaves out is GraniteMoeSWAConfig's default: full layers where i % 4 == 0 and sliding ones of
  128 keys elsewhere, rope_theta in every layer, no shared MLP; a null window slides nowhere."""
  absent = ("layer_types", "sliding_window", "layer_rope_theta", "shared_intermediate_size")
  cfg, moe_cfg = hf_config.from_hf_config({k: v for k, v in config().items() if k not in absent})
  assert (cfg.sliding_window, cfg.sliding_layers, cfg.nope_layers) == (128, (0, 1, 1, 1), None)
  assert (cfg.rope_theta, cfg.sliding_overrides, moe_cfg.num_shared_experts) == (1e4, None, 0)
  cfg, _ = hf_config.from_hf_config({**config(), "sliding_window": None, "layer_rope_theta": None})
  assert (cfg.sliding_window, cfg.sliding_layers, cfg.nope_layers, cfg.sliding_overrides) == (None, None, None, None)


@pytest.mark.slow
@pytest.mark.parametrize(
  "thetas",
  [[1e4, 500.0, 2e4, 500.0], [1e4, 500.0, 0, 600.0], [1e4, 500.0, 0]],
  ids=["two-full-thetas", "two-sliding-thetas", "too-short"],
)
def test_thetas_it_cannot_hold_are_refused(thetas):
  """Two non-zero thetas among the layers of one kind (moejax holds one per kind), or a list that is not one per
  layer: refused, naming layer_rope_theta."""
  with pytest.raises(ConfigError, match="layer_rope_theta"):
    hf_config.from_hf_config({**config(), "layer_rope_theta": thetas})


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value",
  [
    ("sliding_overrides", (("num_kv_heads", 4), ("rope_theta", 1e4))),
    ("attention_sinks", False),
    ("attn_temperature", (4.0, 0.1)),
    ("partial_rotary_factor", 0.5),
    ("moe.renormalize", False),
    ("moe.score", "sigmoid"),
  ],
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)
