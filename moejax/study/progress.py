"""Progress of a long loop of items (a sweep's points, a study's runs): `i/n what, elapsed 1m05s, ETA 2m10s`.

Items may be of kinds that take very different times (a sweep's measured points take tens of seconds, its modelled
ones a few): the ETA is, per kind, the mean time of that kind's items finished so far times its items left. A kind
none of whose items has finished yet has no time to go by; its items are named beside the ETA instead of guessed
(`ETA 4m10s + 14 modelled`). Items that cost nothing (a point stored by an earlier run) are not counted:
`Progress(total)` takes only the items that will be done here.
"""

import time

from moejax.durations import duration


class Progress:
  """Counts items as they finish; `total`: their number, or {kind: number} (items of one kind: `step(what, kind)`).
  `step` returns the line to print for the item just done."""

  def __init__(self, total: int | dict[str, int], clock=time.monotonic):
    self.left = dict(total) if isinstance(total, dict) else {None: total}
    self.total, self.clock = sum(self.left.values()), clock
    self.seconds = dict.fromkeys(self.left, 0.0)  # per kind: the time its finished items took
    self.finished = dict.fromkeys(self.left, 0)
    self.start = self.last = clock()

  def step(self, what: str, kind: str | None = None) -> str:
    if self.left.get(kind, 0) <= 0:
      raise ValueError(f"no {kind!r} item left to finish: {self.left}")
    now = self.clock()
    self.left[kind] -= 1
    self.finished[kind] += 1
    self.seconds[kind] += now - self.last
    self.last = now
    elapsed = now - self.start
    done = sum(self.finished.values())
    if done == self.total:
      return f"{done}/{self.total} {what}, elapsed {duration(elapsed)}, done"
    timed = [k for k in self.left if self.finished[k] and self.left[k]]
    eta = [duration(sum(self.seconds[k] / self.finished[k] * self.left[k] for k in timed))] if timed else []
    unseen = [f"{self.left[k]} {k}" for k in self.left if not self.finished[k] and self.left[k]]
    return f"{done}/{self.total} {what}, elapsed {duration(elapsed)}, ETA {' + '.join(eta + unseen)}"
