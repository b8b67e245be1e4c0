"""Where a kernel runs: compiled by Triton on a GPU, the Pallas interpreter anywhere else."""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from moejax.runtime import platform as platform_lib

from . import tuning


def _platform(*arrays) -> str:
  """Platform of the first concrete array among `arrays`, else the default backend."""
  for a in arrays:
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
      return next(iter(a.devices())).platform
  return jax.default_backend()


def use_interpret(interpret: bool | None, *arrays) -> bool:
  """`interpret` if given; otherwise True unless the inputs (or default backend) are on a GPU."""
  if interpret is not None:
    return bool(interpret)
  return platform_lib.pallas_interprets(_platform(*arrays))


def device_kind(interpret: bool, *arrays) -> str:
  """The `tuning` device key for a call: 'cpu' when interpreted, else the GPU's kind."""
  if interpret:
    return "cpu"
  for a in arrays:
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
      return tuning.device_key(next(iter(a.devices())).device_kind)
  return tuning.device_key(jax.devices()[0].device_kind)


def compiler_params(config: tuning.TileConfig) -> plgpu.CompilerParams:
  return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def out_shapes(shapes_and_dtypes, *inputs) -> list[jax.ShapeDtypeStruct]:
  """Output structs of a pallas_call on `inputs`, varying over every mesh axis that any input
  varies over: inside `jax.shard_map` (check_vma=True) Pallas requires that type on out_shape.
  `jax.eval_shape` derives it for whichever jax version is running."""

  def probe(*xs):
    zero = sum(jnp.sum(x).astype(jnp.float32) * 0 for x in xs)
    return [jnp.broadcast_to(zero, shape).astype(dtype) for shape, dtype in shapes_and_dtypes]

  return jax.eval_shape(probe, *inputs)
