"""All-to-all against the gradient all-reduce in the backward pass (Lina, ATC'23, Sec. 2.2 and 4).

The backward of an MoE block runs, in order: all-to-all, expert FFN, all-to-all, dense compute (gate,
attention), after which the block's data-parallel gradient is ready to be all-reduced. Both
collectives are bound by the same link (the NIC once they cross nodes), so when they overlap they
share it; compute leaves it idle. Three schedules of the all-reduce:

  default        after the whole backward, one all-reduce of every gradient (no overlap);
  naive_overlap  each gradient as soon as it is ready, on its own stream: overlapping an all-to-all,
                 each gets half the link (fair sharing; DeepSpeed's behaviour in Lina Fig. 5);
  prioritized    Lina: gradients split into micro-ops that run only while no all-to-all does, so the
                 all-to-all always has the whole link and the all-reduce fills the compute gaps.

A fluid model: a collective is `work` seconds alone on the link and progresses at rate 1, or 1/2
while shared. Micro-ops are taken in the limit of small size (Lina's 30 MB default against all-reduces
of hundreds of MB per step; its measured 1.7% partitioning overhead, Sec. 7.2, is not priced), so
`prioritized` fills every gap exactly. Then it is never slower than the other two: its all-to-alls
and compute start no later, and its link is busy whenever work is pending.

Lina's figures are reproduced with it in experiments/validation/lina.py.
"""

import dataclasses
import math
from typing import NamedTuple

from moejax.validation import is_number, require


class SyncOrder(NamedTuple):
  """When the gradient all-reduce runs against the all-to-alls (see the module doc): shares_link, it runs beside
  an all-to-all, each at half rate; fills_compute, it runs alone on the link while the GPU computes."""

  name: str
  shares_link: bool
  fills_compute: bool


ORDERS = {
  o.name: o
  for o in (
    SyncOrder("default", shares_link=False, fills_compute=False),
    SyncOrder("naive_overlap", shares_link=True, fills_compute=True),
    SyncOrder("prioritized", shares_link=False, fills_compute=True),
  )
}
SYNC_ORDERS = tuple(ORDERS)


@dataclasses.dataclass(frozen=True)
class Block:
  """Seconds of one MoE block's backward, each alone on its resource.

  a2a_s: one backward all-to-all (there are two); ffn_s: expert FFN backward between them;
  dense_s: the rest (gate, attention), after which the gradient is ready; allreduce_s: its all-reduce.
  """

  a2a_s: float
  ffn_s: float
  dense_s: float
  allreduce_s: float

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      require(
        is_number(value) and math.isfinite(value) and value >= 0,
        f"Block.{field.name}",
        value,
        "a finite number of seconds >= 0",
      )


@dataclasses.dataclass(frozen=True)
class Backward:
  """One backward under a schedule: compute_end_s (the last block's dense compute ends), end_s (the
  last gradient is also reduced), a2a_s [2 * blocks] each all-to-all's duration as stretched."""

  schedule: str
  compute_end_s: float
  end_s: float
  a2a_s: tuple[float, ...]


def backward(blocks, schedule: str) -> Backward:
  """The backward of `blocks` (in backward order) under `schedule` (one of SYNC_ORDERS)."""
  require(schedule in SYNC_ORDERS, "schedule", schedule, f"one of {SYNC_ORDERS}")
  blocks = list(blocks)
  require(len(blocks) >= 1 and all(isinstance(b, Block) for b in blocks), "blocks", blocks, "a non-empty list of Block")
  order = ORDERS[schedule]
  t, pending, a2a = 0.0, 0.0, []  # pending: all-reduce work ready and not yet done
  for block in blocks:
    for compute_s, ready_s in ((block.ffn_s, 0.0), (block.dense_s, block.allreduce_s)):
      shared = min(pending, block.a2a_s) if order.shares_link else 0.0
      a2a.append(block.a2a_s + shared)  # both at half rate until the shorter one is done
      pending -= shared
      if order.fills_compute:
        pending -= min(pending, compute_s)  # the all-reduce alone on the link during compute
      t += a2a[-1] + compute_s
      pending += ready_s
  return Backward(schedule, t, t + pending, tuple(a2a))
