"""gpt-oss's experts in the MoE layer: the clamped SwiGLU, the experts' biases (b_in, b_gate [E, f], b_out [E, d])
and the router's bias, against the single-device reference on fresh random inputs with skewed routing (every token's
first choice one expert), under the collectives, paths, schedules, replicas and expert sharding; the fused Pallas
backends refused by name, and expert_backend='auto' choosing a backend that runs them."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.cost import expert_backend
from moejax.moe.config import MoEConfig
from moejax.moe.experts import Activation
from moejax.moe.params import init_params
from moejax.moe.reference import moe_reference
from moejax.replication.rebalance import rebalance
from moejax.validation import ConfigError
from tests.helpers import assert_matches_reference, force_routing, normal, relative_error

HOT = 13  # every token's first choice


def _gpt_oss(**fields) -> MoEConfig:
  base = dict(
    num_experts=16,
    top_k=2,
    d_model=8,
    d_ff=12,
    gated=True,
    activation="swiglu_clamped",
    swiglu_limit=1.5,
    ffn_bias=True,
    router_bias=True,
    renormalize=True,
  )
  return MoEConfig(**{**base, **fields})


def _skewed(cfg, seed: int, tokens: int = 64):
  """Fresh parameters and x [tokens, d] whose first choice is expert HOT (mod E) for every token (the router's bias kept); the
  pre-activations scaled so that the clamps at swiglu_limit act on some of them."""
  params = init_params(jax.random.key(seed), cfg)
  params = {k: (3 * v if k in ("w_in", "w_gate") else v) for k, v in params.items()}
  forced, x = force_routing(params, normal(seed, (tokens, cfg.d_model)), [HOT % cfg.num_experts], strength=6.0)
  forced["router"]["bias"] = params["router"]["bias"]
  return forced, jnp.asarray(x)


def test_clamped_swiglu_and_biases_against_float64_numpy():
  """The reference's expert (what the layer is compared with below) against float64 NumPy, written from gpt-oss's
  definition: gate = min(x Wg + bg, L), up = clip(x Wi + bi, -L, L), (up + 1) gate sigmoid(1.702 gate) Wo + bo, with
  the top-k of the biased router logits softmaxed over the k; the clamps hit."""
  cfg = _gpt_oss(num_experts=4, top_k=2)
  params, x = _skewed(cfg, 3, tokens=16)
  y, _ = moe_reference(params, x, cfg)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x64 = np.asarray(x, np.float64)
  logits = x64 @ p["router"]["kernel"] + p["router"]["bias"]
  ids = np.argsort(-logits, axis=1)[:, :2]
  top = np.take_along_axis(logits, ids, 1)
  w = np.exp(top - top.max(1, keepdims=True))
  w /= w.sum(1, keepdims=True)
  want, clamped = np.zeros_like(x64), 0
  for t in range(x64.shape[0]):
    for c in range(2):
      e = ids[t, c]
      gate, up = x64[t] @ p["w_gate"][e] + p["b_gate"][e], x64[t] @ p["w_in"][e] + p["b_in"][e]
      clamped += int(np.sum(gate > 1.5) + np.sum(np.abs(up) > 1.5))
      gate, up = np.minimum(gate, 1.5), np.clip(up, -1.5, 1.5)
      want[t] += w[t, c] * (((up + 1) * gate / (1 + np.exp(-1.702 * gate))) @ p["w_out"][e] + p["b_out"][e])
  assert clamped > 0 and set(ids[:, 0]) == {HOT % 4}
  assert relative_error(y, want) < 1e-6


def test_deepseek_v4_clamped_swiglu_and_its_gradient_against_float64_numpy():
  """'swiglu_clamped_v4' (DeepSeek-V4's experts and shared experts): silu(min(gate, L)) * clip(up, -L, L) at gates
  and ups below -L, inside and above L, and its gradient (0 through a clamp that acts)."""
  act = Activation("swiglu_clamped_v4", limit=1.5)
  grid = np.array([-4.0, -1.6, -1.4, -0.3, 0.0, 0.7, 1.4, 1.6, 5.0])
  gate, up = (a.reshape(-1) for a in np.meshgrid(grid, grid))
  silu = lambda a: a / (1 + np.exp(-a))
  want = silu(np.minimum(gate, 1.5)) * np.clip(up, -1.5, 1.5)
  got = act(jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
  sig = 1 / (1 + np.exp(-gate))
  want_gate = np.where(gate < 1.5, (sig + gate * sig * (1 - sig)) * np.clip(up, -1.5, 1.5), 0.0)
  want_up = np.where(np.abs(up) < 1.5, silu(np.minimum(gate, 1.5)), 0.0)
  g_gate, g_up = jax.grad(lambda g, u: jnp.sum(act(g, u)), (0, 1))(jnp.asarray(gate), jnp.asarray(up))
  np.testing.assert_allclose(np.asarray(g_gate), want_gate, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(g_up), want_up, rtol=1e-5, atol=1e-7)
  with pytest.raises(ConfigError, match="gated=False.*activation='swiglu_clamped_v4'"):
    _gpt_oss(activation="swiglu_clamped_v4", gated=False)


CASES = {  # name: (MoEConfig fields, moe_apply's slot table or None)
  "flat-padded": (dict(), None),
  "deepseek-v4-activation-shared": (dict(activation="swiglu_clamped_v4", num_shared_experts=1), None),
  "flat-capacity": (dict(collective="capacity", capacity_factor=1.0), None),
  "gpu_first-padded-comet": (dict(path="gpu_first", schedule="comet", num_chunks=2), None),
  "replicas": (dict(), "rebalance"),
  "parm-s1": (dict(esp_schedule="s1"), None),
  "parm-baseline": (dict(esp_schedule="baseline", capacity_factor=2.0), None),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.sampled(2)
def test_layer_matches_reference(mesh_2x4, name):
  """The layer (outputs, losses, counts and gradients of every weight and bias) equals the reference; with expert
  sharding b_out is added once over the d_ff shards."""
  fields, table = CASES[name]
  cfg = _gpt_oss(**fields)
  params, x = _skewed(cfg, 7 + len(name))
  kwargs = {}
  if table:
    slot_table = rebalance(np.bincount([HOT], minlength=16) + 1.0, 2, 4, 3)
    assert np.sum(slot_table == HOT) > 1  # the hot expert is replicated
    kwargs["slot_expert"] = jnp.asarray(slot_table)
  groups = {"parm-baseline": 2}.get(name)
  _, aux = assert_matches_reference(cfg, mesh_2x4, params, x, dispatch_groups=groups, **kwargs)
  assert np.all(np.asarray(aux["expert_ids"])[:, 0] == HOT)
  if cfg.capacity_factor is not None:
    assert int(aux["tokens_dropped"]) > 0  # the hot expert's queue overflows its capacity


@pytest.mark.parametrize("backend", ["pallas", "pallas_saved"])
@pytest.mark.parametrize(
  "fields",
  [
    dict(ffn_bias=False),
    dict(activation="silu", router_bias=False),
    dict(activation="swiglu_clamped_v4", ffn_bias=False),
  ],
  ids=["clamped", "biases", "clamped-v4"],
)
def test_fused_pallas_backends_refuse_before_compiling(backend, fields):
  with pytest.raises(ConfigError, match="expert_backend") as info:
    _gpt_oss(expert_backend=backend, **fields)
  assert backend in str(info.value)


def test_auto_picks_a_backend_that_runs_them(tmp_path, mesh_2x4):
  """A table where the fused FFN is fastest at the layer's shape: 'auto' takes the fastest backend that runs the
  biases and the clamped SwiGLU; without them, the fused FFN."""
  cfg = _gpt_oss(expert_backend="auto")
  shape = expert_backend.layer_shape(cfg, 64, 2, 4)
  row = dict(
    model="t",
    d=shape.d,
    f=shape.f,
    experts=shape.experts,
    gated=True,
    activation=shape.activation,
    rows=shape.rows,
    skew="balanced",
    passes="fwd",
    fastest="pallas",
    not_measured={},
    candidates_median_s={"pallas": 1.0, "pallas_saved": 1.5, "pallas_unfused": 2.0, "ragged_dot": 3.0},
  )
  kind = mesh_2x4.devices.flat[0].device_kind
  path = tmp_path / "table.json"
  path.write_text(json.dumps({"device": kind, "dtype": "float32", "shapes": [row]}))
  picked = expert_backend.resolve(dataclasses.replace(cfg, expert_table=str(path)), 64, mesh_2x4, "fwd")
  assert picked.expert_backend == "pallas_unfused"
  row["activation"] = "silu"
  path.write_text(json.dumps({"device": kind, "dtype": "float32", "shapes": [row]}))
  plain = dataclasses.replace(cfg, expert_table=str(path), ffn_bias=False, activation="silu")  # router bias kept
  assert expert_backend.resolve(plain, 64, mesh_2x4, "fwd").expert_backend == "pallas"
