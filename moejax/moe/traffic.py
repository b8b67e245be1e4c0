"""Traffic accounting: the rows each exchange hop moved between flat devices (`aux['traffic_rows']`), the bytes
they cost on the wire both ways (`aux['traffic_bytes']`), and their split into inter- and intra-node traffic."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.moe import wire as wire_lib
from moejax.runtime import mesh as mesh_lib


def hop_traffic(paths, lay) -> list:
  """[A, A] kept rows moved between flat devices in each hop, summed over the paths."""
  return list(jax.lax.psum(device_traffic(paths, lay), mesh_lib.AXES))


def device_traffic(paths, lay):
  """[hops, A, A] int32: this device's row of each hop's traffic (its kept rows to each flat device, summed over the
  paths), zeros elsewhere; summed over the mesh, the hops' traffic."""
  mine = [jax.lax.axis_index(a) for a in lay.hops]
  return jnp.stack(
    [
      device_row(sum(p.hops[h].plan.kept_AxA[me] for p in paths), a, lay.n, lay.m)
      for h, (a, me) in enumerate(zip(lay.hops, mine))
    ]
  )


def traffic_bytes(traffic_rows, lay, d: int, slots: int, itemsize: int, may_drop: bool):
  """[hops, A, A] float32 bytes sent from flat device s to p in each hop, both ways: the rows out (the payload
  in the dispatch dtype, FP8's scales included, and each row's slots' int32 ids and float32 weights), and the
  results back (d in the combine dtype, and the int32 arrival flags of the slots where a hop may drop).
  traffic_rows: [hops, A, A] rows out; slots: per row; itemsize: the activations' bytes per element."""
  row = wire_lib.row_bytes(d, slots, itemsize, *lay.wire, may_drop)
  rows = traffic_rows.astype(jnp.float32)
  return rows * row.dispatch + jnp.swapaxes(rows, -1, -2) * row.combine


def traffic_summary(traffic_rows, gpus_per_node: int, bytes_per_row: int) -> list[dict]:
  """Per hop: rows and bytes that cross nodes (inter) or stay inside one (intra); a device's rows
  to itself move no data and are left out. traffic_rows: [hops, A, A] from `aux`."""
  traffic = np.asarray(traffic_rows, np.int64)
  cross, inside = mesh_lib.pair_masks(traffic.shape[-1], gpus_per_node)
  summary = []
  for hop in traffic:
    inter, intra = int(hop[cross].sum()), int(hop[inside].sum())
    summary.append(
      {
        "inter_node_rows": inter,
        "intra_node_rows": intra,
        "inter_node_bytes": inter * bytes_per_row,
        "intra_node_bytes": intra * bytes_per_row,
      }
    )
  return summary


def device_row(send_A, axis_name, n, m):
  """[A, A]: this device's sends to its A peers along the axis, in its own row of the flat devices' matrix."""
  me = mesh_lib.my_flat_index(m)
  peers = jnp.asarray(mesh_lib.peer_table(axis_name, n, m))[me]
  return jnp.zeros((n * m, n * m), jnp.int32).at[me, peers].set(send_A)
