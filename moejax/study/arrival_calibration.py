"""The wait at a collective after compute, measured on the mesh at hand (`moejax.cost.program_segments`), and the
program terms with it.

  terms = measure(mesh)   # program_calibration.measure's terms, with terms.arrival

A program of ROUNDS rounds of (a per-device [side, side] matmul, then an all-reduce over every axis of one float that
depends on it, added back) is timed at two sides (`SIDES`: a segment of well under a millisecond on a 2-core host,
and one of several), and priced by `moejax.cost.program_price.price_measured` with the terms measured before (no
wait). The excess of its time over that price, per all-reduce, is the wait after a segment of its priced seconds:
the two points (segment seconds, wait seconds) of `Terms.arrival`, each wait at least 0. Microbenchmarks only: no
measured point of a sweep enters them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.cost import program_ops, program_price
from moejax.study import interleaved_timing, program_calibration

ROUNDS = 8
SIDES = (128, 512)


def measure(mesh, repeats: int = 9, say=print, **hooks) -> program_calibration.Terms:
  """`program_calibration.measure(mesh, repeats, say=say, **hooks)`, then `Terms.arrival` measured on top of them
  (none on one device: nothing to wait for)."""
  terms = program_calibration.measure(mesh, repeats, say=say, **hooks)
  if mesh.devices.size == 1:
    return terms
  points = tuple(wait_after(side, mesh, terms, repeats) for side in SIDES)
  say("wait at a collective after compute: " + ", ".join(f"{w * 1e6:.0f} us after {s * 1e6:.0f} us" for s, w in points))
  return dataclasses.replace(terms, arrival=points)


def rounds_program(mesh, side: int):
  """jit(shard_map) of ROUNDS rounds on a device's [side, side] block a and [1, side, side] weight b: a = tanh(a @ b)
  then a + psum(a[0, 0]) over every axis of the mesh."""
  everything = tuple(mesh.axis_names)

  def body(a, b):
    for _ in range(ROUNDS):
      a = jnp.tanh(a @ b[0])
      a = a + jax.lax.psum(a[:1, :1], everything)
    return a

  spec = P(everything)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))


def wait_after(side: int, mesh, terms, repeats: int) -> tuple[float, float]:
  """(the priced seconds of a round's segment, the measured wait per all-reduce) of `rounds_program` at `side`."""
  devices, rng = mesh.devices.size, np.random.default_rng(0)
  args = (
    jnp.asarray(rng.uniform(-1, 1, (devices * side, side)), jnp.float32),
    jnp.asarray(rng.uniform(-1, 1, (devices, side, side)) / side, jnp.float32),
  )
  args = program_calibration.placed(args, mesh)
  compiled = rounds_program(mesh, side).lower(*args).compile()
  seconds = interleaved_timing.median_seconds(compiled, args, repeats)
  plain = dataclasses.replace(terms, arrival=())
  priced = program_price.price_measured(compiled, mesh, plain)
  hlo = compiled.as_text()
  before = program_price.segment_seconds(hlo, program_ops.parse(hlo), plain)
  reduces = [c.collective.name for c in priced.collectives if c.collective.axes]
  segment_s = float(np.mean([before[name] for name in reduces]))
  return segment_s, max(0.0, (seconds - priced.serial_s) / len(reduces))
