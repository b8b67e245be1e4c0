"""The terms a compiled program's price needs, measured on the mesh at hand by microbenchmarks only (no measured point
is fitted): per collective kind and mesh axes a launch time and a time per byte, and per compute op category
(`moejax.cost.program_ops`) a device's rate with every device of the mesh busy at once (simulated CPU devices share
the host's cores: one busy device's rate is not the mesh's), plus the cost of launching one op.

  terms = terms_from(seconds, compute, mesh)   # {(kind, axes): (alpha_s, beta_s_per_byte)}, rates, launch
  program_price.price_measured(compiled, mesh, terms)

`moejax.study.arrival_calibration` times the programs (`collective_keys`, `collective_program`) and the compute.

Each collective is timed at three sizes per device (`SIZES`: a size exchange's, a layer's exchange, a large block of
rows) as its own jitted shard_map program, all of them in the same rounds (`interleaved_timing`: the median of
`repeats` calls each, after a warm-up): alpha and beta are the line through the first two (beta clipped at 0), and
above the middle size the time per byte is the slope to the third (`Terms.large`): on a host whose caches a large
exchange overflows, the cost per byte grows with the size, and one line through the ends overprices a layer's.
Timed again moving `OPERANDS` small arrays at once (one instruction of that many operands, as XLA's combiner makes
of gradients), the time beyond alpha and bytes per further operand is `Terms.per_operand`. The kinds whose
result has their operand's shape are timed as a chain of `LINKS`, each on the one before's result: the cost of one
that follows another directly (`Terms.chained`; a lone one's alpha also holds its devices' arrival from compute).

All-reduces also at `TINY` bytes per operand, alone and of `OPERANDS` (`Terms.tiny`): a layer's statistics, a few
floats, run another algorithm than a ring; below the small size, alpha and per-operand cost are interpolated in bytes.

Compute: `moejax.study.compute_calibration`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.study import interleaved_timing

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
SIZES = (256, 1 << 17, 1 << 20)  # bytes per device: a plan's size exchange, a layer's exchange, a large block
TINY = 4  # bytes per operand of the all-reduces timed for their cost at a few elements (`Terms.tiny`)
OPERANDS = 8  # arrays in the many-operand form of each collective timed for its cost per operand
LINKS = 4  # collectives in the chain timed for the cost of one that follows another
CHAINABLE = ("all-reduce", "all-to-all", "collective-permute")  # the kinds whose result can feed the next link


@dataclasses.dataclass(frozen=True)
class Terms:
  """per_kind: {(kind, axes): (alpha_s, beta_s_per_byte)}; one device's rates with every device busy: flops_per_s
  (matmul), bytes_per_s (elementwise), op_bytes_per_s ({'gather' | 'scatter' | 'sort': bytes/s}; a category absent
  runs at bytes_per_s); launch_s: seconds per op run; call_s: seconds per program call; per_operand: {(kind, axes):
  seconds per operand of one instruction past its first} (absent: 0); chained: {(kind, axes): seconds of one that
  directly follows another collective, its bytes aside} (absent: alpha); tiny: {(kind, axes): (alpha_s,
  per_operand_s) at TINY bytes per operand} (absent: the small size's line holds below it too); arrival: the wait at a
  collective after compute, ((s1, w1), (s2, w2)) (`moejax.study.arrival_calibration`, at an all-reduce; absent: none);
  arrival_by_kind: {kind: those points} at a collective of another kind after the same compute (at a permute a device
  waits for its source alone; an all-to-all's alpha, timed alone, holds less of that wait than an all-reduce's)
  (absent: arrival's); large:
  {(kind, axes): seconds per byte above SIZES[1]} (absent: beta); skew: {(kind, axes): seconds a program's first
  collective of that kind waits beyond its alpha for the job's processes, which each start the call on their own}
  (`moejax.study.arrival_calibration`; absent: 0)."""

  per_kind: dict
  flops_per_s: float
  bytes_per_s: float
  op_bytes_per_s: dict = dataclasses.field(default_factory=dict)
  launch_s: float = 0.0
  call_s: float = 0.0
  per_operand: dict = dataclasses.field(default_factory=dict)
  chained: dict = dataclasses.field(default_factory=dict)
  tiny: dict = dataclasses.field(default_factory=dict)
  arrival: tuple = ()
  large: dict = dataclasses.field(default_factory=dict)
  arrival_by_kind: dict = dataclasses.field(default_factory=dict)
  skew: dict = dataclasses.field(default_factory=dict)

  def arrival_points(self, kind: str) -> tuple:
    """The wait's calibrated points at a collective of `kind`: its own where measured, else `arrival`."""
    return self.arrival_by_kind.get(kind) or self.arrival

  def byte_seconds(self, kind: str, axes: tuple, nbytes: float) -> float:
    """The seconds of a collective's `nbytes` beyond its alpha: beta a byte up to SIZES[1], `large`'s above."""
    beta = self.per_kind[(kind, axes)][1]
    above = max(0.0, nbytes - SIZES[1])
    return beta * (nbytes - above) + self.large.get((kind, axes), beta) * above

  def collective_seconds(
    self, kind: str, axes: tuple, nbytes: float, operands: int = 1, after_collective: bool = False
  ) -> float:
    """One run of a collective of `kind` over `axes` moving `nbytes` per device in `operands` arrays, right after
    another collective or not (`program.Collective.chained`)."""
    alpha = self.per_kind[(kind, axes)][0]
    alpha = self.chained.get((kind, axes), alpha) if after_collective else alpha
    per_operand = self.per_operand.get((kind, axes), 0.0)
    each = nbytes / max(operands, 1)
    if (kind, axes) in self.tiny and each < SIZES[0]:  # toward the tiny point, linearly in the bytes per operand
      at = max(0.0, (each - TINY) / (SIZES[0] - TINY))
      tiny_alpha, tiny_per_operand = self.tiny[(kind, axes)]
      alpha = min(alpha, tiny_alpha + at * (alpha - tiny_alpha))
      per_operand = tiny_per_operand + at * (per_operand - tiny_per_operand)
    return alpha + (operands - 1) * per_operand + self.byte_seconds(kind, axes, nbytes)

  def op_seconds(self, category: str, flops: float, nbytes: float) -> float:
    """One run of an op of `category` (`program_ops.CATEGORIES`): launch + its FLOPs (a matmul) or bytes at its
    category's rate."""
    if category == "matmul":
      return self.launch_s + flops / self.flops_per_s
    return self.launch_s + nbytes / self.op_bytes_per_s.get(category, self.bytes_per_s)

  def as_dict(self) -> dict:
    rows = [
      dict(
        kind=k,
        axes=list(a),
        alpha_s=v[0],
        beta_s_per_byte=v[1],
        large_s_per_byte=self.large.get((k, a), v[1]),
        per_operand_s=self.per_operand.get((k, a), 0.0),
        chained_s=self.chained.get((k, a)),
        tiny_s=self.tiny.get((k, a)),
        skew_s=self.skew.get((k, a), 0.0),
      )
      for (k, a), v in self.per_kind.items()
    ]
    return dict(
      collectives=rows,
      flops_per_s=self.flops_per_s,
      bytes_per_s=self.bytes_per_s,
      op_bytes_per_s=dict(self.op_bytes_per_s),
      launch_s=self.launch_s,
      call_s=self.call_s,
      arrival=[list(p) for p in self.arrival],
      arrival_by_kind={k: [list(p) for p in points] for k, points in self.arrival_by_kind.items()},
    )


def _many(kind: str, axes: tuple[str, ...], mesh):
  """The collective of `_body` on a tuple of blocks: an all-reduce of them all at once (one instruction of many
  operands, as jax's psum of a pytree binds it), any other kind one per block."""
  if kind == "all-reduce":
    return lambda *blocks: jax.lax.psum(blocks, axes)
  one = _body(kind, axes, mesh)
  return lambda *blocks: tuple(one(b) for b in blocks)


def _chain(kind: str, axes: tuple[str, ...], mesh, links: int):
  """`links` collectives of `_body`, each on the one before's result."""
  one = _body(kind, axes, mesh)
  return lambda a: functools.reduce(lambda x, _: one(x), range(links), a)


def _body(kind: str, axes: tuple[str, ...], mesh):
  """One collective of `kind` over `axes` on a device's [rows, 8] f32 block."""
  if kind == "all-reduce":
    return lambda a: jax.lax.psum(a, axes)
  if kind == "all-gather":
    return lambda a: jax.lax.all_gather(a, axes, tiled=True)[: a.shape[0]]
  if kind == "reduce-scatter":
    return lambda a: jax.lax.psum_scatter(a, axes, scatter_dimension=0, tiled=True)
  if kind == "all-to-all":
    return lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)
  size = int(np.prod([mesh.shape[a] for a in axes]))  # a ring shift: every device sends its block to the next
  return lambda a: jax.lax.ppermute(a, axes, [(i, (i + 1) % size) for i in range(size)])


def time_collective(
  kind: str, axes: tuple[str, ...], nbytes: int, mesh, repeats: int, operands: int = 1, links: int = 1
) -> float:
  """Median seconds of `collective_program`'s call, timed alone."""
  return interleaved_timing.median_seconds(*collective_program(kind, axes, nbytes, mesh, operands, links), repeats)


def collective_program(kind: str, axes: tuple[str, ...], nbytes: int, mesh, operands: int = 1, links: int = 1):
  """(fn, args): one `kind` over `axes` moving `nbytes` per device in each of `operands` arrays (f32 blocks of 8
  columns, fewer below 32 bytes; `_many` where several), or a chain of `links` of them (`_chain`)."""
  everything = tuple(mesh.axis_names)
  columns = min(8, max(1, nbytes // 4))  # [rows, columns] f32: down to one float (TINY)
  rows = max(1, nbytes // (4 * columns))
  if kind in ("all-to-all", "reduce-scatter"):  # they split rows over the group
    rows += (-rows) % int(np.prod([mesh.shape[a] for a in axes]))
  body = _many(kind, axes, mesh) if operands > 1 else _chain(kind, axes, mesh, links)
  spec = (P(everything),) * operands
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P(everything) if operands == 1 else spec))
  blocks = tuple(jnp.full((mesh.devices.size * rows, columns), i + 1.0, jnp.float32) for i in range(operands))
  return fn, placed(blocks, mesh)


def placed(args: tuple, mesh) -> tuple:
  """args split along their first dim over every device, where the programs read them: an array left on one device
  would be copied out to the mesh on every call, and the copy timed with the program."""
  return jax.device_put(args, NamedSharding(mesh, P(tuple(mesh.axis_names))))


def line(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
  """(alpha, beta) of the line through (bytes, seconds) points small and large, beta clipped at 0."""
  beta = max(0.0, (large[1] - small[1]) / (large[0] - small[0]))
  return small[1] - beta * small[0], beta


def axis_sets(mesh) -> list[tuple[str, ...]]:
  """Each axis of more than one device alone, and all of them together where several are."""
  axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  return [(a,) for a in axes] + ([tuple(axes)] if len(axes) > 1 else [])


def _timings(kind: str) -> list[tuple[int, int, int]]:
  """The (nbytes, operands, links) a kind is timed at: SIZES, OPERANDS at the small size, all-reduces at TINY alone
  and of OPERANDS, the CHAINABLE kinds in a chain of LINKS."""
  out = [(size, 1, 1) for size in SIZES] + [(SIZES[0], OPERANDS, 1)]
  out += [(TINY, 1, 1), (TINY, OPERANDS, 1)] if kind == "all-reduce" else []
  return out + ([(SIZES[0], 1, LINKS)] if kind in CHAINABLE else [])


def collective_keys(mesh) -> list[tuple]:
  """(kind, axes, nbytes, operands, links) of every collective program timed on `mesh`: each kind over every axis
  set (`axis_sets`) at `_timings`."""
  return [(kind, axes, *t) for kind in KINDS for axes in axis_sets(mesh) for t in _timings(kind)]


def terms_from(seconds: dict, compute: dict, mesh, say=print) -> Terms:
  """The Terms of the collectives' `seconds` ({collective_keys' key: seconds}) and the `compute` fields
  (`compute_calibration.compute_from`), each said in a line."""
  per_kind, per_operand, chained, tiny, large = {}, {}, {}, {}, {}
  for kind in KINDS:
    for axes in axis_sets(mesh):
      at = lambda nbytes, operands=1, links=1: seconds[(kind, axes, nbytes, operands, links)]
      points = [(size, at(size)) for size in SIZES]
      alpha, beta = per_kind[(kind, axes)] = line(*points[:2])
      large[(kind, axes)] = line(*points[1:])[1]
      many = at(SIZES[0], OPERANDS)
      per_operand[(kind, axes)] = max(0.0, (many - alpha - beta * OPERANDS * SIZES[0]) / (OPERANDS - 1))
      if kind == "all-reduce":
        lone, many = at(TINY), at(TINY, OPERANDS)
        tiny[(kind, axes)] = (lone, max(0.0, (many - lone) / (OPERANDS - 1)))
      if kind in CHAINABLE:
        chained[(kind, axes)] = max(0.0, (at(SIZES[0], 1, LINKS) - points[0][1]) / (LINKS - 1) - beta * SIZES[0])
      say(
        f"{kind:<20}{','.join(axes):<10} {alpha * 1e6:9.1f} us + {beta * 1e9:7.3f} ns/B "
        f"({large[(kind, axes)] * 1e9:.3f} above {SIZES[1] >> 10} KiB), "
        f"{per_operand[(kind, axes)] * 1e6:9.1f} us per further operand, "
        f"{chained.get((kind, axes), alpha) * 1e6:9.1f} us after another"
        + (f", at {TINY} B {tiny[(kind, axes)][0] * 1e6:.1f} us + {tiny[(kind, axes)][1] * 1e6:.1f} us per further "
           "operand" if (kind, axes) in tiny else "")
      )  # fmt: skip
  terms = Terms(per_kind, **compute, per_operand=per_operand, chained=chained, tiny=tiny, large=large)
  rates = ", ".join(f"{k} {v / 1e9:.3f} GB/s" for k, v in terms.op_bytes_per_s.items())
  say(
    f"device rates with all {mesh.devices.size} busy: matmul {terms.flops_per_s / 1e9:.2f} GFLOP/s, elementwise "
    f"{terms.bytes_per_s / 1e9:.3f} GB/s, {rates}; launch {terms.launch_s * 1e6:.1f} us per op, call "
    f"{terms.call_s * 1e6:.0f} us"
  )
  return terms
