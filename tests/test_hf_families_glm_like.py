"""The families of issue 59 that are GLM-4.5's MoE layer under another decoder or name their attention tensors
their own way, against transformers: solar_open (Llama's attention with GLM-4.5's MoE in every layer and no
intermediate_size), hunyuan_v1_moe (QK-norm per head after RoPE, `self_attn.query_layernorm`, softmax routing with an
ungated shared MLP) and sarvam_moe (GLM-4.5 under Sarvam's names, q, k and v fused by rows). Each family's fixture
(tests/data/hf/<family>, from transformers' own class) gives its logits on the 2 x 4 mesh under the default MoE path
and another, the routers' choices, greedy tokens (through the KV cache: HunYuan's keys are cached normed), and the
checkpoint written back bit for bit; the export loads back in transformers with the fixture's logits
(`make_hf_fixtures.py --check-export`, docs/models.md). Here too what each config.json says its own way.
"""

import pytest

from moejax.models import hf_checkpoint, hf_config
from moejax.validation import ConfigError
from tests.hf_family_checks import (
  SHAPES,
  check_against_reference,
  check_export_refuses,
  check_greedy_generation,
  check_logits_and_routing,
  check_round_trip,
  check_under_tensor_parallelism,
  config,
  from_hf_under,
)
from tests.test_hf_models import (
  Loaded,
  case,
  edit_config,
  fixture_copy,
  reference,
  refused,
)

FAMILIES = ("solar_open", "hunyuan_v1_moe", "sarvam_moe")
# Another MoE path per family than the default (gpu_first, dedup off, ragged all-to-all).
OTHER_PATH = {
  "solar_open": {"path": "node_first", "dedup": True, "buffer_factor": 4.0},
  "hunyuan_v1_moe": {"dedup": True},
  "sarvam_moe": {"path": "node_first", "buffer_factor": 4.0},
}
# config.json fields each family's transformers class reads, beyond the shapes every family has.
ATTENTION = ("attention_bias", "head_dim", "num_key_value_heads", "rms_norm_eps")
V3_ROUTED = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts")
V3_ROUTED += ("routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group")
FIELDS = {
  "solar_open": V3_ROUTED + ATTENTION + ("rope_parameters",),
  # rope_parameters: written as the plain RoPE its alpha amounts to (test_hunyuan_reads_...)
  "hunyuan_v1_moe": ("num_experts", "moe_topk", "intermediate_size") + ATTENTION,
  "sarvam_moe": V3_ROUTED
  + ATTENTION
  + ("intermediate_size", "first_k_dense_replace", "use_qk_norm", "rope_parameters"),
}


@pytest.fixture(scope="module")
def loaded(mesh_2x4):
  return Loaded(mesh_2x4)


# ---------------------------------------------------------------------------------------------------------------
# Against transformers


@pytest.mark.parametrize("family", [case(f, slow=False) for f in FAMILIES])
def test_logits_and_routing_match_transformers(loaded, family):
  check_logits_and_routing(*loaded.forward(family), reference(family), no_overflow=True)


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_logits_under_another_path(mesh_2x4, family):
  ref, moe = reference(family), OTHER_PATH[family]
  model = from_hf_under(family, mesh_2x4, moe)
  check_against_reference(model, ref, every_copy=False, no_drops=False)


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_greedy_generation_matches_transformers(loaded, family):
  check_greedy_generation(loaded.model(family), family)


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_round_trip(loaded, tmp_path, family):
  """The export holds the fixture's tensors bit for bit under the same names, and the config.json fields the family's
  transformers class reads; loaded again, the same parameters."""
  fields = SHAPES + ("num_attention_heads",) + FIELDS[family]
  check_round_trip(loaded.model(family), tmp_path, family, loaded.mesh, fields)


# ---------------------------------------------------------------------------------------------------------------
# What each config.json says its own way


def test_solar_open_reads_llama_attention_and_v3_routing_in_every_layer():
  cfg, moe_cfg = hf_config.from_hf_config(config("solar_open"))
  assert (cfg.qkv_bias, cfg.out_bias, cfg.qk_norm, cfg.head_dim, cfg.num_mtp_layers) == (True, False, False, 16, 0)
  assert cfg.moe_layers == (True,) * 3 and cfg.sliding_window is None and cfg.partial_rotary_factor == 1
  assert cfg.d_ff == moe_cfg.d_ff == 16 and cfg.rms_eps == 1e-5  # no intermediate_size: the experts' width
  assert (moe_cfg.score, moe_cfg.group_score, moe_cfg.num_groups, moe_cfg.topk_groups) == ("sigmoid", "top2_sum", 4, 2)
  assert (moe_cfg.renormalize, moe_cfg.routed_scaling, moe_cfg.num_shared_experts, moe_cfg.shared_d_ff) == (
    True,
    1.5,
    1,
    16,
  )
  assert moe_cfg.bias_update_rate > 0  # the checkpoint's e_score_correction_bias


def test_solar_open_defaults_are_solar_open_configs():
  """What a config.json leaves out is SolarOpenConfig's default: one shared expert, renormalised weights, eps 1e-5,
  theta 1e6 (moejax's readers default otherwise for the other families)."""
  absent = ("n_shared_experts", "norm_topk_prob", "rms_norm_eps", "rope_parameters", "n_group", "topk_group")
  cfg, moe_cfg = hf_config.from_hf_config({k: v for k, v in config("solar_open").items() if k not in absent})
  assert (moe_cfg.num_shared_experts, moe_cfg.renormalize, moe_cfg.num_groups) == (1, True, None)
  assert (cfg.rms_eps, cfg.rope_theta) == (1e-5, 1e6)
  # transformers' router is DeepSeek-V3's whatever config.json says
  other, other_moe = hf_config.from_hf_config({**config("solar_open"), "scoring_func": "softmax"})
  assert other_moe.score == "sigmoid"


@pytest.mark.parametrize(
  "field, value",
  [
    ("moe_layers", (False, True, True)),
    ("sliding_window", 4),
    ("qk_norm", True),
    ("out_bias", True),
    ("num_mtp_layers", 1),
    ("moe.score", "softmax"),
    ("moe.group_score", "max"),
  ],
)
def test_solar_open_export_refuses_what_its_config_json_cannot_say(field, value):
  check_export_refuses(config("solar_open"), field, value)


@pytest.mark.parametrize("family", ["hunyuan_v1_moe", "sarvam_moe"])
def test_renamed_attention_under_tensor_parallelism(devices, family):
  """Heads split over 'gpu' (4 nodes x 2 GPUs): HunYuan's norm after RoPE on each device's heads, Sarvam's q, k and v
  each device reading its own rows of the fused tensor; the logits stay transformers'."""
  check_under_tensor_parallelism(family)


def test_hunyuan_reads_qk_norm_after_rope_alpha_rope_and_a_shared_mlp():
  cfg, moe_cfg = hf_config.from_hf_config(config("hunyuan_v1_moe"))
  assert (cfg.qk_norm, cfg.qk_norm_mode, cfg.qkv_bias, cfg.out_bias, cfg.head_dim) == (
    True,
    "head_after_rope",
    1,
    1,
    16,
  )
  assert cfg.rope_theta == 1e4 * 1000.0 ** (16 / 14) and cfg.rope_scaling is None  # the fixed NTK alpha of "dynamic"
  assert cfg.moe_layers == (True,) * 3 and cfg.rms_eps == 1e-5 and cfg.sliding_window is None
  assert (moe_cfg.score, moe_cfg.renormalize, moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.d_ff) == (
    "softmax",
    1,
    8,
    2,
    16,
  )
  assert (moe_cfg.num_shared_experts, moe_cfg.shared_width, moe_cfg.shared_gate) == (1, 16, False)
  assert hf_checkpoint.hf_key(("blocks", 0, "attn", "q_norm", "weight"), cfg)[0].endswith(
    "self_attn.query_layernorm.weight"
  )
  assert hf_checkpoint.hf_key(("blocks", 0, "ffn", "moe", "router", "kernel"), cfg) == (
    "model.layers.0.mlp.gate.wg.weight",
    True,
  )
  written = hf_config.to_hf_config(cfg, moe_cfg)
  assert written["rope_parameters"] == {"rope_theta": cfg.rope_theta, "rope_type": "default"}


def test_hunyuan_moe_topk_per_layer_is_one_value():
  cfg, moe_cfg = hf_config.from_hf_config({**config("hunyuan_v1_moe"), "moe_topk": [2, 2, 2]})
  assert moe_cfg.top_k == 2
  with pytest.raises(ConfigError, match="moe_topk"):
    hf_config.from_hf_config({**config("hunyuan_v1_moe"), "moe_topk": [2, 4, 2]})
  with pytest.raises(ConfigError, match="num_experts"):
    hf_config.from_hf_config({**config("hunyuan_v1_moe"), "num_experts": [8, 8, 8]})


def test_hunyuan_dynamic_rope_without_alpha_is_refused(tmp_path, mesh_2x4):
  """Dynamic NTK scaling by a factor depends on the sequence's length: not a RoPE moejax has."""
  directory = fixture_copy(tmp_path, "hunyuan_v1_moe")
  edit_config(directory, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
  assert "rope_type" in refused(directory, mesh_2x4)


@pytest.mark.parametrize(
  "field, value",
  [("qk_norm_mode", "head"), ("out_bias", False), ("moe_layers", (False, True, True)), ("moe.shared_gate", True)],
)
def test_hunyuan_export_refuses_what_its_config_json_cannot_say(field, value):
  check_export_refuses(config("hunyuan_v1_moe"), field, value)


def test_sarvam_reads_glm_under_its_names_aliases_and_defaults():
  cfg, moe_cfg = hf_config.from_hf_config(config("sarvam_moe"))
  assert (cfg.qk_norm, cfg.qk_norm_mode, cfg.qkv_bias, cfg.out_bias, cfg.partial_rotary_factor) == (1, "head", 1, 0, 1)
  assert cfg.moe_layers == (False, True, True) and (moe_cfg.score, moe_cfg.routed_scaling) == ("sigmoid", 2.5)
  key = lambda *path: hf_checkpoint.hf_key(("blocks", 1, *path), cfg)
  assert key("attn", "k_proj", "bias") == ("model.layers.1.attention.query_key_value.bias#64:96/128", False)
  assert key("attn", "v_proj", "kernel") == ("model.layers.1.attention.query_key_value.weight#96:128/128", True)
  assert key("attn", "o_proj", "kernel")[0] == "model.layers.1.attention.dense.weight"
  assert key("ffn", "moe", "expert_bias")[0] == "model.layers.1.mlp.gate.expert_bias"
  assert hf_checkpoint.hf_key(("embed", "embedding"), cfg)[0] == "model.word_embeddings.weight"
  renamed = {"num_experts": 16, "num_shared_experts": 2, "use_qkv_bias": False}
  absent = ("n_routed_experts", "n_shared_experts", "attention_bias", "use_qk_norm", "rope_parameters")
  hf = {**{k: v for k, v in config("sarvam_moe").items() if k not in absent}, **renamed}
  cfg, moe_cfg = hf_config.from_hf_config(hf)
  assert (moe_cfg.num_experts, moe_cfg.num_shared_experts, cfg.qkv_bias, cfg.qk_norm) == (16, 2, False, True)
  assert (cfg.rope_theta, cfg.partial_rotary_factor) == (8e6, 1)  # SarvamMoEConfig's, not GLM-4.5's 0.5


def test_sarvam_fused_rows_of_another_length_are_refused(tmp_path, mesh_2x4):
  """A query_key_value of other heads than config.json's is refused naming it, before anything is read."""
  directory = fixture_copy(tmp_path, "sarvam_moe")
  edit_config(directory, num_key_value_heads=4)
  assert "attention.query_key_value" in refused(directory, mesh_2x4)
