"""One process of a 2 x 4 job: the scaling sweep's compiled training step (flat dropless, tests/test_hosts.py's tiny
model) on the whole mesh; prints its losses as `RESULT [...]`. Run twice with one persistent compilation cache, the
second job's process 0 would find the step there while process 1 compiles it (test_launch.py)."""

import json

from moejax.runtime import distributed

distributed.initialize()

import jax  # noqa: E402

from moejax.study import sweep_timing  # noqa: E402
from moejax.study.points import Point  # noqa: E402
from tests.test_hosts import _two_host_config  # noqa: E402

point = Point("flat_dropless", 2, 4, "small", "weak", "measured")
losses = sweep_timing.training_step(point, _two_host_config(), jax.devices())["losses"]
print("RESULT " + json.dumps(losses), flush=True)
