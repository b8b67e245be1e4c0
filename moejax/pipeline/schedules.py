"""Pipeline schedules behind one interface, `Schedule`, one object per `pipeline.schedule` (`SCHEDULES`, by name).

A schedule says, in plain Python: whether it runs over the mesh's 'stage' axis (`pipelined`), how its stages sit on
the devices (`stages_per_device`, `chunks`, `layer_stages`, `parameter_stages`), whether it pairs slots, its
refusals of a pipeline section and a MoE config (`check`, `check_moe`, `check_shape`: each naming the field), its
published bubble, and (pipelined) its slots (`moejax.pipeline.orders`), timed by `timetable`. The step, the config
checks, the memory planner and the experiments ask the schedule, never its name. `stages` below is the p of each
schedule's published bubble:
  none         no pipeline: every micro-batch through every layer on every device (the default).
  two_batch    no pipeline: each micro-batch's halves interleaved layer by layer (`moejax.pipeline.two_batch`).
  gpipe        p devices, one stage each; every forward, then every backward (GPipe).
  1f1b         p devices; p - d - 1 forwards to warm up on device d, then one forward and one backward in turn
               (PipeDream-Flush, Megatron's non-interleaved schedule).
  interleaved  p devices of `virtual_stages` v chunks each; a micro-batch passes the p devices v times (Megatron's
               interleaved 1F1B: forwards in groups of p micro-batches per chunk; m a multiple of p).
  dualpipe     p devices (p even), each with two chunks: stage d of micro-batches 0..m/2-1 that enter at device 0,
               stage p-1-d of those that enter at device p-1 (2x the parameters); DualPipe's eight steps per device
               (deepseek-ai/DualPipe, DualPipe.step): forwards paired with backwards (F&B slots) in the main
               step, a backward's weight gradient split off (W) where a bubble would be.
  dualpipev    DualPipe cut in half: p stages on p/2 devices, each with chunk 0 (stage d) and chunk 1 (stage p-1-d),
               every micro-batch going down and back (DualPipeV.step).
"""

from moejax.pipeline import orders
from moejax.pipeline.timetable import Durations, Timetable, simulate
from moejax.validation import ConfigError, is_int, require

# The timetable's refusals (`Schedule.check_shape`) by the training config's name of their field.
FIELDS = {"stages": "pipeline.stages", "virtual_stages": "pipeline.virtual_stages"}


class Schedule:
  """One value of `pipeline.schedule`. The class attributes are its answers; the defaults are a pipeline's of one
  stage a device, one copy of its parameters, one chunk, no paired slots."""

  name: str
  pipelined = True  # runs over the 'stage' axis: pipeline.stages > 1 (else 1, and no timetable)
  plain = False  # the unpipelined step itself, each micro-batch whole ('none')
  halves = False  # each micro-batch's halves interleaved (two_batch: one half's exchanges under the other's compute)
  stages_per_device = 1  # the timetable's stages a device runs (dualpipev: 2, the V)
  parameter_stages = 1  # stages' parameters a device holds (a fraction 1/p of the layers each; dualpipe(v): 2)
  chunked = False  # a device runs v chunks of 1/v stage each (pipeline.virtual_stages: interleaved)
  pairs_slots = False  # forwards paired with backwards in one slot (DualPipe's F&B)

  def chunks(self, virtual_stages: int = 1) -> int:
    """The chunks of one stage's layers a device runs: v where `chunked`, else 1 (a requested v ignored)."""
    return virtual_stages if self.chunked else 1

  def stages(self, devices: int) -> int:
    """The timetable's p on `devices` devices of the 'stage' axis (dualpipev: 2 x its devices)."""
    return devices * self.stages_per_device

  def layer_stages(self, devices: int, virtual_stages: int = 1) -> int:
    """S, the stages the staged layers are cut into (a route's length): p v for interleaved, 2p for dualpipev on p
    devices, p otherwise."""
    return self.stages(devices) * self.chunks(virtual_stages)

  def check(self, section, config, model_cfg, moe_cfg) -> None:
    """ConfigError naming the field for a pipeline `section` (schedule, stages, virtual_stages) of `config` this
    schedule cannot run (its stages, its shape at config.micro_batches)."""
    require(is_int(section.stages), "pipeline.stages", section.stages, "a positive int")
    require(
      self.pipelined == (section.stages != 1),
      "pipeline.stages",
      section.stages,
      f"1 with pipeline.schedule='none', > 1 with a schedule (pipeline.schedule={self.name!r})",
    )
    if not self.pipelined:
      return
    try:
      self.check_shape(self.stages(section.stages), config.micro_batches, section.virtual_stages)
    except ConfigError as refused:  # its own shape (dualpipe: p even; interleaved: v >= 2; the micro-batches)
      require(False, FIELDS.get(refused.field, refused.field), refused.value, refused.allowed)

  def check_moe(self, moe_cfg) -> None:
    """ConfigError naming the field for a MoE config this schedule cannot run (after the stages' checks)."""

  def check_shape(self, stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
    """ConfigError naming the field unless this schedule can run `micro_batches` over `stages` stages."""
    require(is_int(stages, 2), "stages", stages, "an int >= 2")
    require(is_int(micro_batches), "micro_batches", micro_batches, "an int >= 1")
    require(virtual_stages == 1, "virtual_stages", virtual_stages, f"1 for {self.name} (only interleaved has more)")

  def slots(self, stages: int, micro_batches: int, virtual_stages: int) -> tuple:
    """(routes, each device's slots in order): `moejax.pipeline.orders`."""
    raise NotImplementedError(f"{self.name} has no timetable")

  def published_bubble(self, stages: int, virtual_stages: int, d: Durations) -> float:
    """The published bubble (a device's idle time) at per-stage times `d`."""
    raise NotImplementedError(f"{self.name} has no bubble")


class NoPipeline(Schedule):
  name, pipelined, plain = "none", False, True


class TwoBatch(Schedule):
  name, pipelined, halves = "two_batch", False, True

  def check(self, section, config, model_cfg, moe_cfg) -> None:
    from moejax.pipeline import two_batch  # it builds on the models: imported where it is used

    require(
      section.stages == 1,
      "pipeline.stages",
      section.stages,
      "1 with pipeline.schedule='two_batch' (no 'stage' axis: the halves run on every device)",
    )
    two_batch.check(model_cfg, moe_cfg, config)


class GPipe(Schedule):
  name = "gpipe"
  slots = staticmethod(orders.gpipe)

  def published_bubble(self, stages: int, virtual_stages: int, d: Durations) -> float:
    return (stages - 1) * (d.f + d.b)  # GPipe; DeepSeek-V3 report Table 2 for 1F1B


class OneFOneB(GPipe):
  name = "1f1b"
  slots = staticmethod(orders.one_f_one_b)


class Interleaved(Schedule):
  name, chunked = "interleaved", True
  slots = staticmethod(orders.interleaved)

  def check_shape(self, stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
    require(is_int(stages, 2), "stages", stages, "an int >= 2")
    require(is_int(micro_batches), "micro_batches", micro_batches, "an int >= 1")
    require(is_int(virtual_stages, 2), "virtual_stages", virtual_stages, "an int >= 2 for the interleaved schedule")
    require(
      micro_batches % stages == 0,
      "micro_batches",
      micro_batches,
      f"a multiple of stages={stages} for the interleaved schedule (its forwards go in groups of p)",
    )

  def published_bubble(self, stages: int, virtual_stages: int, d: Durations) -> float:
    return (stages - 1) * (d.f + d.b) / virtual_stages  # Megatron: (p-1)/(vm) of the ideal m(F+B)


class DualPipe(Schedule):
  name, parameter_stages, pairs_slots = "dualpipe", 2, True
  slots = staticmethod(orders.dualpipe)

  def check_shape(self, stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
    super().check_shape(stages, micro_batches, virtual_stages)
    require(stages % 2 == 0, "stages", stages, f"even for {self.name} (its devices pair stage d with p-1-d)")
    self._check_micro_batches(stages, micro_batches)

  def _check_micro_batches(self, stages: int, micro_batches: int) -> None:
    require(
      micro_batches % 2 == 0 and micro_batches >= 2 * stages,
      "micro_batches",
      micro_batches,
      f"even and >= 2 x stages = {2 * stages} for dualpipe (half enter at each end; its steps need them)",
    )

  def check_moe(self, moe_cfg) -> None:
    require(
      moe_cfg.balance_loss != "global_batch",
      "moe.balance_loss",
      moe_cfg.balance_loss,
      "not 'global_batch' with dualpipe: its second copy of each stage runs the second "
      "half of the micro-batches, alongside the first half, so a micro-batch's earlier ones' counts are on "
      "another device",
    )

  def published_bubble(self, stages: int, virtual_stages: int, d: Durations) -> float:
    fb = d.f + d.b if d.fb is None else d.fb
    return (stages / 2 - 1) * (fb + d.b - 3 * d.w)  # DeepSeek-V3 report Table 2; DualPipe's README for DualPipeV


class DualPipeV(DualPipe):
  name, stages_per_device = "dualpipev", 2
  slots = staticmethod(orders.dualpipev)

  def _check_micro_batches(self, stages: int, micro_batches: int) -> None:
    require(
      micro_batches >= stages,
      "micro_batches",
      micro_batches,
      f">= stages = {stages} for dualpipev (2 x its {stages // 2} devices: its steps need them)",
    )

  def check_moe(self, moe_cfg) -> None:  # one copy of each stage: a chunk sees every micro-batch in order
    pass


SCHEDULES: dict[str, Schedule] = {
  s.name: s for s in (NoPipeline(), GPipe(), OneFOneB(), Interleaved(), DualPipe(), DualPipeV(), TwoBatch())
}
NAMES = tuple(SCHEDULES)
PIPELINED = tuple(name for name, s in SCHEDULES.items() if s.pipelined)  # those with a timetable


def of(name: str, pipelined: bool = False) -> Schedule:
  """The schedule called `name` (one with a timetable where `pipelined`); ConfigError naming 'schedule' else."""
  names = PIPELINED if pipelined else NAMES
  require(name in names, "schedule", name, f"one of {names}")
  return SCHEDULES[name]


def check_shape(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
  """ConfigError naming the field unless `schedule` can run `micro_batches` over `stages`."""
  of(schedule, pipelined=True).check_shape(stages, micro_batches, virtual_stages)


def timetable(
  schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1, durations: Durations = Durations()
) -> Timetable:
  """The schedule's timetable: each device's slots, timed by simulating the dependencies at `durations`."""
  check_shape(schedule, stages, micro_batches, virtual_stages)
  routes, slot_orders = SCHEDULES[schedule].slots(stages, micro_batches, virtual_stages)
  return simulate(schedule, slot_orders, routes, durations)
