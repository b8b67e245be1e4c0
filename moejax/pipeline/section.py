"""A training config's `pipeline` section: schedule ('none': no pipeline, the default), stages (the 'stage'
mesh axis' size; 1 without a pipeline) and virtual_stages (v: with 'interleaved' the chunks of layers each device
runs, the layers cut into stages x v stages of layers; 1, the default, otherwise). The step's micro-batches are the
run's `micro_batches`: the pipeline runs them through the stages (the gradient accumulation of an unpipelined step
runs them one after another).

`check` refuses, before anything is compiled, each choice the pipelined step cannot run, naming the field."""

import ml_collections

from moejax.models import lm_loss
from moejax.pipeline import decoder as decoder_lib
from moejax.pipeline import step as step_lib
from moejax.pipeline import two_batch as two_batch_lib
from moejax.validation import ConfigError, is_int, require

CONFIG_FIELDS = ("schedule", "stages", "virtual_stages")
SCHEDULES = ("none", *step_lib.RUNS)
# The timetable's refusals (`schedules.check_shape`) by the training config's name of their field.
FIELDS = {"stages": "pipeline.stages", "virtual_stages": "pipeline.virtual_stages"}


def defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"schedule": "none", "stages": 1, "virtual_stages": 1})


def stages(config) -> int:
  """The 'stage' axis' size of a training config (1 without a pipeline section)."""
  section = config.get("pipeline")
  return 1 if section is None else section.stages


def two_batch(config) -> bool:
  """Whether the step runs each micro-batch as two interleaved halves (`moejax.pipeline.two_batch`)."""
  section = config.get("pipeline")
  return section is not None and section.schedule == two_batch_lib.SCHEDULE


def check(config, model_cfg, moe_cfg) -> None:
  """ConfigError naming the field for a pipeline section the step cannot run with the rest of `config`."""
  section = config.get("pipeline")
  if section is None:
    return
  require(is_int(section.virtual_stages), "pipeline.virtual_stages", section.virtual_stages, "a positive int")
  require(
    section.virtual_stages == 1 or section.schedule == "interleaved",
    "pipeline.virtual_stages",
    section.virtual_stages,
    f"1 with pipeline.schedule={section.schedule!r} (> 1: the chunks a device runs with 'interleaved' only)",
  )
  if section.schedule == two_batch_lib.SCHEDULE:  # no pipeline: each micro-batch's halves interleaved
    require(
      section.stages == 1,
      "pipeline.stages",
      section.stages,
      "1 with pipeline.schedule='two_batch' (no 'stage' axis: the halves run on every device)",
    )
    two_batch_lib.check(model_cfg, moe_cfg, config)
    return
  require(section.schedule in SCHEDULES, "pipeline.schedule", section.schedule, f"one of {SCHEDULES}")
  require(is_int(section.stages), "pipeline.stages", section.stages, "a positive int")
  require(
    (section.schedule == "none") == (section.stages == 1),
    "pipeline.stages",
    section.stages,
    f"1 with pipeline.schedule='none', > 1 with a schedule (pipeline.schedule={section.schedule!r})",
  )
  if section.stages == 1:
    return
  try:
    step_lib.timetable(section.schedule, section.stages, config.micro_batches, section.virtual_stages)
  except ConfigError as refused:  # the schedule's own shape (dualpipe: p even; interleaved: v >= 2; the micro-batches)
    require(False, FIELDS.get(refused.field, refused.field), refused.value, refused.allowed)
  decoder_lib.staged_segment(model_cfg, section.stages, section.schedule, section.virtual_stages)
  require(moe_cfg.collective != "padded", "moe.collective", moe_cfg.collective, decoder_lib.PADDED_REASON)
  require(
    section.schedule != "dualpipe" or moe_cfg.balance_loss != "global_batch",
    "moe.balance_loss",
    moe_cfg.balance_loss,
    "not 'global_batch' with dualpipe: its second copy of each stage runs the second "
    "half of the micro-batches, alongside the first half, so a micro-batch's earlier ones' counts are on "
    "another device",
  )


def of_config(config, model_cfg, moe_cfg, mesh, graphdef) -> decoder_lib.PipelinedDecoder | None:
  """The pipelined decoder of a checked config on its ('stage', 'node', 'gpu') mesh, or None without a pipeline."""
  if stages(config) == 1:
    return None
  return decoder_lib.PipelinedDecoder(
    graphdef,
    model_cfg,
    moe_cfg,
    mesh,
    config.pipeline.schedule,
    config.get("loss_chunk", lm_loss.LOSS_CHUNK),
    config.pipeline.virtual_stages,
  )
