"""LongCat-Flash against transformers: shortcut-connected MoE layers (ScMoE, `moejax.models.shortcut_block`: two MLA
attentions and two dense FFNs per layer, the MoE branch from the first attention's normed output added at the layer's
end), MLA with LongCat's LoRA scaling, softmax routing over 8 real and 4 zero-computation experts chosen with the
router's bias [E + Z] (the layer's frozen bias), times routed_scaling_factor, not renormalised. The fixture
(tests/data/hf/longcat_flash, transformers' LongcatFlashForCausalLM: 2 layers, top-2 of 8 + 4 zero experts, 19 of its
96 choices zero experts) gives logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers'
choices, greedy tokens through the cache (both attentions' latents in one pair), the checkpoint written back bit for
bit, and the zero experts' choices moving no row on any hop; the export loads back in transformers with the
fixture's logits (`make_hf_fixtures.py --check-export longcat_flash`, docs/models.md).
"""

import functools

import numpy as np
import pytest

import moejax.models as models
from moejax.infer import decode
from moejax.models import hf_checkpoint, hf_config
from moejax.study import family_remedies
from moejax.validation import ConfigError
from tests import hf_family_checks as checks
from tests import test_zero_experts
from tests.helpers import relative_error
from tests.hf_family_checks import (
  assert_fields_equal,
  assert_loads_as,
  assert_tensors_equal,
  check_export_refuses,
  check_greedy_generation,
  exported,
  from_hf_under,
)
from tests.test_hf_models import DATA, TOL, group, reference, tiled

FAMILY = "longcat_flash"
E, Z = 8, 4
PROJ = ("gate_proj", "up_proj")
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def check_against_reference(model, ref):
  ids = checks.check_against_reference(model, ref)
  assert (ids >= E).any()  # the zero experts are chosen


def test_logits_and_routing_match_transformers(model):
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_unrolled_under_another_path(mesh_2x4):
  other = from_hf_under(FAMILY, mesh_2x4, OTHER_PATH, model={"scan_layers": False})
  check_against_reference(other, reference(FAMILY))


@pytest.mark.slow
@pytest.mark.parametrize("path, dedup", [("flat", False), ("node_first", True)])
def test_zero_expert_choices_move_no_row(mesh_2x4, path, dedup):
  """Each MoE layer's traffic, hop by hop, is the count made from its real choices alone (`expected_traffic`): a
  zero expert's choice puts no row on the wire; the same count with the zero choices sent would be larger."""
  moe = {"path": path, "dedup": dedup}
  aux = models.from_hf(str(DATA / FAMILY), mesh_2x4, moe=moe)(tiled(reference(FAMILY)["tokens"]), details=True)[1]
  ids_all, traffic_all = np.asarray(aux["expert_ids"]), np.asarray(aux["traffic_rows"])
  zero_rows = []
  for ids, traffic in zip(ids_all, traffic_all):
    np.testing.assert_array_equal(traffic, expected_traffic(ids, path, dedup))
    as_real = np.where(ids < E, ids, ids - E)  # the zero choices sent as if to real experts 0 .. Z - 1
    zero_rows.append(int(expected_traffic(as_real, path, dedup).sum() - traffic.sum()))
  assert min(zero_rows) > 0, zero_rows  # rows the zero choices would have moved


def expected_traffic(ids_TxK: np.ndarray, path: str, dedup: bool) -> np.ndarray:
  """`test_zero_experts.expected_traffic` of this model's ids (one real expert per device of the 8; ids >= E zero
  experts), in that count's id space (two experts per device, its E = 16)."""
  real_e = test_zero_experts.E
  return test_zero_experts.expected_traffic(np.where(ids_TxK < E, ids_TxK * (real_e // E), real_e), path, dedup)


@pytest.mark.slow
def test_greedy_generation_matches_transformers(model):
  check_greedy_generation(model, FAMILY)


@pytest.mark.slow
def test_exflow_greedy_generation_matches_transformers(model):
  """ExFlow's decode runs an ScMoE layer in two halves around its MoE branch's hops (the first attention where the
  token is, the rest where its last expert is, plus the branch's output), zero experts kept where the token is: its
  greedy tokens are transformers', and its logits at every step the vanilla decode's, scanned and unrolled."""
  check_greedy_generation(model, FAMILY, mode="exflow")
  prompts = tiled(reference(FAMILY)["tokens"])[:, :6]
  for decoder in (model, from_hf_under(FAMILY, model.mesh, {}, model={"scan_layers": False})):
    exflow, vanilla = (decode.generate(decoder, prompts, 4, mode=mode) for mode in ("exflow", "vanilla"))
    assert relative_error(exflow.logits, vanilla.logits) < 1e-5


@pytest.mark.slow
def test_running_block_halves_apart_in_the_remedies_study_is_refused(model):
  """The remedies study runs a block's attention and FFN halves apart: an ScMoE layer has none."""
  with pytest.raises(ConfigError, match="ScMoE") as err:
    family_remedies.layer_traffic(model, reference(FAMILY)["tokens"])
  assert err.value.field == "checkpoint"


@pytest.mark.slow
def test_round_trip(model, tmp_path, mesh_2x4):
  """The export holds the fixture's tensors bit for bit under the same names, but the zero experts' gate and up
  projections, which no forward reads (ignored on load), written as zeros; the config.json fields transformers reads;
  loaded again, the same parameters."""
  out, fixture, written, got = exported(model, tmp_path, FAMILY)
  unread = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in range(2) for e in range(E, E + Z) for p in PROJ}
  assert unread < set(fixture)
  assert_tensors_equal(written, {n: np.zeros_like(t) if n in unread else t for n, t in fixture.items()})
  names = ("model_type", "architectures", "vocab_size", "hidden_size", "num_layers", "ffn_hidden_size")
  names += ("moe_topk", "n_routed_experts", "zero_expert_num", "expert_ffn_hidden_size", "routed_scaling_factor")
  names += ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim")
  assert_fields_equal(got, config(), names)
  assert_loads_as(out, mesh_2x4, model)


@pytest.mark.slow
def test_placed_experts_keep_logits_and_export(tmp_path, mesh_2x4):
  """A placement moves the real experts, their router columns and their biases; the zero experts' columns and
  biases stay. Logits unchanged, and the export puts everything back in the checkpoint's order."""
  placement = np.array([np.arange(E)[::-1], (np.arange(E) + 3) % E])
  placed = models.from_hf(str(DATA / FAMILY), mesh_2x4, placement=placement)
  ref = reference(FAMILY)
  logits = np.asarray(placed(tiled(ref["tokens"]))[0])
  assert relative_error(logits[:2], ref["logits"]) < TOL
  _, fixture, written, _ = exported(placed, tmp_path, FAMILY)
  for name in [n for n in fixture if "router" in n or ".experts.0." in n]:
    assert np.array_equal(written[name], fixture[name]), name


@pytest.mark.slow
def test_reads_scmoe_layers_zero_experts_and_names():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  assert (cfg.num_layers, cfg.d_ff, cfg.moe_layers, cfg.rope_interleaved, cfg.q_lora_rank) == (2, 48, (1, 1), 1, 16)
  routing = (moe_cfg.score, moe_cfg.renormalize, moe_cfg.routed_scaling, moe_cfg.zero_experts, moe_cfg.top_k)
  assert routing == ("softmax", False, 2.0, Z, 2) and moe_cfg.num_experts == E and moe_cfg.d_ff == 16
  key = lambda *path: hf_checkpoint.hf_key(("blocks", 1, *path), cfg)
  assert key("ffn", "moe", "router", "kernel") == ("model.layers.1.mlp.router.classifier.weight", True)
  assert key("ffn", "moe", "expert_bias") == ("model.layers.1.mlp.router.e_score_correction_bias", False)
  assert key("attn", 1, "q_b_proj", "kernel") == ("model.layers.1.self_attn.1.q_b_proj.weight", True)
  assert key("ln_ffn", 0, "weight") == ("model.layers.1.post_attention_layernorm.0.weight", False)
  assert key("mlps", 1, "down_proj", "kernel") == ("model.layers.1.mlps.1.down_proj.weight", True)


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value",
  [("moe.renormalize", True), ("moe.score", "sigmoid"), ("moe.num_shared_experts", 1), ("rope_interleaved", False)],
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)


@pytest.mark.slow
def test_refuses_a_rotary_width_other_than_head_dim():
  with pytest.raises(ConfigError, match="head_dim"):
    hf_config.from_hf_config({**config(), "head_dim": 8})
