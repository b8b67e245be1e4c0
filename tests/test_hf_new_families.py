"""The families of issue 59 (dots1, glm4_moe_lite, olmoe, minimax_m2), beyond the logits, routing, generation and
round-trip checks every family gets in tests/test_hf_models.py; and the MoE model_types of transformers that moejax
cannot run, refused by the feature they need.

dots1 is Qwen3's attention with DeepSeek-V3's MoE layers; glm4_moe_lite is DeepSeek-V3 (MLA) with its MoE layers
named by mlp_layer_types; olmoe and minimax_m2 QK-norm the whole q and k projections (`qk_norm_mode='projection'`),
olmoe clipping q, k and v, minimax_m2 with partial RoPE and sigmoid routing biased by its MoE block's
e_score_correction_bias. Their fixtures (tests/data/hf/<family>) come from transformers' own classes.
"""

import dataclasses

import numpy as np
import pytest
from flax import nnx

import moejax.models as models
from moejax.models import attention, families, hf_config
from moejax.validation import ConfigError
from tests.helpers import ROOT, relative_error
from tests.hf_family_checks import check_export_refuses, check_under_tensor_parallelism, config
from tests.test_hf_models import DATA, edit_config, fixture_copy, reference, refused, tiled

# The MoE model_types of transformers 5.24 that issue 59 lists beyond those moejax loads (sarvam_moe and
# hunyuan_v1_moe load: tests/test_hf_families_glm_like.py; qwen3_next: tests/test_hf_qwen3_next.py; qwen3_5_moe and
# kimi_k25, their text decoders: tests/test_hf_vlm_decoders.py; ernie4_5_moe, mimo_v2_flash, llama4, longcat_flash and
# kimi_linear: tests/test_hf_<them>.py; deepseek_v32 and glm_moe_dsa: tests/test_hf_dsa.py).
ISSUE_59_REFUSED = ("laguna", "cohere2_moe")  # deepseek_v4 loads now (tests/test_hf_deepseek_v4.py)


@pytest.mark.parametrize("model_type", sorted(families.UNSUPPORTED))
def test_unsupported_model_types_refused_by_their_feature(tmp_path, mesh_2x4, model_type):
  """Each MoE model_type of transformers moejax cannot run names what it lacks, before any tensor is read."""
  directory = fixture_copy(tmp_path, "qwen3_moe")
  edit_config(directory, model_type=model_type)
  message = refused(directory, mesh_2x4)
  assert message.startswith(f"{model_type}: {families.UNSUPPORTED[model_type]}") and "model_type" in message
  assert not set(families.UNSUPPORTED) & set(families.REGISTRY)
  assert set(ISSUE_59_REFUSED) <= set(families.UNSUPPORTED)


def test_docs_list_each_refused_model_type_with_its_reason():
  """docs/models.md's refused table is families.UNSUPPORTED row for row: none missing or worded otherwise, and no row
  left for a model type that now loads."""
  text = (ROOT / "docs" / "models.md").read_text()
  missing = [k for k, why in families.UNSUPPORTED.items() if f"| `{k}` | {why} |" not in text]
  assert not missing, f"docs/models.md's refused table lacks (or words otherwise) {missing}"
  table = text[text.index("| `model_type` | why it is refused |") :].split("\n\n", 1)[0]
  rows = [line.split("`")[1] for line in table.splitlines()[2:]]
  assert sorted(rows) == sorted(families.UNSUPPORTED), f"stale rows: {sorted(set(rows) - set(families.UNSUPPORTED))}"


def test_dots1_reads_qwen3_attention_and_deepseek_v3_routing():
  cfg, moe_cfg = hf_config.from_hf_config(config("dots1"))
  assert (cfg.qk_norm, cfg.qkv_bias, cfg.out_bias, cfg.head_dim, cfg.num_mtp_layers) == (True, False, False, 16, 0)
  assert cfg.moe_layers == (False, True, True) and cfg.sliding_window is None
  assert (moe_cfg.score, moe_cfg.num_groups, moe_cfg.topk_groups, moe_cfg.renormalize) == ("sigmoid", 4, 2, True)
  assert (moe_cfg.routed_scaling, moe_cfg.shared_width, moe_cfg.bias_update_rate) == (2.5, 32, 0.001)
  # attention_bias: Qwen3's attention biases q, k, v and o alike
  biased, _ = hf_config.from_hf_config({**config("dots1"), "attention_bias": True})
  assert biased.qkv_bias and biased.out_bias


def test_dots1_sliding_layers_follow_max_window_layers():
  """Without layer_types (older config.json files), transformers' Dots1Config slides the layers from
  max_window_layers on whenever sliding_window is set; written back, layer_types say so, and no window is written
  as sliding_window null (Dots1Config's default 4096 would otherwise slide layers 62 on)."""
  hf = {k: v for k, v in config("dots1").items() if k != "layer_types"}
  cfg, moe_cfg = hf_config.from_hf_config({**hf, "sliding_window": 6, "max_window_layers": 1})
  assert cfg.sliding_window == 6 and cfg.sliding_layers == (False, True, True)
  assert hf_config.to_hf_config(cfg, moe_cfg)["layer_types"] == ["full_attention"] + ["sliding_attention"] * 2
  cfg, moe_cfg = hf_config.from_hf_config(hf)  # the default 4096 from layer 62: no sliding layer of 3
  assert cfg.sliding_window is None
  written = hf_config.to_hf_config(cfg, moe_cfg)
  assert written["sliding_window"] is None and written["layer_types"] == ["full_attention"] * 3


def test_glm4_moe_lite_reads_mlp_layer_types_and_v3_routing():
  hf = config("glm4_moe_lite")
  cfg, moe_cfg = hf_config.from_hf_config(hf)
  assert cfg.latent and cfg.moe_layers == (True, False, True) and cfg.rope_interleaved and cfg.v_head_dim == 12
  assert (moe_cfg.score, moe_cfg.num_groups, moe_cfg.topk_groups, moe_cfg.routed_scaling) == ("sigmoid", 2, 1, 1.8)
  # transformers' router is V3's whatever config.json says; mlp_layer_types absent: the first layer dense
  other, _ = hf_config.from_hf_config({**hf, "scoring_func": "softmax", "topk_method": "greedy"})
  default, _ = hf_config.from_hf_config({k: v for k, v in hf.items() if k != "mlp_layer_types"})
  assert other == cfg and default.moe_layers == (False, True, True)
  assert hf_config.to_hf_config(cfg, moe_cfg)["mlp_layer_types"] == ["sparse", "dense", "sparse"]


@pytest.mark.parametrize("family", ["dots1", "glm4_moe_lite", "glm4_moe"])
@pytest.mark.parametrize("field, value", [("score", "softmax"), ("group_score", "max")])
def test_export_refuses_a_router_config_json_cannot_say(family, field, value):
  cfg, moe_cfg = hf_config.from_hf_config(config(family))
  with pytest.raises(ConfigError, match=f"moe.{field}"):
    hf_config.to_hf_config(cfg, dataclasses.replace(moe_cfg, **{field: value}))


def test_dots1_export_refuses_what_its_attention_cannot_say():
  cfg, moe_cfg = hf_config.from_hf_config(config("dots1"))
  for field, value in (("qk_norm", False), ("out_bias", True), ("num_mtp_layers", 1)):
    with pytest.raises(ConfigError, match=field):
      hf_config.to_hf_config(dataclasses.replace(cfg, **{field: value}), moe_cfg)


def test_latent_norms_keep_their_own_eps():
  """MLA's q_a_layernorm and kv_a_layernorm use eps 1e-6 in transformers (and DeepSeek's code) whatever
  rms_norm_eps says; GLM-4.7-Flash's is 1e-5 (with it there, the fixture's logits move by 1e-5 relative)."""
  cfg, _ = hf_config.from_hf_config(config("glm4_moe_lite"))
  assert cfg.rms_eps == 1e-5
  mla = attention.LatentAttention(cfg, 0, rngs=nnx.Rngs(0))
  assert mla.q_a_layernorm.eps == mla.kv_a_layernorm.eps == 1e-6


def test_olmoe_reads_projection_qk_norm_clip_and_unnormalised_softmax_routing():
  cfg, moe_cfg = hf_config.from_hf_config(config("olmoe"))
  assert (cfg.qk_norm, cfg.qk_norm_mode, cfg.clip_qkv, cfg.qkv_bias, cfg.out_bias) == (
    True,
    "projection",
    1.5,
    True,
    True,
  )
  assert cfg.moe_layers == (True,) * 3 and cfg.sliding_window is None and cfg.head_dim == 8
  assert (moe_cfg.score, moe_cfg.renormalize, moe_cfg.num_shared_experts, moe_cfg.d_ff) == ("softmax", False, 0, 24)
  gqa = attention.attention(cfg, 0, rngs=nnx.Rngs(0))  # one norm over all heads: [4 x 8] for q, [2 x 8] for k
  assert gqa.q_norm.weight.shape == (32,) and gqa.k_norm.weight.shape == (16,)


def test_olmoe_clip_qkv_acts(mesh_2x4):
  """The control of the clip: without it the fixture's logits move (the fixture's clip acts on q, k and v)."""
  ref = reference("olmoe")
  model = models.from_hf(str(DATA / "olmoe"), mesh_2x4, model={"clip_qkv": None})
  assert relative_error(np.asarray(model(tiled(ref["tokens"]))[0])[:2], ref["logits"]) > 1e-2


def test_minimax_m2_reads_partial_rope_and_biased_sigmoid_routing():
  hf = config("minimax_m2")
  cfg, moe_cfg = hf_config.from_hf_config(hf)
  assert (cfg.qk_norm_mode, cfg.head_dim, cfg.partial_rotary_factor, cfg.rope_dim, cfg.qkv_bias) == (
    "projection",
    16,
    0.5,
    8,
    False,
  )
  assert (moe_cfg.score, moe_cfg.renormalize, moe_cfg.num_groups, moe_cfg.routed_scaling) == ("sigmoid", True, None, 1)
  assert moe_cfg.bias_update_rate > 0 and cfg.moe_layers == (True,) * 3
  # a config.json of the hub's says rotary_dim, without rope_parameters' partial_rotary_factor
  rope = {k: v for k, v in hf["rope_parameters"].items() if k != "partial_rotary_factor"}
  hub, _ = hf_config.from_hf_config({**hf, "rope_parameters": rope, "rotary_dim": 4})
  assert hub.partial_rotary_factor == 0.25 and hub.rope_dim == 4


@pytest.mark.parametrize(
  "family, field, value",
  [
    ("olmoe", "qk_norm_mode", "head"),
    ("olmoe", "head_dim", 16),
    ("olmoe", "sliding_window", 4),
    ("olmoe", "out_bias", False),
    ("minimax_m2", "qkv_bias", True),
    ("minimax_m2", "clip_qkv", 2.0),
    ("minimax_m2", "moe.score", "softmax"),
    ("minimax_m2", "moe.bias_update_rate", 0.0),
  ],
)
def test_projection_qk_norm_export_refuses_what_config_json_cannot_say(family, field, value):
  check_export_refuses(config(family), field, value)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["olmoe", "minimax_m2"])
def test_projection_qk_norm_under_tensor_parallelism(devices, family):
  """Heads split over 'gpu' (4 nodes x 2 GPUs): the norm over the whole projection still spans every head, so the
  logits stay transformers'."""
  check_under_tensor_parallelism(family)
