"""Progress of a long loop of similar items (a sweep's points, a study's runs): `i/n what, elapsed 1m05s, ETA 2m10s`.

The ETA is the mean time of the items finished so far times the items left. Items that cost nothing (a point
stored by an earlier run) are not counted: `Progress(total)` takes only the items that will be done here.
"""

import time

from moejax.durations import duration


class Progress:
  """Counts `total` items as they finish; `step(what)` returns the line to print for the one just done."""

  def __init__(self, total: int, clock=time.monotonic):
    self.total, self.done, self.clock = total, 0, clock
    self.start = clock()

  def step(self, what: str) -> str:
    self.done += 1
    elapsed = self.clock() - self.start
    left = self.total - self.done
    eta = f"ETA {duration(elapsed / self.done * left)}" if left > 0 else "done"
    return f"{self.done}/{self.total} {what}, elapsed {duration(elapsed)}, {eta}"
