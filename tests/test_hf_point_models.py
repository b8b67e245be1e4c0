"""The sweep's point models of the 2026 families (moejax.study.hf_point_models): the decoder a point builds is the
record's (transformers' own config) at the sweep's width and layers; the parameters a modelled step all-reduces
against the parameter tree moejax.models builds for it; its forward FLOPs against the weights every token meets and,
for plain attention, the count written out from the shapes."""

import math

import ml_collections
import numpy as np
import pytest

from configs import scaling_default, scaling_presets
from moejax.models import hf_config, hf_shaped
from moejax.moe.config import MoEConfig
from moejax.study import memory_leaves, point_models, sweep_timing
from moejax.study.points import Point, validate
from moejax.validation import ConfigError
from tests import point_model_checks

FAMILIES = hf_shaped.FAMILIES


def _tiny(family: str):
  return hf_config.from_hf_config(hf_shaped.record(family)["tiny"])[0]


def _config(family: str, layers: int = 5, d_model: int = 48, shape: str = "tiny") -> ml_collections.ConfigDict:
  """A sweep of one model: `family`'s record `shape` at width d_model (the published one's own for 'published')
  with `layers` layers, 2 experts a device."""
  record = hf_config.from_hf_config(hf_shaped.record(family)["config" if shape == "published" else "tiny"])[0]
  pattern, d_model = record.moe_layers, record.d_model if shape == "published" else d_model
  moe_layers = sum(pattern[i % len(pattern)] for i in range(layers))
  config = scaling_default.get_config()
  config.update(nodes=(1,), gpus_per_node=(2,), schemes=("flat_dropless",), scalings=("weak",))
  model = dict(family=family, shape=shape, d_model=d_model, d_ff=16, layers=layers, moe_layers=moe_layers)
  model.update(seq_len=16, micro_batch=2, vocab=128, moe=dict(top_k=2, num_shared_experts=1, gated=True))
  config.models = ml_collections.ConfigDict({"dec": model})
  return config


def test_the_decoder_is_the_records_at_the_sweeps_width_and_layers():
  config = _config("deepseek_v4", layers=6)
  validate(config)
  tiny, cfg = _tiny("deepseek_v4"), point_models.training_model(config.models.dec, "float32")
  assert (cfg.d_model, cfg.num_layers, cfg.vocab_size, cfg.max_len) == (48, 6, 128, 16)
  assert cfg.moe_layers == (tiny.moe_layers * 2)[:6] and cfg.mixers == (tiny.mixers * 2)[:6]
  assert cfg.hash_layers is None and cfg.num_mtp_layers == 0  # the sweep's routing in every MoE layer
  fields, published = dict(cfg.deepseek_v4), dict(tiny.deepseek_v4)
  assert fields["hidden_size"] == "48" and fields["compress_rates"] == published["compress_rates"]
  types = published["layer_types"][1:-1].split(", ")
  assert fields["layer_types"] == "[" + ", ".join((types * 2)[:6]) + "]"
  for field in ("num_heads", "head_dim", "d_ff", "kv_lora_rank", "linear_num_value_heads"):
    assert getattr(cfg, field) == getattr(tiny, field), field  # the mixers and dense FFN as the record's


def test_the_records_moe_layers_and_shape_are_required():
  config = _config("qwen3_5_moe")
  config.models.dec.moe_layers -= 1
  with pytest.raises(ConfigError) as error:
    validate(config)
  assert error.value.field == "models.dec.moe_layers" and "qwen3_5_moe" in str(error.value)
  config = _config("qwen3_5_moe")
  config.models.dec.shape = "large"
  with pytest.raises(ConfigError) as error:
    validate(config)
  assert error.value.field == "models.dec.shape" and "'large'" in str(error.value)
  config.models.dec.update(family="qwen3_moe", moe_layers=3)
  with pytest.raises(ConfigError) as error:  # DeepSeek-V3 and Qwen3-MoE are scaled, not read from a record
    validate(config)
  assert error.value.field == "models.dec.shape"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.sampled(3)
def test_dense_parameters_are_the_built_model_less_its_routed_experts(devices, family):
  config = _config(family)
  validate(config)
  point_model_checks.check_dense_parameters(config)


def _matrix_weights(cfg) -> int:
  """Every 2-D weight outside the MoE layers but the embedding (a lookup): each meets every token. The layers' by
  `memory_leaves.layer_leaves` (checked against the built tree above), less a stand-in MoE layer's."""
  stub = MoEConfig(num_experts=1, top_k=1, d_model=cfg.d_model, d_ff=1)
  matrices = lambda leaves: sum(math.prod(x.shape) * x.count for x in leaves if len(x.shape) == 2)
  layers = sum(
    matrices(memory_leaves.layer_leaves(cfg, stub, layer)) - (matrices(memory_leaves.moe_leaves(stub)) if moe else 0)
    for layer, moe in enumerate(cfg.moe_layers)
  )
  return layers + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.sampled(3)
def test_forward_flops_are_each_weight_once_a_token_at_published_widths(family):
  """At published widths the matmuls are nearly all of it: within a few percent of 2 T FLOPs a weight (under for
  MLA's absorbed up-projections, over for the delta rules' chunked state updates); a mixer or layer left out, or
  counted twice, is off by far more."""
  model = _config(family, layers=2, shape="published").models.dec
  cfg, tokens = point_models.training_model(model, "float32"), model.micro_batch * model.seq_len
  flops, weights = point_models.forward_flops(model, True), 2 * tokens * _matrix_weights(cfg)
  assert 0.95 * weights <= flops < 1.1 * weights, (flops, weights)


@pytest.mark.parametrize("family", ["ernie4_5_moe", "minimax_m2", "solar_open", "glm4_moe_lite"])
def test_forward_flops_of_plain_attention_are_its_weights_and_scores(family):
  """XLA computes every score of causal attention (the mask applied after), a few percent of elementwise work
  besides (norms, rope, softmax)."""
  model = _config(family, layers=2, shape="published").models.dec  # published widths: the matmuls dominate
  cfg = point_models.training_model(model, "float32")
  qk, v = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim) if cfg.latent else (cfg.head_dim,) * 2
  tokens = model.micro_batch * model.seq_len
  scores = cfg.num_layers * 2 * tokens * model.seq_len * cfg.num_heads * (qk + v)
  want = 2 * tokens * _matrix_weights(cfg) + scores
  assert want <= point_models.forward_flops(model, True) < 1.05 * want


@pytest.mark.slow  # compiles a decoder's training step: about 30 s on 2 cores
def test_a_measured_point_trains_the_2026_decoder(devices):
  """A measured point's step (DeepSeek-V4: mHC streams, sliding and compressed attention): the counted model, its loss
  about ln(vocab) at initialisation and falling."""
  config = _config("deepseek_v4", layers=4)
  config.measure.update(platform="cpu", warmup=1, repeats=1, max_repeats=1, layer_max_repeats=1)
  timed = sweep_timing.training_step(Point("flat_dropless", 1, 2, "dec", "weak", "measured"), config, devices[:2])
  assert timed["parameters"] == sum(point_model_checks.built_tree(config).values())
  losses = timed["losses"]
  assert abs(losses[0] - np.log(config.models.dec.vocab)) < 0.3 and losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.sampled(3)
def test_each_family_sweeps_at_its_published_shape(family):
  """configs/scaling_presets.py:FAMILY: the published decoder, every layer, and the routed layer's config.json
  fields (checked by the sweep's own validation, which builds the point model)."""
  config = scaling_presets.get_config(family)
  validate(config)
  refused = {"comet"} if family == "llama4" else set()  # weighted inputs: its first GEMM waits for the weights
  assert set(config.schemes) == {"flat_dropless", "hierarchical", "chunked", "comet"} - refused
  cfg, moe = hf_config.from_hf_config(hf_shaped.record(family)["config"])
  model = config.models[family]
  assert (model.d_model, model.d_ff, model.layers, model.vocab) == (
    cfg.d_model,
    moe.d_ff,
    cfg.num_layers,
    cfg.vocab_size,
  )
  assert model.moe_layers == sum(cfg.moe_layers) and config.moe.top_k == moe.top_k
  for field in ("score", "routed_scaling", "num_shared_experts", "zero_experts", "activation"):
    assert config.moe.get(field, getattr(MoEConfig, field, None)) == getattr(moe, field), field
