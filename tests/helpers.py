"""Shared test helpers: paths for subprocesses, fresh random inputs and forced routing, the one comparison with the
single-device reference, and compiled-program probes (temporaries, CUDA lowering of the exchanges)."""

import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from moejax.moe import wire
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.params import fan_ins, init_params, param_shapes
from moejax.moe.reference import moe_reference
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # for subprocesses


def cpu_env() -> dict[str, str]:
  """A subprocess's environment: CPU JAX with no device count forced from outside (the program calls
  simulate_cpu_devices itself), and the repository importable from any working directory."""
  env = dict(os.environ)
  flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  return env


def normal(seed: int, shape, dtype=np.float32) -> np.ndarray:
  """Fresh normal draws from NumPy (no JAX program to compile per shape, as jax.random's draws would: ~0.1 s each)."""
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def random_params(cfg, seed: int, dtype=np.float32) -> dict:
  """Parameters in the public layout drawn as `init_params` draws them, fan-in scaled normals (`fan_ins`), from NumPy:
  `init_params`' jax.random draws compile a program per leaf shape, ~0.5 s a layer config. The stream is apart from
  `normal(seed, ...)`'s, so that inputs drawn with the same seed are not the weights' values."""
  rng = np.random.default_rng((seed, 1))
  is_shape = lambda s: isinstance(s, tuple)
  shapes = param_shapes(cfg)
  draws = [
    (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype)
    for shape, fan_in in zip(jax.tree.leaves(shapes, is_leaf=is_shape), jax.tree.leaves(fan_ins(cfg)))
  ]
  return jax.tree.unflatten(jax.tree.structure(shapes, is_leaf=is_shape), draws)


def force_routing(params, x, experts, strength=30.0, router="router"):
  """Routes every token's top choices to `experts` (in that order) through a constant input feature:
  x[:, 0] = 1 and the router kernel's row 0 gives `experts` logits `strength`, `strength` - 1, ...; the
  other choices stay the random ones. router: the kernel to skew ('router' [d, E]; with the node routings
  'node_router' [d, N] or 'local_router' [d, E/N], whose "experts" are nodes or local experts)."""
  x, kernel = np.array(x), np.array(params[router]["kernel"])
  x[:, 0] = 1.0
  for rank, e in enumerate(experts):
    kernel[0, e] = strength - rank
  return {**params, router: {"kernel": kernel}}, x


def relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def run_with_grads(apply, params, x, grads=True):
  """(y, aux, gradients w.r.t. params and x of sum(y * c) + aux_loss for a fixed random cotangent c,
  or None without grads)."""
  if not grads:
    return *jax.jit(apply)(params, x), None
  cotangent = normal(99, x.shape)

  def loss(p, x):
    y, aux = apply(p, x)
    return jnp.sum(y * cotangent) + aux["aux_loss"], (y, aux)

  (_, (y, aux)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return y, aux, g


def reference_run(cfg, params, x, dispatch_groups: int, grads=True, **state):
  """`run_with_grads` of the single-device reference with `dispatch_groups` capacity groups; state: the layer
  state the reference takes too (expert_bias, balance_counts)."""

  # The experts see the rows as they arrive, quantised on the wire with a dispatch dtype (`moe.wire`); the gradient
  # passes straight through (the wire's backward carries it in the combine dtype).
  def expert_x(x):
    if cfg.dispatch_dtype is None:
      return None
    x = x.reshape(-1, x.shape[-1])
    return x + jax.lax.stop_gradient(wire.round_trip(x, cfg.dispatch_dtype) - x)

  return run_with_grads(
    lambda p, x: moe_reference(p, x, cfg, dispatch_groups=dispatch_groups, expert_x=expert_x(x), **state),
    params,
    x,
    grads,
  )


def assert_matches_reference(
  cfg, mesh, params, x, *, dispatch_groups: int | None = None, reference=None, tol=1e-5, grads=True, **layer_kwargs
):
  """The layer (`moe_apply(..., **layer_kwargs)`) equals the single-device reference: y, the losses, expert
  counts, drops, nothing overflowed, and (if `grads`) the gradients w.r.t. x and every parameter.

  reference: a `reference_run` result to compare with (one reference shared by several layers); else it is
  run here with `dispatch_groups` capacity groups (default: one per device of `mesh`)."""
  y, aux, g = run_with_grads(lambda p, x: moe_apply(p, x, cfg, mesh, **layer_kwargs), params, x, grads)
  if reference is None:
    state = {k: v for k, v in layer_kwargs.items() if k in ("expert_bias", "balance_counts")}
    reference = reference_run(cfg, params, x, mesh.size if dispatch_groups is None else dispatch_groups, grads, **state)
  y_ref, aux_ref, g_ref = reference
  assert relative_error(y, y_ref) < tol
  for name in ("load_balance_loss", "z_loss", "aux_loss"):
    np.testing.assert_allclose(float(aux[name]), float(aux_ref[name]), rtol=tol, atol=1e-9)
  np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), np.asarray(aux_ref["expert_counts"]))
  assert int(aux["tokens_dropped"]) == int(aux_ref["tokens_dropped"])
  assert int(aux["tokens_overflowed"]) == 0
  assert ("balance_counts" in aux) == ("balance_counts" in aux_ref)
  if "balance_counts" in aux:
    np.testing.assert_array_equal(np.asarray(aux["balance_counts"]), np.asarray(aux_ref["balance_counts"]))
  if grads:
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g), jax.tree.leaves(g_ref)):
      scale = np.linalg.norm(np.asarray(b))
      assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= tol * scale + 1e-7, path[0]
  return y, aux


def zero_or_reference_rows(cfg, params, x, y) -> np.ndarray:
  """[T] bool: the tokens whose output row in `y` is exactly zero (overflowed); `y` is finite and every other
  row equals the single-device reference's."""
  y = np.asarray(y)
  y_ref = np.asarray(jax.jit(lambda p, x: moe_reference(p, x, cfg)[0])(params, x))
  assert np.isfinite(y).all()
  zero = np.all(y == 0.0, axis=1)
  np.testing.assert_allclose(y[~zero], y_ref[~zero], rtol=1e-5, atol=1e-6)
  return zero


def temporary_bytes(n, m, **fields):
  """Bytes of temporaries of the compiled layer forward on an n x m mesh, 2 experts per device, 256 tokens per
  device (per node with expert sharding, where a node's GPUs share its tokens); fields: the MoEConfig's others."""
  cfg = MoEConfig(num_experts=2 * n * m, top_k=2, d_model=128, d_ff=256, **fields)
  mesh = mesh_lib.make_mesh(n, m)
  params = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
  x = jax.ShapeDtypeStruct((256 * (n * m if cfg.esp_schedule is None else n), 128), jnp.float32)
  compiled = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh)).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


# operand and output row counts of each ragged_all_to_all (rows [R, d] or expert ids [R])
RAGGED_OP = re.compile(r"custom_call @ragged_all_to_all\(.*: \(tensor<(\d+)x(?:\d+x)*[a-z]+\d*>, tensor<(\d+)x")
# (columns, element type) of a ragged_all_to_all's 2-D operand [rows, columns].
RAGGED_OPERAND = re.compile(r"custom_call @ragged_all_to_all\(.*?: \(tensor<\d+x(\d+)x([a-zA-Z0-9]+)>")


LOCAL_TOKENS = 64


def cuda_ragged_shapes(monkeypatch, **fields):
  """(operand rows, output rows) of every ragged_all_to_all in the forward and backward of the layer
  lowered for CUDA (here, without a GPU) on 2 x 4 devices, 64 tokens each, bf16, buffer_factor 1.5."""
  monkeypatch.setattr(platform_lib, "RAGGED_PLATFORMS", (*platform_lib.RAGGED_PLATFORMS, "cpu"))
  cfg = MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=32, dtype="bfloat16", buffer_factor=1.5, **fields)
  mesh = mesh_lib.make_mesh(2, 4)
  params = random_params(cfg, 0, jnp.bfloat16)
  x = normal(1, (8 * LOCAL_TOKENS, 16), jnp.bfloat16)

  def loss(p, v):
    y, aux = moe_apply(p, v, cfg, mesh)
    return jnp.sum(y.astype(jnp.float32)) + aux["aux_loss"]

  text = (
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
  )
  return [tuple(int(v) for v in m.groups()) for m in RAGGED_OP.finditer(text)]


def compiled_train_step(layers: int = 3):
  """A tiny Qwen3-MoE decoder's train step (layers scanned, all MoE) compiled on the 2 x 4 mesh from abstract state:
  (compiled, mesh). For tests that read or price the program's collectives."""
  from configs import decoder  # pylint: disable=import-outside-toplevel
  from moejax.models import state as state_lib  # pylint: disable=import-outside-toplevel
  from moejax.runtime import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from moejax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  from moejax.train import objective  # pylint: disable=import-outside-toplevel
  from moejax.train import trainer as train  # pylint: disable=import-outside-toplevel

  config = decoder.get_config("qwen3_moe")
  config.model.update(num_layers=layers, moe_layers=(True,) * layers, scan_layers=True)
  config.update(batch_size=8, micro_batches=1, seq_len=16)
  tokens = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
  mesh = mesh_lib.make_mesh(2, 4)
  trainer = train.Trainer(config, *config_lib.validate(config), mesh, tokens, donate=False)
  _, _, rest = state_lib.abstract_state(trainer.model_cfg, trainer.moe_cfg, mesh, config.seed)
  batch = jax.ShapeDtypeStruct((1, 8, 16), jnp.int32, sharding=trainer.batch_sharding)
  return trainer.step.lower(trainer.abstract_state, rest, batch).compile(), mesh
