"""Pallas expert kernels (interpreted on CPU) against float64 NumPy and jax.lax.ragged_dot."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import activations, backend, ffn, tile_order, tuning
from kernels import gmm as gmm_lib
from moejax.runtime import platform as platform_lib
from tests.helpers import normal as numpy_normal
from tests.helpers import relative_error

TILING = tuning.TileConfig(8, 16, 16)  # K=24, N=20 below: partial K and N tiles
GPU_TILING = tuning.TileConfig(16, 32, 16)
K, N = 24, 20

# name: (M, group_sizes); the M-tile is 8 rows.
CASES = {
  "uneven": (40, [5, 12, 9, 14]),
  "empty_groups": (40, [0, 17, 23, 0]),
  "tiny_groups": (40, [1, 2, 1, 36]),
  "one_group_all_rows": (40, [0, 0, 40, 0]),
  "padded_m": (48, [3, 10, 0, 12]),
  "sum_past_m": (40, [20, 15, 10, 5]),
}
FFN_SIZES = (40, [0, 5, 1, 20])  # empty, tiny and padded at once


def normal(seed, shape, dtype=jnp.float32, scale=1.0):
  return jnp.asarray(scale * numpy_normal(seed, shape), dtype)


def group_rows(group_sizes, m):
  """[(g, start, end)] in float64-reference terms: cumsum truncated at m."""
  ends = np.minimum(np.cumsum(group_sizes), m)
  starts = np.concatenate([[0], ends[:-1]])
  return [(g, s, e) for g, (s, e) in enumerate(zip(starts, ends))]


def np_gmm(lhs, rhs, group_sizes):
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  for g, s, e in group_rows(group_sizes, lhs.shape[0]):
    out[s:e] = lhs[s:e] @ rhs[g]
  return out


def np_tgmm(lhs, rhs, group_sizes):
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out = np.zeros((len(group_sizes), lhs.shape[1], rhs.shape[1]))
  for g, s, e in group_rows(group_sizes, lhs.shape[0]):
    out[g] = lhs[s:e].T @ rhs[s:e]
  return out


NP_ACTIVATIONS = {
  "gelu": lambda z: 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))),
  "relu": lambda z: np.maximum(z, 0),
  "silu": lambda z: z / (1 + np.exp(-z)),
}


def np_ffn(x, w_in, w_out, group_sizes, activation, w_gate):
  act = NP_ACTIVATIONS[activation]
  z_in = np_gmm(x, w_in, group_sizes)
  h = act(z_in) if w_gate is None else act(np_gmm(x, w_gate, group_sizes)) * z_in
  return np_gmm(h, w_out, group_sizes)


def ragged_ffn(x, w_in, w_out, group_sizes, activation, w_gate):
  act = activations.get_activation(activation)
  z_in = jax.lax.ragged_dot(x, w_in, group_sizes)
  h = act(z_in) if w_gate is None else act(jax.lax.ragged_dot(x, w_gate, group_sizes)) * z_in
  return jax.lax.ragged_dot(h, w_out, group_sizes)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tile_visits_cover_every_row_once(case):
  m, sizes = CASES[case]
  visits = jax.tree.map(np.asarray, tile_order.make_visits(jnp.array(sizes, jnp.int32), m, 8))
  assert visits.group_ids.shape == (-(-m // 8) + len(sizes),)
  owner = np.full(m, -1)
  for g, t, lo, hi in zip(*visits):
    assert t * 8 <= lo <= hi <= (t + 1) * 8
    assert (owner[lo:hi] == -1).all()
    owner[lo:hi] = g
  expected = np.full(m, len(sizes))  # rows past the sum: zero-fill pseudo-group
  for g, s, e in group_rows(sizes, m):
    expected[s:e] = g
  np.testing.assert_array_equal(owner, expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gmm_matches_numpy_and_ragged_dot(case):
  m, sizes = CASES[case]
  lhs, rhs, gs = normal(1, (m, K)), normal(2, (len(sizes), K, N)), jnp.array(sizes, jnp.int32)
  out = jax.jit(lambda a, b, g: gmm_lib.gmm(a, b, g, tiling=TILING))(lhs, rhs, gs)
  assert out.shape == (m, N) and out.dtype == jnp.float32
  assert relative_error(out, np_gmm(lhs, rhs, sizes)) < 1e-5
  assert relative_error(out, jax.lax.ragged_dot(lhs, rhs, gs)) < 1e-5
  np.testing.assert_array_equal(out[sum(sizes) :], 0.0)


def test_gmm_transpose_rhs():
  m, sizes = CASES["empty_groups"]
  lhs, rhs, gs = normal(3, (m, K)), normal(4, (len(sizes), N, K)), jnp.array(sizes, jnp.int32)
  out = gmm_lib.gmm(lhs, rhs, gs, transpose_rhs=True, tiling=TILING)
  assert relative_error(out, np_gmm(lhs, np.swapaxes(rhs, 1, 2), sizes)) < 1e-5


@pytest.mark.parametrize(
  "case,k,n", [("empty_groups", K, N), ("padded_m", K, N), ("sum_past_m", K, N), ("sum_past_m", 32, 16)]
)
def test_tgmm_matches_numpy(case, k, n):
  m, sizes = CASES[case]
  lhs, rhs, gs = normal(5, (m, k)), normal(6, (m, n)), jnp.array(sizes, jnp.int32)
  out = jax.jit(lambda a, b, g: gmm_lib.tgmm(a, b, g, tiling=TILING))(lhs, rhs, gs)
  assert out.shape == (len(sizes), k, n)
  assert relative_error(out, np_tgmm(lhs, rhs, sizes)) < 1e-5
  for g, size in enumerate(sizes):
    if size == 0:
      np.testing.assert_array_equal(out[g], 0.0)


@pytest.mark.parametrize(
  "case,k,n", [("empty_groups", K, N), ("tiny_groups", K, N), ("padded_m", K, N), ("padded_m", 32, 32)]
)
def test_gmm_grad_matches_ragged_dot(case, k, n):
  """k, n multiples of the tiles take the unmasked-load path."""
  m, sizes = CASES[case]
  lhs, rhs, gs = normal(7, (m, k)), normal(8, (len(sizes), k, n)), jnp.array(sizes, jnp.int32)
  dout = normal(9, (m, n))

  def grads(fn):
    return jax.jit(jax.grad(lambda a, b: jnp.sum(fn(a, b) * dout), argnums=(0, 1)))(lhs, rhs)

  ours = grads(lambda a, b: gmm_lib.gmm(a, b, gs, tiling=TILING))
  ref = grads(lambda a, b: jax.lax.ragged_dot(a, b, gs))
  for o, r in zip(ours, ref):
    assert relative_error(o, r) < 1e-5
  np.testing.assert_array_equal(ours[0][sum(sizes) :], 0.0)


def test_rows_past_the_sum_are_never_read():
  """Receive buffers are padded with garbage: NaN there must not reach outputs or gradients."""
  m, sizes = CASES["padded_m"]
  total = sum(sizes)
  gs = jnp.array(sizes, jnp.int32)
  lhs, rhs, dout = normal(26, (m, K)), normal(27, (len(sizes), K, N)), normal(28, (m, N))
  nan_lhs, nan_dout = lhs.at[total:].set(jnp.nan), dout.at[total:].set(jnp.nan)
  out, vjp = jax.vjp(lambda a, b: gmm_lib.gmm(a, b, gs, tiling=TILING), nan_lhs, rhs)
  dlhs, drhs = vjp(nan_dout)
  _, ref_vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs), lhs, rhs)
  ref_dlhs, ref_drhs = ref_vjp(dout.at[total:].set(0.0))
  assert relative_error(out, np_gmm(lhs, rhs, sizes)) < 1e-5
  assert relative_error(dlhs, ref_dlhs) < 1e-5 and relative_error(drhs, ref_drhs) < 1e-5
  w_out = normal(29, (len(sizes), N, K), scale=0.3)
  y = ffn.expert_ffn(nan_lhs, 0.3 * rhs, w_out, gs, "gelu", tiling=TILING)
  assert relative_error(y, np_ffn(lhs, 0.3 * rhs, w_out, sizes, "gelu", None)) < 1e-5


def test_gmm_bf16_within_bf16_tolerance():
  m, sizes = CASES["uneven"]
  lhs, rhs = normal(10, (m, K), jnp.bfloat16), normal(11, (len(sizes), K, N), jnp.bfloat16)
  gs = jnp.array(sizes, jnp.int32)
  out = gmm_lib.gmm(lhs, rhs, gs, tiling=TILING)
  assert out.dtype == jnp.bfloat16
  assert relative_error(out, np_gmm(lhs, rhs, sizes)) < 1e-2
  out32 = gmm_lib.gmm(lhs, rhs, gs, preferred_element_type=jnp.float32, tiling=TILING)
  assert out32.dtype == jnp.float32
  assert relative_error(out32, np_gmm(lhs, rhs, sizes)) < 1e-5  # fp32 accumulation of exact products


FFN_CASES = [(act, gated, K, N) for act in sorted(activations.ACTIVATIONS) for gated in (False, True)]


@pytest.mark.parametrize("activation,gated,d,f", FFN_CASES + [("gelu", True, 32, 16)])
@pytest.mark.sampled(1)
def test_expert_ffn_and_grads(activation, gated, d, f):
  m, sizes = FFN_SIZES
  g = len(sizes)
  x = normal(12, (m, d))
  w_in, w_out = normal(13, (g, d, f), scale=0.3), normal(14, (g, f, d), scale=0.3)
  w_gate = normal(15, (g, d, f), scale=0.3) if gated else None
  gs, dy = jnp.array(sizes, jnp.int32), normal(16, (m, d))

  def value_and_grads(fn):
    def loss(x, w_in, w_out, w_gate):
      y = fn(x, w_in, w_out, gs, activation, w_gate)
      return jnp.sum(y * dy), y

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, w_in, w_out, w_gate)

  grads, y = value_and_grads(lambda *a: ffn.expert_ffn(*a, tiling=TILING))
  ref_grads, _ = value_and_grads(ragged_ffn)
  assert relative_error(y, np_ffn(x, w_in, w_out, sizes, activation, w_gate)) < 1e-5
  np.testing.assert_array_equal(y[sum(sizes) :], 0.0)
  for ours, ref in zip(grads, ref_grads):
    assert (ours is None) == (ref is None) == (not gated and ours is ref)
    if ref is not None:
      assert relative_error(ours, ref) < 1e-5


NP_ACTIVATION_GRADS = {
  "gelu": lambda z: (
    0.5 * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    + 0.5
    * z
    * (1 - np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)) ** 2)
    * math.sqrt(2 / math.pi)
    * (1 + 3 * 0.044715 * z**2)
  ),
  "relu": lambda z: (z > 0).astype(np.float64),
  "silu": lambda z: (1 / (1 + np.exp(-z))) * (1 + z * (1 - 1 / (1 + np.exp(-z)))),
}


def np_ffn_grads(x, w_in, w_out, group_sizes, activation, w_gate, dy):
  """float64 (dx, dw_in, dw_out, dw_gate or None) of sum(ffn(x) * dy), by the chain rule per group."""
  act, dact = NP_ACTIVATIONS[activation], NP_ACTIVATION_GRADS[activation]
  w_out64 = np.asarray(w_out, np.float64)
  z_in = np_gmm(x, w_in, group_sizes)
  dh = np_gmm(dy, np.swapaxes(w_out64, 1, 2), group_sizes)
  if w_gate is None:
    h, dz_in, dz_gate = act(z_in), dh * dact(z_in), None
  else:
    z_gate = np_gmm(x, w_gate, group_sizes)
    h, dz_in, dz_gate = act(z_gate) * z_in, dh * act(z_gate), dh * z_in * dact(z_gate)
  dx = np_gmm(dz_in, np.swapaxes(np.asarray(w_in, np.float64), 1, 2), group_sizes)
  if w_gate is not None:
    dx += np_gmm(dz_gate, np.swapaxes(np.asarray(w_gate, np.float64), 1, 2), group_sizes)
  return (
    dx,
    np_tgmm(x, dz_in, group_sizes),
    np_tgmm(h, dy, group_sizes),
    None if w_gate is None else np_tgmm(x, dz_gate, group_sizes),
  )


# rows past the groups with an empty and a one-row group; every row in one group of four.
SKEWED_FFN_SIZES = {"skewed": FFN_SIZES, "one_group_all_rows": (40, [0, 0, 40, 0])}


@pytest.mark.parametrize("save", [True, False], ids=["saved", "recomputed"])
@pytest.mark.parametrize("activation,gated", [("silu", True), ("gelu", False), ("gelu", True)])
@pytest.mark.parametrize("sizes", sorted(SKEWED_FFN_SIZES))
@pytest.mark.sampled(1)
def test_expert_ffn_backward_matches_numpy(save, activation, gated, sizes):
  """Both backwards (pre-activations kept from the forward, or recomputed) against float64 NumPy's chain rule: the
  output and the gradients of x and every weight, on fresh draws."""
  m, group_sizes = SKEWED_FFN_SIZES[sizes]
  rng = np.random.default_rng(abs(hash((save, activation, gated, sizes))) % 2**32)
  draw = lambda shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
  g = len(group_sizes)
  x, dy = draw((m, K)), draw((m, K))
  w_in, w_out = draw((g, K, N), 0.3), draw((g, N, K), 0.3)
  w_gate = draw((g, K, N), 0.3) if gated else None
  gs = jnp.array(group_sizes, jnp.int32)

  def loss(x, w_in, w_out, w_gate):
    y = ffn.expert_ffn(x, w_in, w_out, gs, activation, w_gate, tiling=TILING, save_preactivations=save)
    return jnp.sum(y * dy), y

  grads, y = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, w_in, w_out, w_gate)
  assert relative_error(y, np_ffn(x, w_in, w_out, group_sizes, activation, w_gate)) < 1e-5
  want = np_ffn_grads(x, w_in, w_out, group_sizes, activation, w_gate, dy)
  for name, ours, ref in zip(("dx", "dw_in", "dw_out", "dw_gate"), grads, want):
    assert (ours is None) == (ref is None), name
    if ref is not None:
      assert relative_error(ours, ref) < 1e-5, name
  np.testing.assert_array_equal(grads[0][sum(group_sizes) :], 0.0)  # rows past the groups: zero dx


def test_saved_preactivations_skip_the_recompute():
  """The kept pre-activations are the backward's residuals, [M, f] each beside what the recomputing FFN keeps, and its
  backward kernels hold two dot products fewer (z_gate and z_in are not recomputed). Traced only (nothing runs)."""
  m, sizes = FFN_SIZES
  gs = jnp.array(sizes, jnp.int32)
  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((m, K), (4, K, N), (4, N, K), (4, K, N))]

  def ffn_of(save):
    return lambda *a: ffn.expert_ffn(
      *a[:3], gs, "silu", a[3], tiling=GPU_TILING, interpret=False, save_preactivations=save
    )

  def residual_shapes(save):
    return sorted(
      leaf.shape for leaf in jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(ffn_of(save), *a)[1], *args))
    )

  assert residual_shapes(True) == sorted(residual_shapes(False) + [(m, N), (m, N)])

  def dots(save):  # dot_generals in the forward's and backward's Pallas kernels
    grad = jax.grad(lambda *a: jnp.sum(ffn_of(save)(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3))
    return str(jax.make_jaxpr(grad)(*args)).count("dot_general")

  assert dots(False) - dots(True) == 2


def test_expert_ffn_bf16_within_bf16_tolerance():
  m, sizes = FFN_SIZES
  d, f, g = K, N, len(sizes)
  x = normal(17, (m, d), jnp.bfloat16)
  w_in, w_out, w_gate = (
    normal(s, shape, jnp.bfloat16, 0.3) for s, shape in ((18, (g, d, f)), (19, (g, f, d)), (20, (g, d, f)))
  )
  y = ffn.expert_ffn(x, w_in, w_out, jnp.array(sizes, jnp.int32), "silu", w_gate, tiling=TILING)
  assert y.dtype == jnp.bfloat16
  assert relative_error(y, np_ffn(x, w_in, w_out, sizes, "silu", w_gate)) < 2e-2


def test_gelu_is_the_tanh_approximation():
  z = normal(21, (64,), scale=3.0)
  assert activations.GELU_APPROXIMATE
  expected = NP_ACTIVATIONS["gelu"](np.asarray(z, np.float64))
  np.testing.assert_allclose(activations.get_activation("gelu")(z), expected, rtol=1e-5, atol=1e-6)


def _bad_calls():
  x, w, gs = jnp.ones((8, 4)), jnp.ones((2, 4, 6)), jnp.array([4, 4], jnp.int32)
  w_out = jnp.ones((2, 6, 4))
  return {
    "lhs_rank": (lambda: gmm_lib.gmm(jnp.ones((8,)), w, gs), "lhs"),
    "rhs_rank": (lambda: gmm_lib.gmm(x, jnp.ones((4, 6)), gs), "rhs"),
    "k_mismatch": (lambda: gmm_lib.gmm(x, jnp.ones((2, 5, 6)), gs), "rhs.shape[1]=5"),
    "group_sizes_length": (lambda: gmm_lib.gmm(x, w, jnp.array([8], jnp.int32)), "group_sizes"),
    "group_sizes_float": (lambda: gmm_lib.gmm(x, w, jnp.array([4.0, 4.0])), "float32"),
    "int_lhs": (lambda: gmm_lib.gmm(jnp.ones((8, 4), jnp.int32), w, gs), "lhs"),
    "block_not_power_of_two": (lambda: gmm_lib.gmm(x, w, gs, tiling=tuning.TileConfig(8, 12, 8)), "block_n=12"),
    "tgmm_m_mismatch": (lambda: gmm_lib.tgmm(x, jnp.ones((7, 6)), gs), "rhs.shape[0]=7"),
    "ffn_w_out_shape": (lambda: ffn.expert_ffn(x, w, jnp.ones((2, 5, 4)), gs), "w_out.shape[1]=5"),
    "ffn_w_gate_shape": (lambda: ffn.expert_ffn(x, w, w_out, gs, w_gate=jnp.ones((3, 4, 6))), "w_gate.shape[0]=3"),
    "ffn_group_sizes": (lambda: ffn.expert_ffn(x, w, w_out, jnp.array([1, 2, 5], jnp.int32)), "group_sizes"),
    "ffn_activation": (lambda: ffn.expert_ffn(x, w, w_out, gs, "tanh"), "'tanh'"),
  }


@pytest.mark.parametrize("name", sorted(_bad_calls()))
def test_bad_inputs_raise_before_compiling(name):
  call, offending = _bad_calls()[name]
  with pytest.raises(ValueError, match=offending.replace("[", r"\[")):
    call()


def _sharded_ffn_grads(devices, check_vma, interpret):
  """Loss and grads of a gated FFN inside shard_map over 2 devices, each with its own groups (for
  compiled kernels, 2 abstract GPUs: the lowering reads its target GPU from the shard_map's mesh)."""
  mesh = jax.sharding.Mesh(np.array(devices[:2]), ("gpu",)) if interpret else platform_lib.gpu_target_mesh({"gpu": 2})
  spec = jax.sharding.PartitionSpec("gpu")
  tiling = TILING if interpret else GPU_TILING

  def local_loss(x, w_in, w_out, w_gate, sizes):
    y = ffn.expert_ffn(x, w_in[0], w_out[0], sizes[0], "silu", w_gate[0], tiling=tiling, interpret=interpret)
    return jax.lax.psum(jnp.sum(y * y), "gpu")[None]

  sharded = jax.shard_map(local_loss, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=check_vma)
  return jax.jit(jax.value_and_grad(lambda *a: sharded(*a)[0], argnums=(0, 1, 2, 3)))


SHARD_SIZES = [[3, 0, 9, 4], [0, 16, 0, 0]]  # per device; 16 rows each


def test_ffn_grads_in_shard_map_interpreted(devices):
  """The interpreter needs check_vma=False (jax 0.10 to 0.12: its grid loop slices varying operands
  with unvarying indices); compiled Triton kernels do not, see the next test."""
  x, sizes = normal(22, (32, K)), jnp.array(SHARD_SIZES, jnp.int32)
  w_in, w_out, w_gate = (
    normal(s, shape, scale=0.3) for s, shape in ((23, (2, 4, K, N)), (24, (2, 4, N, K)), (25, (2, 4, K, N)))
  )
  loss, grads = _sharded_ffn_grads(devices, False, True)(x, w_in, w_out, w_gate, sizes)

  def ref_loss(x, w_in, w_out, w_gate):
    ys = [ragged_ffn(x[16 * i : 16 * (i + 1)], w_in[i], w_out[i], sizes[i], "silu", w_gate[i]) for i in range(2)]
    return sum(jnp.sum(y * y) for y in ys)

  ref, ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3))(x, w_in, w_out, w_gate)
  assert relative_error(loss, ref) < 1e-5
  for ours, r in zip(grads, ref_grads):
    assert relative_error(ours, r) < 1e-5


def test_ffn_grads_in_shard_map_lower_to_triton_with_check_vma(devices):
  x, sizes = jnp.ones((32, K), jnp.bfloat16), jnp.array(SHARD_SIZES, jnp.int32)
  w = jnp.ones((2, 4, K, N), jnp.bfloat16)
  fn = _sharded_ffn_grads(devices, True, False)
  assert _triton_calls(fn, x, w, jnp.swapaxes(w, 2, 3), w, sizes) == 7


def _triton_calls(fn, *args):
  """Triton kernels in `fn` lowered for CUDA without a GPU: traced on the arguments' shapes inside
  an abstract mesh that names the target GPU (which Pallas needs since jax 0.12)."""
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  with jax.sharding.use_abstract_mesh(platform_lib.gpu_target_mesh()):
    lowered = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
  return lowered.as_text().count("__gpu$xla.gpu.triton")


@pytest.mark.parametrize(
  "activation,d,f", [(act, K, N) for act in sorted(activations.ACTIVATIONS)] + [("silu", 32, 64)]
)
@pytest.mark.sampled(1)
def test_kernels_lower_to_triton(activation, d, f):
  """Triton lowering (no GPU needed) rejects primitives it cannot lower, e.g. erf."""
  m, sizes = FFN_SIZES
  gs = jnp.array(sizes, jnp.int32)
  x, w_in, w_out = (jnp.ones(shape, jnp.bfloat16) for shape in ((m, d), (4, d, f), (4, f, d)))

  def ffn_loss(x, w_in, w_out, w_gate):
    y = ffn.expert_ffn(x, w_in, w_out, gs, activation, w_gate, tiling=GPU_TILING, interpret=False)
    return jnp.sum(y.astype(jnp.float32))

  def gmm_loss(x, w):
    return jnp.sum(gmm_lib.gmm(x, w, gs, tiling=GPU_TILING, interpret=False).astype(jnp.float32))

  # forward: ffn_in + gmm; backward: ffn_bwd + dx + one tgmm per weight
  gated, plain = (jax.value_and_grad(ffn_loss, argnums=n) for n in ((0, 1, 2, 3), (0, 1, 2)))
  assert _triton_calls(gated, x, w_in, w_out, w_in) == 7
  assert _triton_calls(plain, x, w_in, w_out, None) == 6
  assert _triton_calls(jax.value_and_grad(gmm_loss, argnums=(0, 1)), x, w_in) == 3


def test_saved_preactivations_lower_to_triton():
  """The saving forward (three outputs) and the backward reading the kept pre-activations in its epilogue lower for
  CUDA: the same kernel count as the recomputing FFN."""
  m, sizes = FFN_SIZES
  gs = jnp.array(sizes, jnp.int32)
  x, w_in, w_out = (jnp.ones(shape, jnp.bfloat16) for shape in ((m, K), (4, K, N), (4, N, K)))

  def loss(x, w_in, w_out, w_gate):
    y = ffn.expert_ffn(x, w_in, w_out, gs, "gelu", w_gate, tiling=GPU_TILING, interpret=False, save_preactivations=True)
    return jnp.sum(y.astype(jnp.float32))

  assert _triton_calls(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), x, w_in, w_out, w_in) == 7
  assert _triton_calls(jax.value_and_grad(loss, argnums=(0, 1, 2)), x, w_in, w_out, None) == 6


def test_tuning_table_entries_are_valid_on_gpu():
  for device, table in tuning.TABLE.items():
    for (kernel, dtype, rows), config in table.items():
      assert kernel in tuning.KERNELS
      config.validate(interpret=device == "cpu")
    assert len(table) == len(tuning.KERNELS) * 2 * 2, device
  assert tuning.device_key("NVIDIA H100 80GB HBM3") == "h100"
  assert tuning.device_key("NVIDIA H200") == "h200"
  config = tuning.get_config("gmm", "h100", jnp.bfloat16, 64 * 1024, 8)
  assert config == tuning.TABLE["h100"]["gmm", "bf16", "many_rows"]


def test_interpret_follows_the_inputs_platform():
  x = jnp.ones((2, 2))
  assert backend.use_interpret(None, x)  # CPU array
  assert not backend.use_interpret(False, x)
  assert backend.device_kind(True, x) == "cpu"
