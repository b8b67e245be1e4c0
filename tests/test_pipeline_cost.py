"""The schedules priced from their timetables, and what they keep in flight, against hand counts and the published
activation counts (DeepSeek-V3 report Table 2, Megatron's interleaved schedule)."""

import numpy as np
import pytest

from moejax.pipeline import cost, memory, schedules
from moejax.pipeline.timetable import Durations


def _draw(rng):
  f, w = rng.uniform(0.5, 2.0, 2)
  return cost.StageCost(f=f, b=f + w, w=w, a2a_f=rng.uniform(0.1, 1.0), a2a_b=rng.uniform(0.1, 1.0))


def test_one_device_with_and_without_two_batch_overlap():
  """No overlap: m (F + its all-to-alls + B + theirs); two-batch: each pair max(2F, 2 a2a_F) + max(2B, 2 a2a_B)."""
  rng = np.random.default_rng(0)
  for m in (1, 4, 7):
    c = _draw(rng)
    plain = cost.one_device(m, c, two_batch=False).makespan
    assert plain == pytest.approx(m * (c.f + c.a2a_f + c.b + c.a2a_b), rel=1e-12)
    pair = max(2 * c.f, 2 * c.a2a_f) + max(2 * c.b, 2 * c.a2a_b)
    alone = c.f + c.a2a_f + c.b + c.a2a_b
    assert cost.one_device(m, c, two_batch=True).makespan == pytest.approx((m // 2) * pair + (m % 2) * alone, rel=1e-12)


def test_1f1b_step_is_its_published_makespan_and_dualpipe_hides_the_exchanges():
  """1F1B: (m + p - 1)(F + B) with each op's all-to-alls in it. DualPipe's paired slots hide one micro-batch's
  exchanges under the other's compute: faster than the same timetable with every exchange exposed, and, with no
  exchanges at all, the F&B = F + B timetable."""
  rng = np.random.default_rng(1)
  for p, m in ((2, 4), (4, 8), (8, 16)):
    c = _draw(rng)
    one_f = cost.step_time("1f1b", p, m, c)
    assert one_f == pytest.approx((m + p - 1) * (c.f + c.a2a_f + c.b + c.a2a_b), rel=1e-12)
    exposed = schedules.timetable("dualpipe", p, m, durations=Durations(c.f + c.a2a_f, c.b + c.a2a_b, c.w)).makespan
    assert cost.step_time("dualpipe", p, m, c) < exposed
    silent = cost.StageCost(c.f, c.b, c.w, 0.0, 0.0)
    assert cost.step_time("dualpipe", p, m, silent) == pytest.approx(
      schedules.timetable("dualpipe", p, m, durations=Durations(c.f, c.b, c.w)).makespan, rel=1e-12
    )


def test_activations_in_flight_are_the_published_counts():
  """GPipe: all m; 1F1B: device d holds p - d (p on the first: Table 2's PP); interleaved: p + (p-1)/v stages on the
  first device (Korthikanti et al. 2022, p (1 + (p-1)/(pv))); DualPipe and DualPipeV: p + 1 on every device."""
  for p, m in ((2, 4), (4, 8), (4, 16), (8, 16)):
    assert memory.activations_in_flight(schedules.timetable("gpipe", p, m)) == [m] * p
    assert memory.activations_in_flight(schedules.timetable("1f1b", p, m)) == [p - d for d in range(p)]
    for v in (2, 4):
      first = memory.activations_in_flight(schedules.timetable("interleaved", p, m, v))[0]
      assert first == pytest.approx(p + (p - 1) / v)
    if m >= 2 * p:
      assert memory.activations_in_flight(schedules.timetable("dualpipe", p, m)) == [p + 1] * p
    assert memory.activations_in_flight(schedules.timetable("dualpipev", p, m)) == [p + 1] * (p // 2)
  planned = memory.per_device("dualpipe", 8, 16)
  assert planned == {"parameter_stages": 2, "activation_stages": 9, "layers_fraction": 1 / 8}


def test_deepseek_v3_cost_program():
  """experiments/pipeline_cost.py: every schedule priced; overlap never slower than the same work exposed; bad
  fields named."""
  from configs import pipeline_cost as cost_config
  from experiments import pipeline_cost
  from moejax.validation import ConfigError

  config = cost_config.get_config()
  record = pipeline_cost.run(config)
  step = {(r["schedule"], r["micro_batches"]): r["step_s"] for r in record["rows"]}
  for m in config.micro_batches:
    assert step[("two_batch", m)] < step[("no_overlap", m)] and step[("dualpipe", m)] < step[("1f1b", m)]
  stage = record["stage"]
  assert stage["a2a_f"] > 0 and stage["b"] == 2 * stage["f"]
  config.micro_batches = (24,)
  with pytest.raises(ConfigError, match="micro_batches"):
    pipeline_cost.check(config)
