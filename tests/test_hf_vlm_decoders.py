"""The vision-language families of issue 59, whose text decoder moejax runs on text-only input, against transformers'
ForConditionalGeneration class given input_ids alone: qwen3_5_moe (Qwen3-Next's hybrid decoder under
model.language_model, interleaved multimodal RoPE, the DeltaNet's projections apart), kimi_k25 (DeepSeek-V3's decoder
behind a vision tower and projector), qwen3_vl_moe and glm4v_moe (Qwen3-MoE's and GLM-4.5's decoders under
model.language_model) and qwen3_omni_moe (Qwen3-MoE's decoder in Qwen3-Omni's thinker, beside its audio and vision
encoders; the reference is the thinker's forward). Each fixture (tests/data/hf/<family>, transformers' own class with
1-layer encoders) gives its logits on the 2 x 4 mesh under the default MoE path and another, the routers' choices and
greedy tokens, its encoders' tensors ignored; the export is the decoder alone, as its text-only class's checkpoint
(qwen3_5_moe_text, deepseek_v3, qwen3_moe, glm4_moe), which loads back in moejax with the same parameters and in
transformers with the fixture's logits (`make_hf_fixtures.py --check-export`, docs/models.md).
"""

import dataclasses
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moejax.models as models
from moejax.models import hf_config, token_mixers
from moejax.validation import ConfigError
from tests.hf_family_checks import (
  assert_tensors_equal,
  check_against_reference,
  check_greedy_generation,
  check_logits_and_routing,
  config,
  exported,
  from_hf_under,
)
from tests.test_hf_models import (
  DATA,
  Loaded,
  assert_states_equal,
  case,
  fixture_copy,
  group,
  model_state,
  reference,
  refused,
)

FAMILIES = ("qwen3_5_moe", "kimi_k25", "qwen3_vl_moe", "glm4v_moe", "qwen3_omni_moe")
OTHER_PATH = {
  "qwen3_5_moe": {"path": "node_first", "dedup": True, "buffer_factor": 4.0},
  "kimi_k25": {"path": "node_first", "buffer_factor": 4.0},
  "qwen3_vl_moe": {"path": "gpu_first", "collective": "capacity", "capacity_factor": 8.0},
  "glm4v_moe": {"path": "node_first", "dedup": True, "buffer_factor": 4.0},
  "qwen3_omni_moe": {"path": "gpu_first", "buffer_factor": 4.0},
}
# The decoder's prefix in each fixture, and in its export (the text-only class's checkpoint).
PREFIX = {
  "qwen3_5_moe": ("model.language_model.", "model.language_model."),
  "kimi_k25": ("language_model.", ""),
  "qwen3_vl_moe": ("model.language_model.", "model."),
  "glm4v_moe": ("model.language_model.", "model."),
  "qwen3_omni_moe": ("thinker.model.", "model."),
}
HEAD = {
  "qwen3_5_moe": ("lm_head.weight", "lm_head.weight"),
  "kimi_k25": ("language_model.lm_head.weight", "lm_head.weight"),
  "qwen3_vl_moe": ("lm_head.weight", "lm_head.weight"),
  "glm4v_moe": ("lm_head.weight", "lm_head.weight"),
  "qwen3_omni_moe": ("thinker.lm_head.weight", "lm_head.weight"),
}
EXPORTED = {
  "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
  "kimi_k25": ("deepseek_v3", "DeepseekV3ForCausalLM"),
  "qwen3_vl_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
  "glm4v_moe": ("glm4_moe", "Glm4MoeForCausalLM"),
  "qwen3_omni_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


@pytest.fixture(scope="module")
def loaded(mesh_2x4):
  return Loaded(mesh_2x4)


@group("qwen3_5_moe")
def test_qwen3_5_moe_logits_and_routing_match_transformers(loaded):
  """The decoder of text_config: Qwen3-Next's layers with the DeltaNet's projections apart, every layer MoE,
  renormalised top-k; the interleaved multimodal RoPE (mrope_section [2, 1, 1]) on text is the partial RoPE of
  head_dim x 0.5. The vision tower's tensors (model.visual.*) are in the checkpoint and ignored."""
  cfg, moe_cfg = loaded.model("qwen3_5_moe").cfg, loaded.model("qwen3_5_moe").moe_cfg
  assert cfg.mixers == ("gated_deltanet", "attention") * 2 and cfg.linear_split_projections
  assert (cfg.partial_rotary_factor, cfg.rope_dim, cfg.rope_scaling, cfg.tie_embeddings) == (0.5, 8, None, False)
  assert cfg.moe_layers == (True,) * 4 and cfg.d_ff == moe_cfg.d_ff == 16
  assert (moe_cfg.renormalize, moe_cfg.num_shared_experts, moe_cfg.shared_gate, moe_cfg.top_k) == (True, 1, True, 2)
  assert [token_mixers.of(cfg, i).hf_module for i in range(4)] == ["linear_attn", "self_attn"] * 2
  assert any(name.startswith("model.visual.") for name in load_file(DATA / "qwen3_5_moe" / "model.safetensors"))
  check_logits_and_routing(*loaded.forward("qwen3_5_moe"), reference("qwen3_5_moe"))


@group("kimi_k25")
def test_kimi_k25_logits_and_routing_match_transformers(loaded):
  """DeepSeek-V3's decoder of text_config (MLA, YaRN, sigmoid routing with the bias, one group), its tensors under
  language_model.*, the vision tower's and projector's ignored; the head untied as the top level says."""
  cfg, moe_cfg = loaded.model("kimi_k25").cfg, loaded.model("kimi_k25").moe_cfg
  assert cfg.latent and cfg.moe_layers == (False, True, True) and not cfg.tie_embeddings
  assert (moe_cfg.score, moe_cfg.num_groups, moe_cfg.routed_scaling, moe_cfg.num_shared_experts) == (
    "sigmoid",
    None,
    2.5,
    1,
  )
  check_logits_and_routing(*loaded.forward("kimi_k25"), reference("kimi_k25"))


@group("qwen3_vl_moe")
def test_qwen3_vl_moe_logits_and_routing_match_transformers(loaded):
  """Qwen3-MoE's decoder of text_config (its layer 1 dense by mlp_only_layers), the top k always renormalised, the
  experts stacked as transformers' save_pretrained writes them ([E, 2f, d] and [E, d, f]); the interleaved
  multimodal RoPE (mrope_section [4, 2, 2]) on text is plain RoPE. The vision tower's tensors are ignored."""
  cfg, moe_cfg = loaded.model("qwen3_vl_moe").cfg, loaded.model("qwen3_vl_moe").moe_cfg
  assert cfg.moe_layers == (True, False, True) and cfg.qk_norm and not cfg.tie_embeddings
  assert (moe_cfg.renormalize, moe_cfg.num_shared_experts, moe_cfg.top_k, moe_cfg.d_ff) == (True, 0, 4, 24)
  stored = load_file(DATA / "qwen3_vl_moe" / "model.safetensors")
  assert stored["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (16, 48, 32)
  assert any(name.startswith("model.visual.") for name in stored)
  check_logits_and_routing(*loaded.forward("qwen3_vl_moe"), reference("qwen3_vl_moe"))


@group("glm4v_moe")
def test_glm4v_moe_logits_and_routing_match_transformers(loaded):
  """GLM-4.5's decoder of text_config without QK-norm nor MTP (a dense first layer, DeepSeek-V3's routing with the
  bias in 4 groups, a shared expert, q, k, v biases); the sectioned multimodal RoPE (mrope_section [2, 1, 1]) on text
  is the partial RoPE of head_dim x 0.5. The vision tower's tensors are ignored."""
  cfg, moe_cfg = loaded.model("glm4v_moe").cfg, loaded.model("glm4v_moe").moe_cfg
  assert cfg.moe_layers == (False, True, True) and not cfg.qk_norm and cfg.num_mtp_layers == 0
  assert (cfg.partial_rotary_factor, cfg.rope_dim, cfg.qkv_bias, cfg.out_bias, cfg.tie_embeddings) == (
    0.5,
    8,
    True,
    False,
    False,
  )
  assert (moe_cfg.score, moe_cfg.num_groups, moe_cfg.routed_scaling, moe_cfg.num_shared_experts) == (
    "sigmoid",
    4,
    2.5,
    1,
  )
  check_logits_and_routing(*loaded.forward("glm4v_moe"), reference("glm4v_moe"))


@group("qwen3_omni_moe")
def test_qwen3_omni_moe_logits_and_routing_match_transformers(loaded):
  """The thinker's decoder (thinker_config.text_config): Qwen3-MoE's layers (layer 1 dense by mlp_only_layers), the
  top k not renormalised (norm_topk_prob false); the multimodal RoPE on text is plain RoPE. The audio encoder's and
  vision tower's tensors are ignored."""
  cfg, moe_cfg = loaded.model("qwen3_omni_moe").cfg, loaded.model("qwen3_omni_moe").moe_cfg
  assert cfg.moe_layers == (True, False, True) and cfg.qk_norm and not cfg.tie_embeddings
  assert (moe_cfg.renormalize, moe_cfg.num_shared_experts, moe_cfg.top_k, moe_cfg.d_ff) == (False, 0, 4, 24)
  stored = load_file(DATA / "qwen3_omni_moe" / "model.safetensors")
  assert any(name.startswith("thinker.audio_tower.") for name in stored)
  assert any(name.startswith("thinker.visual.") for name in stored)
  check_logits_and_routing(*loaded.forward("qwen3_omni_moe"), reference("qwen3_omni_moe"))


@pytest.mark.slow
def test_glm4v_moe_ignores_the_published_mtp_layer(tmp_path, mesh_2x4):
  """The published GLM-4.5V holds its MTP layer's tensors (model.language_model.layers.46.*), which transformers
  ignores on load (`_keys_to_ignore_on_load_unexpected`) and so does moejax; another layer's extra tensor is refused."""
  directory = fixture_copy(tmp_path, "glm4v_moe")
  path = os.path.join(directory, "model.safetensors")
  tensors = load_file(path)
  mtp = {"model.language_model.layers.46.eh_proj.weight": np.ones((32, 64), np.float32)}
  save_file({**tensors, **mtp}, path)
  check_against_reference(models.from_hf(directory, mesh_2x4), reference("glm4v_moe"))
  save_file({**tensors, "model.language_model.layers.45.eh_proj.weight": np.ones((32, 64), np.float32)}, path)
  assert "layers.45" in refused(directory, mesh_2x4)


@pytest.mark.slow
@group("qwen3_vl_moe")
def test_qwen3_vl_moe_reads_the_hubs_expert_layout(tmp_path, mesh_2x4):
  """The published checkpoints hold the experts as [E, d, 2f] and [E, f, d] (transformers' loader transposes them to
  its modules'): the fixture's experts so transposed give the same logits."""
  directory = fixture_copy(tmp_path, "qwen3_vl_moe")
  path = os.path.join(directory, "model.safetensors")
  tensors = load_file(path)
  experts = [n for n in tensors if ".mlp.experts." in n]
  assert len(experts) == 4
  save_file({n: np.ascontiguousarray(t.transpose(0, 2, 1)) if n in experts else t for n, t in tensors.items()}, path)
  check_against_reference(models.from_hf(directory, mesh_2x4), reference("qwen3_vl_moe"))


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_logits_under_another_path(mesh_2x4, family):
  check_against_reference(from_hf_under(family, mesh_2x4, OTHER_PATH[family]), reference(family))


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_greedy_generation_matches_transformers(loaded, family):
  """Through the cache (Qwen3.5's DeltaNet states and KV pairs; Kimi's MLA latents), transformers' generate on the
  text-only prompt."""
  check_greedy_generation(loaded.model(family), family)


def _per_expert(name: str, tensor: np.ndarray):
  """(name, tensor) as Qwen3MoeForCausalLM's checkpoint holds it: Qwen3-VL-MoE's stacked experts (transformers'
  modules' layout: gate_up_proj [E, 2f, d], the gate rows first; down_proj [E, d, f]) one torch Linear per expert."""
  if ".mlp.experts.gate_up_proj" in name:
    f = tensor.shape[1] // 2
    for e, weight in enumerate(tensor):
      yield name.replace("gate_up_proj", f"{e}.gate_proj.weight"), weight[:f]
      yield name.replace("gate_up_proj", f"{e}.up_proj.weight"), weight[f:]
  elif ".mlp.experts.down_proj" in name:
    for e, weight in enumerate(tensor):
      yield name.replace("down_proj", f"{e}.down_proj.weight"), weight
  else:
    yield name, tensor


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_export_is_the_text_only_decoder(loaded, tmp_path, family):
  """The export is the decoder alone as its text-only class's checkpoint: the fixture's decoder tensors bit for bit
  under that class's names, no vision tensor, config.json flat (text_config's fields at the top level); moejax loads
  it back (as that family) with the same parameters."""
  model = loaded.model(family)
  out, fixture, written, got = exported(model, tmp_path, family)
  (ours, theirs), (head, exported_head) = PREFIX[family], HEAD[family]
  decoder = dict(
    pair
    for name, tensor in fixture.items()
    if name == head or name.startswith(ours)
    for pair in _per_expert(exported_head if name == head else theirs + name[len(ours) :], tensor)
  )
  left_out = [name for name in fixture if name != head and not name.startswith(ours)]
  assert left_out and not set(left_out) & set(written)  # the vision tensors
  assert_tensors_equal(written, decoder)
  text = config(family).get("thinker_config", config(family))["text_config"]  # Qwen3-Omni's: the thinker's
  assert (got["model_type"], got["architectures"]) == (EXPORTED[family][0], [EXPORTED[family][1]])
  assert not {"text_config", "vision_config", "thinker_config"} & set(got) and got["tie_word_embeddings"] is False
  for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok"):
    assert got[name] == text[name], name
  back = models.from_hf(out, loaded.mesh)
  assert back.cfg.family == EXPORTED[family][0]
  assert_states_equal(model_state(back), model_state(model))


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_other_unexpected_tensors_refused(tmp_path, mesh_2x4, family):
  """Only the vision tower's and projector's tensors (and Qwen3.5's MTP module) are ignored: a tensor elsewhere that
  the config does not name is refused, naming it."""
  directory = fixture_copy(tmp_path, family)
  path = os.path.join(directory, "model.safetensors")
  extra = PREFIX[family][0] + "layers.9.mlp.gate.weight"
  save_file({**load_file(path), extra: np.ones((4, 4), np.float32)}, path)
  assert extra in refused(directory, mesh_2x4)


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_config_json_without_text_config_refused(family):
  hf = config(family)
  if family == "qwen3_omni_moe":  # the decoder's config is the thinker's text_config
    hf = {**hf, "thinker_config": {k: v for k, v in hf["thinker_config"].items() if k != "text_config"}}
    with pytest.raises(ConfigError, match="thinker_config"):
      hf_config.from_hf_config({k: v for k, v in hf.items() if k != "thinker_config"})
  else:
    hf = {k: v for k, v in hf.items() if k != "text_config"}
  with pytest.raises(ConfigError, match="text_config"):
    hf_config.from_hf_config(hf)


@pytest.mark.slow
def test_kimi_k25_ties_the_head_unless_the_top_level_says_not():
  """Kimi_K25Config's tie_word_embeddings defaults to true, and the top level's decides (text_config's is unread);
  Qwen3_5MoeConfig's defaults to false."""
  hf = {k: v for k, v in config("kimi_k25").items() if k != "tie_word_embeddings"}
  assert hf_config.from_hf_config(hf)[0].tie_embeddings
  hf["text_config"] = {**hf["text_config"], "tie_word_embeddings": False}
  assert hf_config.from_hf_config(hf)[0].tie_embeddings
  qwen = {k: v for k, v in config("qwen3_5_moe").items() if k != "tie_word_embeddings"}
  assert not hf_config.from_hf_config(qwen)[0].tie_embeddings


@pytest.mark.slow
def test_qwen3_5_moe_reads_what_transformers_reads():
  """Every layer MoE and the top-k renormalised whatever config.json says (Qwen3.5's decoder has no mlp_only_layers
  nor norm_topk_prob); the rope's mrope_section unread (text-only: plain partial RoPE)."""
  hf = config("qwen3_5_moe")
  text = {**hf["text_config"], "mlp_only_layers": [0], "norm_topk_prob": False}
  cfg, moe_cfg = hf_config.from_hf_config({**hf, "text_config": text})
  assert cfg.moe_layers == (True,) * 4 and moe_cfg.renormalize
  rope = {**text["rope_parameters"], "mrope_section": [1, 1, 2]}
  assert hf_config.from_hf_config({**hf, "text_config": {**text, "rope_parameters": rope}})[0] == cfg
  # its config.json cannot say the DeltaNet's projections grouped (Qwen3-Next's), nor Qwen3-Next's the split ones
  with pytest.raises(ConfigError, match="linear_split_projections"):
    hf_config.to_hf_config(dataclasses.replace(cfg, linear_split_projections=False), moe_cfg)
  with pytest.raises(ConfigError, match="linear_split_projections"):
    hf_config.to_hf_config(dataclasses.replace(cfg, family="qwen3_next"), moe_cfg)


@pytest.mark.slow
def test_kimi_k25_saved_by_transformers_refused_naming_the_tensors(tmp_path, mesh_2x4):
  """transformers 5.24's save_pretrained writes Kimi's decoder layers as language_model.model.blocks.N (its load-time
  rename of the vision tower's blocks, reversed over every key); moejax reads the published layers.N names."""
  directory = fixture_copy(tmp_path, "kimi_k25")
  path = os.path.join(directory, "model.safetensors")
  tensors = load_file(path)
  save_file(
    {k.replace("language_model.model.layers.", "language_model.model.blocks."): v for k, v in tensors.items()}, path
  )
  assert "language_model.model.layers.0." in refused(directory, mesh_2x4)
