"""A mesh's program terms (`moejax.study.program_calibration.Terms`), measured on it: the collectives'
(`program_calibration`) and compute (`compute_calibration`) microbenchmarks, and the wait at a collective after
compute (`moejax.cost.program_segments`), all timed in the same interleaved rounds.

  terms = measure(mesh)                              # once
  calibration = MeshCalibration(mesh)                # through a sweep:
  terms = calibration.retime(9)                      # before each point, the terms of every round so far

A program of ROUNDS rounds of (a per-device [side, side] matmul, then an all-reduce over every axis of one float that
depends on it, added back) is timed at two sides (`SIDES`: a segment of well under a millisecond on a 2-core host,
and one of several), and priced by `moejax.cost.program_price.price_measured` with the terms measured before (no
wait). The excess of its time over that price, per all-reduce, is the wait after a segment of its priced seconds:
the two points (segment seconds, wait seconds) of `Terms.arrival`, each wait at least 0. The same rounds with a ring
permute or an all-to-all in place of the all-reduce give their own points (`Terms.arrival_by_kind`): at a permute a
device waits for its source alone, not for the last of the group (on the 2-process CPU job the flat ring's permutes
priced at the all-reduce's wait came to twice their time inside the layer); an all-to-all timed alone is cheaper than
an all-reduce, its alpha holds less of the wait, and after compute it pays more beyond it (on the 2-process CPU job's
1 x 4 mesh, one process's devices whose collectives gloo carries: 0.4-0.9 ms beyond its alpha of about 0.5 ms, where the
all-reduce's alpha of 1.5-1.8 ms held all of its wait). Microbenchmarks only: no
measured point of a sweep enters them.

The same program at the larger side with an all-reduce of OPERANDS arrays per round, each a slice of the round's
result, gives the all-reduce's cost per operand past the first over every axis (`sync_key`) in the state a layer's
statistics and a step's gradient sync run it in, right after compute: its time beyond its price without that cost and
beyond the one-array program's wait, per round and further operand. It is timed at the two sizes the terms hold one
for (`OPERAND_FLOATS`: TINY bytes an operand for `Terms.tiny`, the small size for `Terms.per_operand`). The rounds' many-operand
all-reduces, timed between other collectives, run in another state, and their cost per operand differs from it by up
to 2.5x either way on the 2 x 4 CPU job.

A sweep re-times a mesh's terms before each of its points (`MeshCalibration`): every program compiled once, timed
again in more rounds, the terms from each program's time over all its rounds so far: a compute benchmark's and a wait
program's median (a wait program is priced with the skew at its first collective; its median, as a measured point's,
keeps the spread of the waits, which the lower quartile drops; the many-operand programs' too, as `per_operand_from`
subtracts a wait program's median wait from them), a program holding a lone collective's lower quartile
(`COLLECTIVE_QUANTILE`). Each round of such a program holds the job's
processes' launch skew at its first collective, which only adds; a lone small collective's median beyond its quartile
is `Terms.skew`, which a priced program pays once, at its first collective. A burst of noise on
the host during one calibration then moves a round's share of the samples, not every term of the mesh.
"""

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.cost import program_ops, program_price
from moejax.study import compute_calibration, interleaved_timing, program_calibration
from moejax.validation import require

ROUNDS = 8
SIDES = (128, 512)
OPERANDS = program_calibration.OPERANDS
OPERAND_FLOATS = (program_calibration.TINY // 4, program_calibration.SIZES[0] // 4)  # floats per operand, `sync_key`
# The time over the rounds of a program that holds a lone collective: its lower quartile, where the compute
# benchmarks and the wait programs take their median. Its first collective meets the job's processes as each starts the
# call on its own: a skew that only adds, and that a program's later collectives, their processes already together,
# do not pay. On the 2-process CPU job a node,gpu collective alone took 0.5 to 50 ms from round to round (median 7 to
# 17 ms), the same kind inside a layer a median 0.2 ms. The median's excess over the quartile is `Terms.skew`, which
# a program pays once, at its first collective.
COLLECTIVE_QUANTILE = 0.25
WAITED = ("all-reduce", "collective-permute", "all-to-all")  # `Terms.arrival`, then `Terms.arrival_by_kind`'s


def measure(mesh, repeats: int = 9, say=print) -> program_calibration.Terms:
  """The mesh's terms from `repeats` rounds of its microbenchmarks (`MeshCalibration`), with `Terms.arrival` (none on
  one device: nothing to wait for)."""
  return MeshCalibration(mesh).retime(repeats, say)


def rounds_program(mesh, side: int, operands: int = 1, width: int = 1, kind: str = "all-reduce"):
  """jit(shard_map) of ROUNDS rounds on a device's [side, side] block a and [1, side, side] weight b: a = tanh(a @ b)
  then a + psum(a[0, 0]) over every axis of the mesh (`kind` 'collective-permute': a + a[0, 0] of the device before
  it in a ring over every device; 'all-to-all': a + the sum of a[:devices, 0], each row to a device); with several
  `operands`, one psum of that many [1, width] slices of a's first row and a + each one's sum."""
  everything = tuple(mesh.axis_names)
  require(
    max(operands * width, mesh.devices.size) <= side,
    "side",
    side,
    f">= {operands} operands x {width} floats and the devices",
  )
  require(kind in WAITED, "kind", kind, f"one of {WAITED}")
  require(operands == 1 or kind == "all-reduce", "operands", operands, "1 for a permute")
  ring = [(i, (i + 1) % mesh.devices.size) for i in range(mesh.devices.size)]

  def body(a, b):
    for _ in range(ROUNDS):
      a = jnp.tanh(a @ b[0])
      if kind == "collective-permute":
        a = a + jax.lax.ppermute(a[:1, :1], everything, ring)
      elif kind == "all-to-all":
        a = a + jax.lax.all_to_all(a[: mesh.devices.size, :1], everything, 0, 0, tiled=True).sum()
      elif operands == 1:
        a = a + jax.lax.psum(a[:1, :1], everything)
      else:
        sums = jax.lax.psum(tuple(a[:1, i * width : (i + 1) * width] for i in range(operands)), everything)
        a = a + sum(s.sum() for s in sums)
    return a

  spec = P(everything)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))


def wait_program(side: int, mesh, operands: int = 1, width: int = 1, kind: str = "all-reduce") -> tuple:
  """(compiled, args): `rounds_program` at `side` (its `operands` of `width`, its `kind`) on random blocks placed on
  the mesh."""
  devices, rng = mesh.devices.size, np.random.default_rng(0)
  args = (
    jnp.asarray(rng.uniform(-1, 1, (devices * side, side)), jnp.float32),
    jnp.asarray(rng.uniform(-1, 1, (devices, side, side)) / side, jnp.float32),
  )
  args = program_calibration.placed(args, mesh)
  return rounds_program(mesh, side, operands, width, kind).lower(*args).compile(), args


def wait_from(compiled, mesh, terms, seconds: float) -> tuple[float, float]:
  """(the priced seconds of a round's segment, the wait per collective) of `wait_program`'s `compiled` timed at
  `seconds`: the excess over its price without a wait, at least 0."""
  plain = dataclasses.replace(terms, arrival=(), arrival_by_kind={})  # its median holds the skew at its first
  priced = program_price.price_measured(compiled, mesh, plain)
  hlo = compiled.as_text()
  before = program_price.segment_seconds(hlo, program_ops.parse(hlo), plain)
  waited = [c.collective.name for c in priced.collectives if c.collective.axes]
  segment_s = float(np.mean([before[name] for name in waited]))
  return segment_s, max(0.0, (seconds - priced.serial_s) / len(waited))


def sync_key(mesh) -> tuple:
  """The (kind, axes) of an all-reduce over every axis of the mesh of more than one device: a gradient sync's."""
  return ("all-reduce", program_calibration.axis_sets(mesh)[-1])


def per_operand_from(compiled, mesh, terms, seconds: float, wait_s: float) -> float:
  """The cost per operand past the first of `sync_key`'s all-reduce after compute, from `wait_program`'s `compiled`
  with OPERANDS operands timed at `seconds` and the wait `wait_s` of the one-operand program at its side: the excess
  over its price without a wait or a cost per operand (neither `Terms.per_operand`'s nor `Terms.tiny`'s), less the
  wait, per all-reduce and further operand; at least 0."""
  key = sync_key(mesh)
  tiny = {**terms.tiny, key: (terms.tiny[key][0], 0.0)} if key in terms.tiny else terms.tiny
  plain = dataclasses.replace(
    terms, arrival=(), arrival_by_kind={}, skew={}, per_operand={**terms.per_operand, key: 0.0}, tiny=tiny
  )
  priced = program_price.price_measured(compiled, mesh, plain)
  reduces = [c for c in priced.collectives if c.collective.axes]
  operands = {c.collective.operands for c in reduces}
  require(operands == {OPERANDS}, "all-reduce operands", operands, f"{{{OPERANDS}}}: one instruction of them a round")
  excess = (seconds - priced.serial_s) / sum(c.collective.count for c in reduces) - wait_s
  return max(0.0, excess / (OPERANDS - 1))


class MeshCalibration:
  """A mesh's terms re-timed through a sweep (module docstring): `retime(repeats)` adds `repeats` interleaved rounds
  of every program (the collectives of `program_calibration.collective_keys`, the compute benchmarks, the waits) and
  returns the terms of each program's time over all rounds so far: a compute benchmark's and a wait program's (one
  operand or many) median, a program holding a lone collective's lower quartile (COLLECTIVE_QUANTILE), and `Terms.skew`."""

  def __init__(self, mesh):
    self.mesh = mesh
    self.keys = program_calibration.collective_keys(mesh)
    collectives = [program_calibration.collective_program(k[0], k[1], k[2], mesh, k[3], k[4]) for k in self.keys]
    compute, self.found = compute_calibration.compute_programs(mesh)
    many = mesh.devices.size > 1
    self.waits = [wait_program(side, mesh, kind=kind) for kind in WAITED for side in SIDES] if many else []
    self.many = [wait_program(SIDES[-1], mesh, OPERANDS, w) for w in OPERAND_FLOATS] if many else []
    self.programs = collectives + compute + self.waits + self.many
    self.times = [[] for _ in self.programs]

  @property
  def rounds(self) -> int:
    return len(self.times[0])

  def retime(self, repeats: int, say=print) -> program_calibration.Terms:
    # Only the first rounds warm every program: later ones join a median over many rounds.
    fresh = interleaved_timing.samples(self.programs, repeats, warm=self.rounds == 0)
    for kept, new in zip(self.times, fresh):
      kept.extend(new)
    n, c = len(self.keys), len(self.found)
    seconds = [
      statistics.median(t) if i >= n else float(np.quantile(t, COLLECTIVE_QUANTILE)) for i, t in enumerate(self.times)
    ]
    skew = {  # a lone small collective's median beyond its quartile: the skew the quartile leaves out
      key[:2]: max(0.0, statistics.median(t) - seconds[i])
      for i, (key, t) in enumerate(zip(self.keys, self.times))
      if key[2:] == (program_calibration.SIZES[0], 1, 1)
    }
    compute = compute_calibration.compute_from(self.found, seconds[n : n + c])
    terms = program_calibration.terms_from(dict(zip(self.keys, seconds[:n])), compute, self.mesh, say=say)
    terms = dataclasses.replace(terms, skew=skew)
    if not self.waits:
      return terms
    waits = seconds[n + c : n + c + len(self.waits)]
    found = [wait_from(compiled, self.mesh, terms, s) for (compiled, _), s in zip(self.waits, waits)]
    by_kind = {kind: tuple(found[i * len(SIDES) : (i + 1) * len(SIDES)]) for i, kind in enumerate(WAITED)}
    points = by_kind.pop(WAITED[0])
    key = sync_key(self.mesh)
    tiny, small = (
      per_operand_from(compiled, self.mesh, terms, s, points[-1][1])
      for (compiled, _), s in zip(self.many, seconds[-len(self.many) :])
    )
    say(
      "wait at a collective after compute: "
      + ", ".join(f"{w * 1e6:.0f} us after {s * 1e6:.0f} us" for s, w in points)
      + "".join(
        f"; at {kind}: " + ", ".join(f"{w * 1e6:.0f} us after {s * 1e6:.0f} us" for s, w in kind_points)
        for kind, kind_points in by_kind.items()
      )
      + f"; {key[0]} over {','.join(key[1])} after compute, per further operand: {small * 1e6:.1f} us (between "
      f"collectives {terms.per_operand[key] * 1e6:.1f}), at {program_calibration.TINY} B {tiny * 1e6:.1f} us (between"
      f" collectives {terms.tiny[key][1] * 1e6:.1f}); the processes' launch skew at a program's first collective "
      f"{min(skew.values()) * 1e6:.0f}-{max(skew.values()) * 1e6:.0f} us"
    )
    return dataclasses.replace(
      terms,
      arrival=points,
      arrival_by_kind=by_kind,
      per_operand={**terms.per_operand, key: small},
      tiny={**terms.tiny, key: (terms.tiny[key][0], tiny)},
    )
