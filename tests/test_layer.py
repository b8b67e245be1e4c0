"""The distributed MoE layer equals the single-device reference: outputs, losses, counts and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.module import MoELayer
from moejax.moe.reference import moe_reference
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError
from tests.helpers import assert_matches_reference, force_routing, normal, random_params, relative_error

MESHES = [(1, 1), (1, 8), (2, 4), (4, 2), (8, 1)]
MODES = [
  ("flat", "padded", None),
  ("flat", "padded", 1.0),
  ("flat", "capacity", 1.0),
  ("gpu_first", "padded", None),
  ("gpu_first", "padded", 0.75),
  ("node_first", "capacity", 0.75),
]
ACTIVATIONS = ["gelu", "silu", "relu"]


def _cases():
  """Every mesh with every path/collective/capacity mode; k, experts per device, backend, activation and
  gating rotate so that each value meets each mesh and each mode."""
  cases = []
  for mi, (n, m) in enumerate(MESHES):
    for ti, (path, collective, cf) in enumerate(MODES):
      k = (1, 2, 4)[(mi + ti) % 3]
      experts_per_gpu = (1, 2, 4)[(mi + 2 * ti) % 3]
      if k > n * m * experts_per_gpu:
        experts_per_gpu = 4
      backend = ("dense", "ragged_dot", "pallas", "ragged_dot")[(mi + ti) % 4]
      case_id = f"{n}x{m}-{path}-{collective}-cf{cf}-k{k}-epg{experts_per_gpu}-{backend}"
      cases.append(
        pytest.param(
          n,
          m,
          k,
          experts_per_gpu,
          path,
          collective,
          cf,
          backend,
          ACTIVATIONS[(mi + ti) % 3],
          (mi + ti) % 2 == 0,
          id=case_id,
        )
      )
  return cases


@pytest.mark.parametrize("n,m,k,experts_per_gpu,path,collective,cf,backend,activation,gated", _cases())
@pytest.mark.sampled(2)
def test_layer_matches_reference(n, m, k, experts_per_gpu, path, collective, cf, backend, activation, gated):
  mesh = mesh_lib.make_mesh(n, m)
  cfg = MoEConfig(
    num_experts=n * m * experts_per_gpu,
    top_k=k,
    d_model=8,
    d_ff=12,
    path=path,
    collective=collective,
    capacity_factor=cf,
    expert_backend=backend,
    activation=activation,
    gated=gated,
    renormalize=k > 1,
    z_loss_coef=1e-3,
  )
  seed = n * 1000 + m * 100 + k * 10 + experts_per_gpu
  params = random_params(cfg, seed)
  x = normal(seed + 1, (n * m * 8, 8))
  _, aux = assert_matches_reference(cfg, mesh, params, x)
  if cf is not None and cf < 1:
    assert int(aux["tokens_dropped"]) > 0


@pytest.mark.parametrize(
  "path,collective,cf",
  [
    ("flat", "padded", None),
    ("gpu_first", "padded", None),
    ("flat", "capacity", 2.0),
    ("flat", "padded", 1.0),
    ("node_first", "capacity", 1.0),
  ],
)
@pytest.mark.parametrize("target", ["one_expert", "one_device"])
@pytest.mark.sampled(2)
def test_adversarial_routing(mesh_2x4, path, collective, cf, target):
  k, experts_per_gpu = (1, 2) if target == "one_expert" else (2, 2)
  cfg = MoEConfig(
    num_experts=16, top_k=k, d_model=8, d_ff=12, path=path, collective=collective, capacity_factor=cf, gated=True
  )
  params = random_params(cfg, 5)
  x = normal(6, (64, 8))
  experts = [13] if target == "one_expert" else [6, 7]  # experts 6, 7 both live on device 3
  params, x = force_routing(params, x, experts)
  _, aux = assert_matches_reference(cfg, mesh_2x4, params, x)
  counts = np.asarray(aux["expert_counts"])
  assert set(np.flatnonzero(counts)) <= set(experts)  # every other expert receives nothing
  if cf is None:
    assert counts.sum() == 64 * k
  else:
    assert int(aux["tokens_dropped"]) == 64 * k - counts.sum() > 0


@pytest.mark.parametrize("n,m,tokens", [(1, 1, 1), (2, 4, 8)])
def test_single_token_per_device(n, m, tokens):
  cfg = MoEConfig(num_experts=n * m * 2, top_k=2, d_model=8, d_ff=12, path="gpu_first")
  params = random_params(cfg, 7)
  x = normal(8, (tokens, 8))
  assert_matches_reference(cfg, mesh_lib.make_mesh(n, m), params, x)


@pytest.mark.sampled(1)
@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("routing", ["topk", "node_limited", "bilevel"])
@pytest.mark.parametrize("path", ["flat", "gpu_first", "node_first"])
@pytest.mark.parametrize("n,m", [(2, 4), (4, 2)])
def test_traffic_matrix_counts_rows_between_devices(n, m, path, routing, dedup):
  """Rows per hop counted in NumPy from the layer's routing: one per token-choice, or with dedup one per token and
  destination of the hop (a token's choices on one device, or through one GPU index or node, travel as one row):
  every hop moves exactly the rows it must."""
  devices, tokens_per_device, num_experts = n * m, 16, 16
  node_top_k = 1 if routing == "topk" else 2
  cfg = MoEConfig(
    num_experts=num_experts,
    top_k=2,
    d_model=8,
    d_ff=12,
    path=path,
    dedup=dedup,
    routing=routing,
    num_nodes=n,
    node_top_k=node_top_k,
  )
  params = random_params(cfg, 9)
  x = normal(10, (devices * tokens_per_device, 8))
  _, aux = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_lib.make_mesh(n, m)))(params, x)
  ids = np.asarray(aux["expert_ids"])
  token = np.arange(devices * tokens_per_device)[:, None].repeat(ids.shape[1], 1)
  source, dest = token // tokens_per_device, ids // (num_experts // devices)

  def count(src, dst):  # rows from src to dst: one per choice, or with dedup per distinct (token, dst)
    rows = list(zip(token.ravel(), src.ravel(), dst.ravel()))
    out = np.zeros((devices, devices), int)
    for _, s_, d_ in set(rows) if dedup else rows:
      out[s_, d_] += 1
    return out

  if path == "flat":
    want = [count(source, dest)]
  elif path == "gpu_first":  # inside the node to the destination's GPU index, then across nodes
    via = (source // m) * m + dest % m
    want = [count(source, via), count(via, dest)]
  else:  # to the destination's node at the sender's GPU index, then inside it
    via = (dest // m) * m + source % m
    want = [count(source, via), count(via, dest)]
  np.testing.assert_array_equal(np.asarray(aux["traffic_rows"]), np.stack(want))


def test_batch_seq_input_and_bf16(mesh_2x4):
  cfg = MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=32, dtype="bfloat16", gated=True)
  params = random_params(cfg, 11)
  x = normal(12, (4, 8, 16))
  y, _ = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_2x4))(params, x)
  y_ref, _ = moe_reference(params, x, cfg, dispatch_groups=8)
  assert y.shape == x.shape
  assert relative_error(y, y_ref) < 2e-2  # bf16 inputs, fp32 accumulation


def test_jitter_noise_is_the_documented_draw(mesh_2x4):
  cfg = MoEConfig(num_experts=8, top_k=1, d_model=8, d_ff=12, jitter=0.5)
  params = random_params(cfg, 13)
  x = normal(14, (64, 8))
  rng = jax.random.key(15)
  y, _ = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_2x4, rng=rng, train=True))(params, x)
  noise = jax.random.uniform(rng, x.shape, jnp.float32, 0.5, 1.5)
  y_ref, _ = moe_reference(params, x, cfg, noise=noise)
  y_plain, _ = moe_reference(params, x, cfg)
  assert relative_error(y, y_ref) < 1e-5
  assert relative_error(y, y_plain) > 1e-3  # jitter changed some routes
  with pytest.raises(ConfigError, match="needs an rng"):
    moe_apply(params, x, cfg, mesh_2x4, train=True)


def test_bad_inputs_are_named_before_compiling(mesh_2x4):
  cfg = MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=12)
  params = random_params(cfg, 0)
  x = jnp.ones((64, 8))
  with pytest.raises(ConfigError, match="collective='ragged'.*use collective='padded'"):
    moe_apply(params, x, MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=12, collective="ragged"), mesh_2x4)
  with pytest.raises(ConfigError, match="60 tokens, not a multiple of the mesh's 8 devices"):
    moe_apply(params, x[:60], cfg, mesh_2x4)
  with pytest.raises(ConfigError, match=r"x has shape \(64, 7\)"):
    moe_apply(params, jnp.ones((64, 7)), cfg, mesh_2x4)
  with pytest.raises(ConfigError, match="parameter shapes"):
    moe_apply({**params, "w_in": params["w_in"][:, :, :5]}, x, cfg, mesh_2x4)
  with pytest.raises(ConfigError, match="num_experts=12.*multiple of the mesh's 8 devices"):
    moe_apply(params, x, MoEConfig(num_experts=12, top_k=2, d_model=8, d_ff=12), mesh_2x4)


def test_nnx_module_owns_sharded_params_in_the_public_layout(mesh_2x4):
  cfg = MoEConfig(num_experts=16, top_k=2, d_model=8, d_ff=12, gated=True)
  layer = MoELayer(cfg, mesh_2x4, rngs=nnx.Rngs(0))
  paths = {tuple(str(p) for p in path) for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
  assert paths == {("router", "kernel"), ("w_in",), ("w_out",), ("w_gate",)}
  assert layer.w_in[...].sharding.spec == jax.sharding.PartitionSpec(("node", "gpu"))
  assert len(layer.w_in[...].addressable_shards) == 8 and layer.w_in[...].addressable_shards[0].data.shape[0] == 2
  x = normal(1, (64, 8))
  y, aux = nnx.jit(lambda layer, x: layer(x))(layer, x)
  y_ref, aux_ref = jax.jit(lambda p, x: moe_reference(p, x, cfg, dispatch_groups=8))(layer.params(), x)
  assert relative_error(y, y_ref) < 1e-5
  np.testing.assert_allclose(float(aux["aux_loss"]), float(aux_ref["aux_loss"]), rtol=1e-5)
