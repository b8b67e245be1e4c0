"""The sweep's decoder point models (moejax.study.point_models): the DeepSeek-V3- and Qwen3-MoE-shaped models a
measured point trains, scaled from the published shapes; the parameters a modelled point's step all-reduces, against
the parameter trees moejax.models builds for them (an independent count, leaf by leaf); its FLOPs outside the MoE
layers, against XLA's count of the built model's forward."""

import dataclasses

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import scaling_default
from moejax.models.presets import PUBLISHED
from moejax.models.state import abstract_state
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.study import point_models, sweep_timing
from moejax.study.points import Point, validate
from moejax.validation import ConfigError
from tests import point_model_checks

FAMILY_MOE = {"deepseek_v3": dict(top_k=2, num_shared_experts=1, gated=True), "qwen3_moe": dict(top_k=2, gated=True)}


def _config(family: str, d_model: int) -> ml_collections.ConfigDict:
  config = scaling_default.get_config()
  config.update(nodes=(1,), gpus_per_node=(2,), schemes=("flat_dropless",), scalings=("weak",))
  config.models = ml_collections.ConfigDict(
    {
      "dec": dict(
        family=family,
        d_model=d_model,
        d_ff=32,
        layers=3,
        moe_layers=2,
        seq_len=16,
        micro_batch=2,
        vocab=128,
        moe=FAMILY_MOE[family],
      )
    }
  )
  return config


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_dense_parameters_are_the_built_model_less_its_routed_experts(devices, family):
  config = _config(family, d_model=64)
  validate(config)
  point_model_checks.check_dense_parameters(config)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_the_decoder_is_the_published_shape_at_the_sweep_width(family):
  published = PUBLISHED[family]
  quarter = published.moe["d_model"] // 4
  cfg = point_models.training_model(_config(family, quarter).models.dec, "float32")
  shape = published.model
  assert (cfg.family, cfg.d_model, cfg.num_layers, cfg.moe_layers) == (family, quarter, 3, (False, True, True))
  assert cfg.num_heads == round(shape["num_heads"] / 4) and cfg.d_ff == round(shape["d_ff"] / 4)
  assert cfg.num_heads % cfg.num_kv_heads == 0 and cfg.num_kv_heads <= max(1, round(shape["num_kv_heads"] / 4))
  for field in ("q_lora_rank", "kv_lora_rank"):
    if field in shape:
      assert getattr(cfg, field) == round(shape[field] / 4)
  for field in point_models.DECODER_FIELDS:
    if field in shape:
      assert getattr(cfg, field) == shape[field], field
  assert point_models.optimizer(_config(family, 64).models.dec)["name"] == "adamw"


def test_a_family_the_sweep_lacks_is_named():
  config = _config("qwen3_moe", 64)
  config.models.dec.family = "mixtral"
  with pytest.raises(ConfigError) as error:
    validate(config)
  assert error.value.field == "models.dec.family" and "mixtral" in str(error.value)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_forward_flops_match_xla_count_of_the_decoder_without_moe_layers(devices, family):
  """XLA computes every attention score and masks the upper half after, where the model counts the causal half: its
  count is the model's plus that half, and a few percent of elementwise work (norms, rope, softmax). Unrolled layers:
  XLA's cost analysis counts a scanned body once."""
  model = ml_collections.ConfigDict(
    dict(family=family, d_model=256, d_ff=64, layers=2, moe_layers=0, seq_len=64, micro_batch=2, vocab=512)
  )
  cfg = dataclasses.replace(point_models.training_model(model, "float32"), scan_layers=False)
  graphdef, params, rest = abstract_state(
    cfg, MoEConfig(num_experts=1, top_k=1, d_model=256, d_ff=64), mesh_lib.make_mesh(1, 1)
  )
  forward = lambda p, r, tokens: nnx.merge(graphdef, p, r)(tokens)[0]
  cost = jax.jit(forward).lower(params, rest, jax.ShapeDtypeStruct((2, 64), np.int32)).compile().cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
  qk, v = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim) if cfg.latent else (cfg.head_dim,) * 2
  masked_half = cfg.num_layers * 2 * (2 * 64) * 64 * cfg.num_heads * (qk + v) / 2
  want = point_models.forward_flops(model, True) + masked_half
  assert want <= xla < 1.05 * want, (xla, want)


@pytest.mark.slow  # compiles a decoder's training step: about 10 s each on 2 cores
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_a_measured_point_trains_the_decoder(devices, family):
  """The step a measured point times: the counted model, its next-token loss about ln(vocab) at initialisation and
  falling under AdamW."""
  config = _config(family, d_model=64)
  config.measure.update(platform="cpu", warmup=1, repeats=1, max_repeats=1, layer_max_repeats=1)
  timed = sweep_timing.training_step(Point("flat_dropless", 1, 2, "dec", "weak", "measured"), config, devices[:2])
  assert timed["parameters"] == sum(point_model_checks.built_tree(config).values())
  losses = timed["losses"]
  assert abs(losses[0] - np.log(config.models.dec.vocab)) < 0.3 and losses[-1] < losses[0] - 0.1, losses
