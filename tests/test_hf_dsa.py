"""DeepSeek sparse attention (`moejax.models.sparse_attention`, the 'dsa' token mixer) and its families against
transformers: deepseek_v32 (DeepSeek-V3.2: the indexer's RoPE half-split) and glm_moe_dsa (GLM-5: interleaved). The
mixer against a float64 NumPy computation of the indexer's choice and the masked attention, and through its decode
cache; each family's fixture (tests/data/hf/<family>, transformers' own class: 3 layers, index_topk 4 and 5 under the
12 tokens, so the choice acts) gives its logits on the 2 x 4 mesh under the default MoE path and another (unrolled),
the routers' choices, greedy tokens through the cache (the indexer's keys cached beside MLA's rotary key), and the
checkpoint written back bit for bit; the export loads back in transformers with the fixture's logits
(`make_hf_fixtures.py --check-export`, docs/models.md). The control: the same checkpoint with index_topk past the
sequence (dense MLA) gives other logits. glm_moe_dsa_shared (GLM-5's indexer_types [full, shared] x 2) likewise;
its own checks: tests/test_hf_dsa_shared.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moejax.models as models
from moejax.models import hf_config, sparse_attention
from moejax.models.decoder_config import DecoderConfig
from moejax.validation import ConfigError
from tests.helpers import relative_error
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
  tiled,
)

FAMILIES = ("deepseek_v32", "glm_moe_dsa", "glm_moe_dsa_shared")
OTHER_PATH = {
  "deepseek_v32": {"path": "node_first", "dedup": True, "buffer_factor": 4.0},
  "glm_moe_dsa": {"dedup": True},
  "glm_moe_dsa_shared": {"path": "node_first", "dedup": True, "buffer_factor": 4.0},
}
SHARED = "glm_moe_dsa_shared"  # GLM-5's indexer_types [full, shared, full, shared]
V3_ROUTED = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts")
V3_ROUTED += ("routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group", "mlp_layer_types")
MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_parameters")
FIELDS = V3_ROUTED + MLA + ("index_topk", "index_head_dim", "index_n_heads", "layer_types", "rms_norm_eps")


@pytest.fixture(scope="module")
def loaded(mesh_2x4):
  return Loaded(mesh_2x4)


# ---------------------------------------------------------------------------------------------------------------
# The mixer against NumPy (float64)

INDEXER = dict(head_dim=8, heads=8, rope_interleaved=False, topk=3)


def mixer_config(**indexer) -> DecoderConfig:
  pairs = tuple(sorted({**INDEXER, **indexer}.items()))
  return DecoderConfig(
    family="deepseek_v32",
    vocab_size=16,
    num_layers=1,
    d_model=16,
    d_ff=16,
    num_heads=2,
    num_kv_heads=2,
    head_dim=4,
    max_len=32,
    moe_layers=(False,),
    rope_interleaved=True,
    q_lora_rank=12,
    kv_lora_rank=8,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=5,
    mixers=("dsa",),
    indexer=pairs,
  )


def random_mixer(cfg: DecoderConfig, seed: int = 0) -> sparse_attention.SparseAttention:
  """The mixer with every parameter N(0, 0.5^2) (norm weights 1 + that), so that the choice has margins."""
  module = sparse_attention.SparseAttention(cfg, 0, rngs=nnx.Rngs(seed))
  params = nnx.state(module, nnx.Param)
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  draw = lambda a: jnp.asarray(rng.normal(0, 0.5, a.shape) + (a.ndim == 1) * np.asarray(a, float), a.dtype)
  nnx.update(module, jax.tree.unflatten(tree, [draw(a) for a in leaves]))
  return module


def numpy_mixer(module, x_BxSxD: np.ndarray, dense: bool = False):
  """(y [B, S, d], chosen [B, S, S], the smallest gap between the last chosen and first rejected score): the mixer
  in float64 NumPy from its parameters; dense: every causal key (MLA without the indexer)."""
  cfg, ix = module.cfg, module.indexer
  p = lambda m, name="kernel": np.asarray(getattr(m, name)[...], np.float64)
  x = x_BxSxD.astype(np.float64)
  (b, s, _), h, nope, r = x.shape, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
  inverse = 1.0 / cfg.rope_theta ** (np.arange(0, r, 2) / r)
  angles = np.arange(s)[:, None] * inverse[None, :]  # [S, R / 2]
  cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]

  def rotate(a, interleaved):  # [B, S, H, W]: the first R dims rotated (interleaved: evens' results, then odds')
    one, two = (a[..., 0:r:2], a[..., 1:r:2]) if interleaved else (a[..., : r // 2], a[..., r // 2 : r])
    return np.concatenate([one * cos - two * sin, two * cos + one * sin, a[..., r:]], axis=-1)

  rms = lambda a, w: a / np.sqrt(np.mean(a * a, -1, keepdims=True) + 1e-6) * w
  q_latent = rms(x @ p(module.q_a_proj), p(module.q_a_layernorm, "weight"))
  q = rotate((q_latent @ p(module.q_b_proj)).reshape(b, s, h, nope + r)[..., nope:], True)
  q = np.concatenate([(q_latent @ p(module.q_b_proj)).reshape(b, s, h, nope + r)[..., :nope], q], -1)
  compressed = x @ p(module.kv_a_proj_with_mqa)
  latent = rms(compressed[..., : cfg.kv_lora_rank], p(module.kv_a_layernorm, "weight"))
  rotary = rotate(compressed[:, :, None, cfg.kv_lora_rank :], True)
  kv = (latent @ p(module.kv_b_proj)).reshape(b, s, h, nope + cfg.v_head_dim)
  k = np.concatenate([kv[..., :nope], np.broadcast_to(rotary, (b, s, h, r))], -1)
  # the indexer
  iq = rotate((q_latent @ p(ix.wq_b)).reshape(b, s, ix.heads, ix.width), ix.interleaved)
  ik = x @ p(ix.wk)
  ik = (ik - ik.mean(-1, keepdims=True)) / np.sqrt(ik.var(-1, keepdims=True) + 1e-6)
  ik = rotate((ik * p(ix.k_norm, "weight") + p(ix.k_norm, "bias"))[:, :, None], ix.interleaved)[:, :, 0]
  weights = x @ p(ix.weights_proj) * ix.heads**-0.5
  scores = np.einsum("bsh,bsht->bst", weights, np.maximum(np.einsum("bshi,bti->bsht", iq, ik) * ix.width**-0.5, 0))
  causal = np.tril(np.ones((s, s), bool))
  chosen, gaps = np.zeros((b, s, s), bool), []
  for i in range(b):
    for j in range(s):
      order = np.argsort(-scores[i, j, : j + 1])
      chosen[i, j, order[: ix.topk]] = True
      if j + 1 > ix.topk:
        gaps.append(scores[i, j, order[ix.topk - 1]] - scores[i, j, order[ix.topk]])
  mask = causal[None] if dense else chosen
  logits = np.einsum("bshw,bthw->bhst", q, k) * module.scale
  logits = np.where(mask[:, None], logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("bhst,bthv->bshv", probs, kv[..., nope:]).reshape(b, s, h * cfg.v_head_dim)
  return out @ p(module.o_proj), chosen, min(gaps)


@pytest.mark.parametrize("interleaved", [False, pytest.param(True, marks=pytest.mark.slow, id="interleaved")])
def test_mixer_matches_numpy_and_decodes_through_its_cache(interleaved):
  """The forward equals the float64 computation (the indexer's top 3 of 10 keys, a margin between chosen and not),
  the dense control (every causal key) does not; prefill of 4 tokens then one at a time through the cache equals the
  forward."""
  module = random_mixer(mixer_config(rope_interleaved=interleaved))
  x = np.random.default_rng(1).normal(size=(2, 10, 16)).astype(np.float32)
  want, chosen, gap = numpy_mixer(module, x)
  assert gap > 1e-3 and chosen.sum(-1).max() == 3  # the choice acts, with a margin float32 keeps
  run = nnx.jit(lambda m, x, cache=None: m(x, cache=cache))  # one program per shape, not op by op
  got = np.asarray(run(module, jnp.asarray(x)))
  assert relative_error(got, want) < 1e-5
  dense, _, _ = numpy_mixer(module, x, dense=True)
  assert relative_error(dense, want) > 0.05
  (latent, latent_dtype), (keys, keys_dtype) = sparse_attention.cache_specs(module.cfg, 2, 10)
  assert keys == (2, 10, 4 + 8)  # MLA's rotary key beside the indexer's
  cache, outs = (jnp.zeros(latent, latent_dtype), jnp.zeros(keys, keys_dtype)), []
  for start, stop in ((0, 4),) + tuple((t, t + 1) for t in range(4, 10)):
    y, cache = run(module, jnp.asarray(x[:, start:stop]), (*cache, start))
    outs.append(np.asarray(y))
  assert relative_error(np.concatenate(outs, axis=1), got) < 1e-5


@pytest.mark.slow
def test_mixer_refuses_what_it_cannot_run():
  for change, field in (
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(attention_impl="cudnn"), "attention_impl"),
    (dict(indexer=(("heads", 4),)), "indexer"),
  ):
    with pytest.raises(ConfigError, match=field):
      sparse_attention.SparseAttention(dataclasses.replace(mixer_config(), **change), 0, rngs=nnx.Rngs(0))


# ---------------------------------------------------------------------------------------------------------------
# The families against transformers


@pytest.mark.parametrize("family", [case(f, slow=False) for f in FAMILIES])
def test_logits_and_routing_match_transformers(loaded, family):
  check_logits_and_routing(*loaded.forward(family), reference(family), no_overflow=True)


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_logits_unrolled_under_another_path(mesh_2x4, family):
  ref, moe = reference(family), OTHER_PATH[family]
  model = from_hf_under(family, mesh_2x4, moe, model={"scan_layers": False})
  check_against_reference(model, ref, every_copy=False, no_drops=False)


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_dense_mla_gives_other_logits(tmp_path, mesh_2x4, family):
  """The control: index_topk past the sequence (every causal key: DeepSeek-V3's MLA) changes the logits, so the
  indexer's choice is what matches transformers."""
  directory = fixture_copy(tmp_path, family)
  edit_config(directory, index_topk=64)
  ref = reference(family)
  logits, _ = models.from_hf(directory, mesh_2x4)(tiled(ref["tokens"]))
  assert relative_error(np.asarray(logits)[:2], ref["logits"]) > 0.01


@pytest.mark.slow
def test_logits_under_tensor_parallelism(devices):
  """MLA's heads split over 'gpu' (4 nodes x 2 GPUs), the indexer replicated: the logits stay transformers'."""
  check_under_tensor_parallelism("deepseek_v32")


@pytest.mark.parametrize(
  "family, mode", [case("deepseek_v32", "vanilla"), case("glm_moe_dsa", "exflow"), case(SHARED, "vanilla")]
)
def test_greedy_generation_matches_transformers(loaded, family, mode):
  check_greedy_generation(loaded.model(family), family, mode=mode)


@pytest.mark.parametrize("family", [case(f) for f in FAMILIES])
def test_round_trip(loaded, tmp_path, family):
  """The export holds the fixture's tensors bit for bit under the same names (the indexer's under
  `self_attn.indexer`), and the config.json fields the family's transformers class reads; loaded again, the same
  parameters."""
  written, got = check_round_trip(loaded.model(family), tmp_path, family, loaded.mesh, SHAPES + FIELDS)
  assert "model.layers.0.self_attn.indexer.k_norm.bias" in written
  if family == "glm_moe_dsa":
    assert got["indexer_types"] == config(family)["indexer_types"] == ["full"] * 3
  if family == SHARED:  # the shared layers without indexer tensors, as transformers saved them
    assert got["indexer_types"] == config(family)["indexer_types"] == ["full", "shared"] * 2
    assert not any(name.startswith("model.layers.1.self_attn.indexer") for name in written)


# ---------------------------------------------------------------------------------------------------------------
# What each config.json says its own way


@pytest.mark.slow
def test_reads_the_indexer_and_deepseek_v3_layers():
  cfg, moe_cfg = hf_config.from_hf_config(config("deepseek_v32"))
  assert cfg.mixers == ("dsa",) * 3 and cfg.moe_layers == (False, True, True) and cfg.num_mtp_layers == 0
  assert dict(cfg.indexer) == dict(heads=8, head_dim=8, topk=4, rope_interleaved=False) and cfg.rope_interleaved
  assert (moe_cfg.score, moe_cfg.group_score, moe_cfg.num_groups, moe_cfg.routed_scaling) == (
    "sigmoid",
    "top2_sum",
    2,
    1.8,
  )
  cfg, _ = hf_config.from_hf_config(config("glm_moe_dsa"))
  assert dict(cfg.indexer) == dict(heads=6, head_dim=12, topk=5, rope_interleaved=True)
  assert cfg.moe_layers == (True, False, True) and cfg.rope_theta == 1e6
  # DeepseekV32Config's defaults where config.json is silent: 64 heads of 128, top 2048, first 3 layers dense
  absent = ("index_n_heads", "index_head_dim", "index_topk", "mlp_layer_types", "first_k_dense_replace")
  hf = {k: v for k, v in config("deepseek_v32").items() if k not in absent}
  cfg, _ = hf_config.from_hf_config({**hf, "num_hidden_layers": 4, "layer_types": None})
  assert dict(cfg.indexer) == dict(heads=64, head_dim=128, topk=2048, rope_interleaved=False)
  assert cfg.moe_layers == (False, False, False, True)


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value",
  [
    ("mixers", ("dsa", "attention", "dsa")),
    ("rope_interleaved", False),
    ("num_mtp_layers", 1),
    ("moe.score", "softmax"),
  ],
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config("deepseek_v32"), field, value)
  glm, glm_moe = hf_config.from_hf_config(config("glm_moe_dsa"))
  other = dataclasses.replace(glm, indexer=tuple(sorted({**dict(glm.indexer), "rope_interleaved": False}.items())))
  with pytest.raises(ConfigError, match="indexer"):
    hf_config.to_hf_config(other, glm_moe)
