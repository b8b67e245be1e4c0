"""Llama 4 against transformers: chunked attention in the RoPE layers (`DecoderConfig.chunked_attention`, window =
attention_chunk_size), NoPE layers without RoPE or QK-norm whose queries are tempered (`nope_layers`,
`attn_temperature`), the weightless L2 QK-norm (qk_norm_mode 'l2'), llama3-scaled RoPE in interleaved pairs, dense
layers of intermediate_size_mlp among MoE layers, and the router's sigmoid weight scaling each expert's INPUT
(`MoEConfig.weight_inputs`), plus a shared expert. The fixture (tests/data/hf/llama4, transformers'
Llama4ForConditionalGeneration as Meta publishes it: a vision tower ignored, the decoder under language_model.*, the
experts fused as gate_up_proj [E, d, 2f] and down_proj; 4 layers, chunk 4 under 12 tokens, NoPE layers 1 and 2, MoE
in 1 and 3) gives logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers' choices, greedy
tokens through the cache across chunks, and the decoder written back bit for bit as llama4_text (Llama4ForCausalLM),
which loads back in transformers with the fixture's logits (`make_hf_fixtures.py --check-export llama4`,
docs/models.md). The input-scaled experts equal a float64 NumPy computation from the stored tensors.
"""

import functools

import numpy as np
import pytest
from safetensors.numpy import load_file

import moejax.models as models
from moejax.models import hf_checkpoint, hf_config
from moejax.moe.layer import moe_apply
from moejax.validation import ConfigError
from tests import hf_family_checks as checks
from tests.helpers import relative_error
from tests.hf_family_checks import (
  assert_fields_equal,
  assert_loads_as,
  assert_tensors_equal,
  check_against_reference,
  check_export_refuses,
  check_greedy_generation,
  exported,
  from_hf_under,
)
from tests.test_hf_models import DATA, group, reference, tiled

FAMILY = "llama4"
OTHER_PATH = {"path": "node_first", "dedup": True, "schedule": "chunked", "num_chunks": 2, "buffer_factor": 4.0}
FIELDS = (  # config.json fields transformers' Llama4TextConfig reads, beyond the shapes every family has
  "intermediate_size",
  "intermediate_size_mlp",
  "num_local_experts",
  "num_experts_per_tok",
  "moe_layers",
  "no_rope_layers",
  "attention_chunk_size",
  "layer_types",
  "use_qk_norm",
  "attn_temperature_tuning",
  "floor_scale",
  "attn_scale",
  "attention_bias",
  "rope_parameters",
)
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)


def text_config() -> dict:
  return config()["text_config"]


model = checks.model_fixture(FAMILY)


@pytest.mark.slow
def test_logits_and_routing_match_transformers(model):
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_unrolled_under_another_path(mesh_2x4):
  other = from_hf_under(FAMILY, mesh_2x4, OTHER_PATH, model={"scan_layers": False})
  check_against_reference(other, reference(FAMILY))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["vanilla", "exflow"])
def test_greedy_generation_matches_transformers(model, mode):
  """13 positions through the cache: the chunked layers' queries from position 4 and 8 on see only their chunk; ExFlow's
  decode step too (its experts scale the rows they receive by the weights that travel with them)."""
  check_greedy_generation(model, FAMILY, mode=mode)


@pytest.mark.slow
@pytest.mark.parametrize(
  "override", [{"chunked_attention": False}, {"attn_temperature": None}, {"qk_norm": False}], ids=str
)
def test_each_feature_acts(mesh_2x4, override):
  """The controls: without the chunks, the NoPE layers' temperature or the L2 QK-norm the logits are others."""
  ref = reference(FAMILY)
  other = models.from_hf(str(DATA / FAMILY), mesh_2x4, model=override)
  assert relative_error(np.asarray(other(tiled(ref["tokens"]), details=True)[0])[:2], ref["logits"]) > 1e-3


def _numpy_moe(tensors: dict, prefix: str, x_TxD: np.ndarray, top_k: int, scale_inputs: bool = True) -> np.ndarray:
  """Llama4TextMoe in float64 from the stored tensors: experts on x * sigmoid(chosen logit) (or, the control, their
  outputs scaled), summed, plus the shared expert."""
  f64 = lambda name: tensors[f"{prefix}.{name}"].astype(np.float64)
  silu = lambda a: a / (1 + np.exp(-a))
  gate_up, down = f64("experts.gate_up_proj"), f64("experts.down_proj")  # [E, d, 2f], [E, f, d]
  width = down.shape[1]
  logits_TxE = x_TxD @ f64("router.weight").T
  y_TxD = np.zeros_like(x_TxD)
  for t, logits_E in enumerate(logits_TxE):
    for e in np.argsort(-logits_E)[:top_k]:
      w = 1 / (1 + np.exp(-logits_E[e]))
      h = (w if scale_inputs else 1.0) * x_TxD[t] @ gate_up[e]
      y_TxD[t] += (silu(h[:width]) * h[width:]) @ down[e] * (1.0 if scale_inputs else w)
  shared = lambda name: f64(f"shared_expert.{name}.weight")
  return y_TxD + (silu(x_TxD @ shared("gate_proj").T) * (x_TxD @ shared("up_proj").T)) @ shared("down_proj").T


def test_input_scaled_experts_equal_numpy_float64(model, mesh_2x4):
  """Layer 1's MoE (router, fused experts read as blocks of gate_up_proj, shared expert) on random tokens equals
  Llama4TextMoe in float64 NumPy; scaling the outputs instead is another function (the control)."""
  tensors = load_file(DATA / FAMILY / "model.safetensors")
  x_TxD = np.random.default_rng(0).normal(size=(16, 32))
  moe = model.blocks[1].ffn.moe
  y_TxD, _ = moe_apply(moe.params(), x_TxD.astype(np.float32), model.moe_cfg, mesh_2x4)
  prefix = "language_model.model.layers.1.feed_forward"
  want = _numpy_moe(tensors, prefix, x_TxD, model.moe_cfg.top_k)
  assert relative_error(np.asarray(y_TxD), want) < 1e-5
  assert relative_error(_numpy_moe(tensors, prefix, x_TxD, model.moe_cfg.top_k, scale_inputs=False), want) > 1e-2


@pytest.mark.slow
def test_round_trip(model, tmp_path, mesh_2x4):
  """The export is the decoder as llama4_text (Llama4ForCausalLM's names: model.*, lm_head), its tensors the
  fixture's bit for bit, no vision tensor; config.json's fields transformers reads; loaded again, the same
  parameters."""
  out, fixture, written, got = exported(model, tmp_path, FAMILY)
  decoder = {name.removeprefix("language_model."): t for name, t in fixture.items() if name.startswith("language_")}
  assert_tensors_equal(written, decoder)
  assert (got["model_type"], got["architectures"]) == ("llama4_text", ["Llama4ForCausalLM"])
  assert_fields_equal(got, text_config(), ("vocab_size", "hidden_size", "num_hidden_layers") + FIELDS)
  assert_loads_as(out, mesh_2x4, model)


@pytest.mark.slow
def test_reads_chunks_nope_layers_and_input_scaled_routing():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  assert (cfg.family, cfg.moe_layers, cfg.d_ff) == ("llama4", (False, True, False, True), 48)
  assert (cfg.sliding_window, cfg.sliding_layers, cfg.chunked_attention) == (4, (True, False, False, True), True)
  assert (cfg.nope_layers, cfg.attn_temperature) == ((False, True, True, False), (4.0, 0.5))
  assert (cfg.qk_norm, cfg.qk_norm_mode, cfg.rope_interleaved, cfg.scaling["rope_type"]) == (1, "l2", 1, "llama3")
  routing = (moe_cfg.score, moe_cfg.renormalize, moe_cfg.weight_inputs, moe_cfg.num_shared_experts)
  assert routing == ("sigmoid", False, True, 1)
  assert (moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.d_ff, moe_cfg.shared_width) == (8, 2, 16, 16)
  key = lambda *path: hf_checkpoint.hf_key(("blocks", 1, "ffn", "moe", *path), cfg)[0]
  prefix = "language_model.model.layers.1.feed_forward"
  assert key("w_gate") == f"{prefix}.experts.gate_up_proj#<0>/2" and key("w_out") == f"{prefix}.experts.down_proj"
  assert key("router", "kernel") == f"{prefix}.router.weight"
  assert hf_checkpoint.hf_key(("blocks", 0, "ffn", "gate_proj", "kernel"), cfg)[0].endswith(
    "0.feed_forward.gate_proj.weight"
  )


@pytest.mark.slow
def test_defaults_are_llama4_text_configs():
  """What config.json leaves out is Llama4TextConfig's: MoE in every layer, every 4th layer NoPE, the others chunked
  by 8192, temperature floor 8192 and scale 0.1, theta 5e5, top-1."""
  hf = {k: v for k, v in text_config().items() if k not in ("moe_layers", "no_rope_layers", "layer_types")}
  absent = ("attention_chunk_size", "floor_scale", "attn_scale", "rope_parameters", "num_experts_per_tok")
  hf = {k: v for k, v in hf.items() if k not in absent + ("interleave_moe_layer_step",)}
  cfg, moe_cfg = hf_config.from_hf_config(hf)
  assert (cfg.family, cfg.moe_layers, cfg.nope_layers) == ("llama4_text", (True,) * 4, (False, False, False, True))
  assert (cfg.sliding_window, cfg.sliding_layers, cfg.attn_temperature) == (8192, (True,) * 3 + (False,), (8192, 0.1))
  assert (cfg.rope_theta, moe_cfg.top_k) == (5e5, 1)
  # as Scout's config.json says them: no_rope_layers [] (the default's), attn_temperature_tuning 4 (true)
  assert hf_config.from_hf_config({**hf, "no_rope_layers": [], "attn_temperature_tuning": 4})[0] == cfg


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value",
  [("rope_interleaved", False), ("qk_norm_mode", "head"), ("moe.weight_inputs", False), ("moe.renormalize", True)],
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)


@pytest.mark.slow
@pytest.mark.parametrize("moe, field", [({"schedule": "comet"}, "schedule"), ({"ffn_bias": True}, "ffn_bias")])
def test_input_weights_refuse_what_cannot_carry_them(moe, field):
  """comet runs the first GEMM before the weights are gathered; expert biases make a zero weight's output nonzero."""
  with pytest.raises(ConfigError, match=field):
    hf_config.from_hf_config(config(), moe=moe)
