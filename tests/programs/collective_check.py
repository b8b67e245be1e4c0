"""Run under `python -m moejax.runtime.launch --processes 2 --devices-per-process 4`: every process prints the
result of collectives over the 2x4 multi-process mesh as one JSON line."""

import json

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.runtime import distributed
from moejax.runtime import mesh as mesh_lib


def main():
  assert distributed.initialize() == "local"
  mesh = mesh_lib.make_mesh(2, 4)
  values = np.arange(8 * 8, dtype=np.float32).reshape(8, 8) ** 1.5  # row r belongs to flat device r
  sharding = jax.sharding.NamedSharding(mesh, P(mesh_lib.AXES))
  x = jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])

  def body(block):
    node_sum = jax.lax.psum(block, mesh_lib.NODE)  # over the host boundary
    swapped = jax.lax.all_to_all(block, mesh_lib.AXES, 1, 1, tiled=True)  # one column to every device
    return node_sum, swapped

  node_sum, swapped = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P(mesh_lib.AXES), out_specs=(P(mesh_lib.AXES), P(mesh_lib.AXES)))
  )(x)
  local = {int(s.index[0].start): np.asarray(s.data).tolist() for s in swapped.addressable_shards}
  local_sum = {int(s.index[0].start): np.asarray(s.data).tolist() for s in node_sum.addressable_shards}
  print(
    "RESULT "
    + json.dumps(
      {
        "process": jax.process_index(),
        "devices": [d.id for d in jax.local_devices()],
        "all_to_all": local,
        "node_psum": local_sum,
      }
    ),
    flush=True,
  )


if __name__ == "__main__":
  main()
