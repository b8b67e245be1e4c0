"""The backward contention model against a time-stepped simulation and hand-computed timelines; prioritized
never slower than the other schedules; errors that name the bad value (Lina's figures: tests/test_validation.py)."""

import numpy as np
import pytest

from moejax.cost import contention
from moejax.validation import ConfigError


def stepped(blocks, schedule, dt):
  """(compute end, end) by advancing time in steps of dt: the link serves the running all-to-all and the
  pending all-reduce at rate 1 each alone, 1/2 each together (naive), the all-to-all only (prioritized)."""
  segments = []
  for b in blocks:
    segments += [
      ("a2a", b.a2a_s, 0.0),
      ("compute", b.ffn_s, 0.0),
      ("a2a", b.a2a_s, 0.0),
      ("compute", b.dense_s, b.allreduce_s),
    ]
  t, pending = 0.0, 0.0
  for kind, amount, ready in segments:
    left = amount
    while left > 1e-12:
      step = min(dt, left) if kind == "compute" else dt
      if kind == "a2a":
        both = schedule == "naive_overlap" and pending > 0
        rate = 0.5 if both else 1.0
        step = min(dt, left / rate)
        left -= rate * step
        if both:
          pending = max(0.0, pending - 0.5 * step)
      else:
        left -= step
        if schedule != "default":
          pending = max(0.0, pending - step)
      t += step
    pending += ready
  return t, t + pending


def random_blocks(rng, count):
  return [contention.Block(*rng.uniform(0.05, 1.0, 4) * (rng.random(4) < 0.9)) for _ in range(count)]


def test_matches_a_time_stepped_simulation():
  rng = np.random.default_rng(0)
  for _ in range(6):
    blocks = random_blocks(rng, int(rng.integers(1, 4)))
    for schedule in contention.SYNC_ORDERS:
      got = contention.backward(blocks, schedule)
      compute_end, end = stepped(blocks, schedule, 1e-4)
      assert got.compute_end_s == pytest.approx(compute_end, abs=2e-3)
      assert got.end_s == pytest.approx(end, abs=2e-3)


def test_one_block_by_hand():
  """Ready all-reduce r = 5 before a block a = 2, f = 1, d = 3 (and a block of compute 1 that readies it)."""
  blocks = [contention.Block(0, 0, 1, 5), contention.Block(2, 1, 3, 0)]
  default, naive, prio = (contention.backward(blocks, s) for s in contention.SYNC_ORDERS)
  assert (default.compute_end_s, default.end_s) == (9, 14)  # 1 + 2 + 1 + 2 + 3, then the all-reduce alone
  # naive: A2A shares 2 units (takes 4; 3 left), FFN drains 1 (2 left), A2A shares 2 (takes 4), compute
  assert naive.a2a_s[2:] == (4, 4) and (naive.compute_end_s, naive.end_s) == (13, 13)
  # prioritized: A2As alone; FFN drains 1, the last compute 3 more; 1 left after the backward
  assert prio.a2a_s[2:] == (2, 2) and (prio.compute_end_s, prio.end_s) == (9, 10)


def test_prioritized_is_never_slower_and_never_stretches_the_all_to_all():
  rng = np.random.default_rng(1)
  for _ in range(200):
    blocks = random_blocks(rng, int(rng.integers(1, 6)))
    runs = {s: contention.backward(blocks, s) for s in contention.SYNC_ORDERS}
    prio = runs["prioritized"]
    assert prio.end_s <= runs["default"].end_s + 1e-12
    assert prio.end_s <= runs["naive_overlap"].end_s + 1e-12
    assert prio.a2a_s == tuple(b.a2a_s for b in blocks for _ in (0, 1))
    assert runs["default"].end_s == pytest.approx(
      sum(2 * b.a2a_s + b.ffn_s + b.dense_s + b.allreduce_s for b in blocks)
    )


@pytest.mark.parametrize(
  "call,field",
  [
    (lambda: contention.Block(-1.0, 1, 1, 1), "Block.a2a_s"),
    (lambda: contention.Block(1, float("nan"), 1, 1), "Block.ffn_s"),
    (lambda: contention.Block(1, 1, "3", 1), "Block.dense_s"),
    (lambda: contention.Block(1, 1, 1, float("inf")), "Block.allreduce_s"),
    (lambda: contention.backward([contention.Block(1, 1, 1, 1)], "fifo"), "schedule"),
    (lambda: contention.backward([], "default"), "blocks"),
  ],
)
def test_bad_inputs_name_the_value(call, field):
  with pytest.raises(ConfigError) as info:
    call()
  assert info.value.field == field
