"""What runs on which platform: the one place for the rules that differ between CPU and GPU.

XLA:CPU has no `ragged-all-to-all` (jax-ml/jax issue 34755), so on CPU the ragged exchange is built
from a ring of fixed-size collective permutes ('padded', the same semantics); Pallas kernels compile
with Triton on GPU and run in the Pallas interpreter anywhere else.

Lowering for CUDA on a machine without a GPU (ahead-of-time checks of the GPU program) needs a
target GPU: `gpu_target_mesh` names one. jax 0.10 and 0.11 assumed compute capability 9.0 when no
GPU was attached; since jax 0.12 the Pallas Triton lowering reads the GPU from the abstract mesh in
context (`jax.sharding.use_abstract_mesh`) and from a `shard_map`'s own mesh.
"""

import jax

RAGGED_PLATFORMS = ("gpu", "tpu")  # backends with a native ragged all-to-all
TARGET_GPU = "NVIDIA H100"  # the GPU that a lowering without one attached targets (compute capability 9.0)


def of_mesh(mesh: jax.sharding.Mesh) -> str:
  """'cpu', 'gpu' or 'tpu': the platform of the mesh's devices."""
  return mesh.devices.flat[0].platform


def has_ragged_all_to_all(platform: str) -> bool:
  return platform in RAGGED_PLATFORMS


def simulates_nodes(platform: str) -> bool:
  """Whether one process's devices may stand for several nodes: only simulated CPU devices; on a GPU machine
  a process's devices are one node (the 'node' axis is the host boundary)."""
  return platform == "cpu"


def pallas_interprets(platform: str) -> bool:
  """Pallas kernels compile (Triton) only on GPU; elsewhere they run in the interpreter."""
  return platform != "gpu"


def gpu_target_mesh(
  axis_sizes: dict[str, int] | None = None, device_kind: str = TARGET_GPU
) -> jax.sharding.AbstractMesh:
  """An abstract mesh of `device_kind` GPUs (axes Auto), for lowering with lowering_platforms=('cuda',)
  where no GPU is attached: trace and lower inside `jax.sharding.use_abstract_mesh(gpu_target_mesh())`,
  and give a `shard_map` that runs Pallas kernels `gpu_target_mesh(its axis sizes)` as its mesh."""
  axis_sizes = dict(axis_sizes or {})
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
  return jax.sharding.AbstractMesh(
    tuple(axis_sizes.values()),
    tuple(axis_sizes),
    axis_types=(jax.sharding.AxisType.Auto,) * len(axis_sizes),
    abstract_device=device,
  )
