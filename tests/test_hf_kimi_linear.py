"""Kimi Linear against transformers: layers of two token mixers under `self_attn` (`DecoderConfig.mixers`): Kimi delta
attention (`kimi_delta`: the delta rule with a decay per key channel, `moejax.models.kimi_delta_attention`) between
MLA layers without RoPE (`nope_layers`), a dense first layer, then DeepSeek-V3's router with a shared expert. The
fixture (tests/data/hf/kimi_linear, transformers' KimiLinearForCausalLM: layer_types [linear, full] x 2, 16 experts
top-4 in 4 groups, the published tensor names) gives logits on the 2 x 4 mesh scanned and unrolled under another MoE
path, the routers' choices, greedy tokens through the cache (KDA layers cache their convolution's inputs and state, MLA
layers the latent and the unrotated shared key), and the checkpoint written back bit for bit; the export loads back in
transformers with the fixture's logits (`make_hf_fixtures.py --check-export kimi_linear`, docs/models.md). Here too
what its config.json says its own way (KimiLinearConfig's attribute_map names, the published linear_attn_config).
"""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import moejax.infer as infer
import moejax.models as models
from moejax.models import hf_config, token_mixers
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError
from tests.helpers import relative_error
from tests.test_hf_models import DATA, TOL, assert_states_equal, group, model_state, reference, tiled

FAMILY = "kimi_linear"
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
FIELDS = (  # config.json fields transformers' KimiLinearConfig reads, beyond the shapes every family has
  "q_lora_rank",
  "kv_lora_rank",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
  "num_experts",
  "num_experts_per_token",
  "moe_intermediate_size",
  "num_shared_experts",
  "routed_scaling_factor",
  "moe_renormalize",
  "num_expert_group",
  "topk_group",
  "mlp_layer_types",
  "layer_types",
  "linear_num_heads",
  "linear_head_dim",
  "linear_conv_kernel_dim",
  "model_max_length",
  "rms_norm_eps",
  "intermediate_size",
)
pytestmark = group(FAMILY)


def config() -> dict:
  return json.loads((DATA / FAMILY / "config.json").read_text())


@pytest.fixture(scope="module")
def model(mesh_2x4):
  return models.from_hf(str(DATA / FAMILY), mesh_2x4)


def check_against_reference(model, ref):
  logits, aux = model(tiled(ref["tokens"]), details=True)
  logits = np.asarray(logits)
  for copy in range(logits.shape[0] // 2):  # every copy of the batch, wherever its rows live on the mesh
    assert relative_error(logits[2 * copy : 2 * copy + 2], ref["logits"]) < TOL, copy
  tokens = ref["router_ids"].shape[1]
  np.testing.assert_array_equal(np.sort(np.asarray(aux["expert_ids"])[:, :tokens], axis=-1), ref["router_ids"])
  assert np.all(np.asarray(aux["tokens_dropped"]) == 0)


def test_reads_its_config_and_refuses_what_it_cannot_say():
  """layer_types as mixers (both under self_attn), every layer NoPE, the linear sizes, DeepSeek-V3's routing from
  KimiLinearConfig's names; the published linear_attn_config (1-indexed layers) reads the same; the export refuses
  RoPE, another mixer, MTP modules and a router its config.json cannot say."""
  cfg, moe_cfg = hf_config.from_hf_config(config())
  assert cfg.mixers == ("kimi_delta", "attention") * 2 and cfg.nope_layers == (True,) * 4
  assert [token_mixers.of(cfg, i).hf_module for i in range(4)] == ["self_attn"] * 4
  assert (cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel, cfg.max_len) == (4, 8, 4, 64)
  assert cfg.latent and cfg.moe_layers == (False, True, True, True) and cfg.num_mtp_layers == 0
  routing = (moe_cfg.score, moe_cfg.num_groups, moe_cfg.topk_groups, moe_cfg.top_k, moe_cfg.routed_scaling)
  assert routing == ("sigmoid", 4, 2, 4, 2.5) and moe_cfg.renormalize and moe_cfg.num_shared_experts == 1
  sizes = ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "layer_types", "mlp_layer_types")
  published = {k: v for k, v in config().items() if k not in sizes}
  published |= {
    "first_k_dense_replace": 1,
    "linear_attn_config": {
      "num_heads": 4,
      "head_dim": 8,
      "short_conv_kernel_size": 4,
      "kda_layers": [1, 3],
      "full_attn_layers": [2, 4],
    },
  }
  assert hf_config.from_hf_config(published) == (cfg, moe_cfg)
  for name, value in (("nope_layers", None), ("num_mtp_layers", 1)):
    with pytest.raises(ConfigError, match=name):
      hf_config.to_hf_config(dataclasses.replace(cfg, **{name: value}), moe_cfg)
  with pytest.raises(ConfigError, match="mixers"):
    hf_config.to_hf_config(dataclasses.replace(cfg, mixers=("gated_deltanet", "attention") * 2), moe_cfg)
  with pytest.raises(ConfigError, match="score"):
    hf_config.to_hf_config(cfg, dataclasses.replace(moe_cfg, score="softmax"))
  with pytest.raises(ConfigError, match="linear_num_value_heads"):
    dataclasses.replace(cfg, linear_num_key_heads=2)


@pytest.mark.slow
def test_logits_and_routing_match_transformers(model):
  """Scanned (the default)."""
  assert model.cfg.scan_layers
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_unrolled_under_another_path(mesh_2x4):
  other = models.from_hf(str(DATA / FAMILY), mesh_2x4, moe=OTHER_PATH, model={"scan_layers": False})
  assert all(getattr(other.moe_cfg, name) == value for name, value in OTHER_PATH.items())
  check_against_reference(other, reference(FAMILY))


@pytest.mark.slow
def test_greedy_generation_matches_transformers(model):
  ref = reference(FAMILY)
  prompt, greedy = ref["prompt"], ref["greedy"]
  np.testing.assert_array_equal(infer.generate_tokens(model, prompt, greedy.shape[1] - prompt.shape[1]), greedy)


@pytest.mark.slow
def test_round_trip(model, tmp_path, mesh_2x4):
  """The export holds the fixture's tensors bit for bit under the published names (block_sparse_moe, w1/w2/w3,
  q/k/v_conv1d), and the config.json fields transformers reads; loaded again, the same parameters."""
  out = str(tmp_path / "export")
  models.to_hf(model, out)
  fixture, written = load_file(DATA / FAMILY / "model.safetensors"), load_file(os.path.join(out, "model.safetensors"))
  assert sorted(written) == sorted(fixture)
  for name, tensor in fixture.items():
    assert written[name].dtype == tensor.dtype and np.array_equal(written[name], tensor), name
  want, got = config(), json.loads(open(os.path.join(out, "config.json")).read())
  for name in ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers") + FIELDS:
    assert got[name] == want[name], name
  assert_states_equal(model_state(models.from_hf(out, mesh_2x4)), model_state(model))


@pytest.mark.slow
def test_under_tensor_parallelism():
  """Heads split over 'gpu' (4 nodes x 2 GPUs): the KDA layers' q, k, v and o projections by heads as attention's
  names say, the rest replicated; the logits stay transformers'."""
  model = models.from_hf(str(DATA / FAMILY), mesh_lib.make_mesh(4, 2), model=dict(tensor_parallel=True))
  ref = reference(FAMILY)
  logits = np.asarray(jax.jit(lambda t: model(t)[0])(tiled(ref["tokens"])))
  assert relative_error(logits[:2], ref["logits"]) < TOL
