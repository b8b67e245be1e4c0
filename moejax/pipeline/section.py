"""A training config's `pipeline` section: schedule ('none': no pipeline, the default), stages (the 'stage'
mesh axis' size; 1 without a pipeline) and virtual_stages (v: with 'interleaved' the chunks of layers each device
runs, the layers cut into stages x v stages of layers; 1, the default, otherwise). The step's micro-batches are the
run's `micro_batches`: the pipeline runs them through the stages (the gradient accumulation of an unpipelined step
runs them one after another).

`check` refuses, before anything is compiled, each choice the pipelined step cannot run, naming the field: the
schedule's own refusals (`schedules.Schedule.check`), then a pipeline's of the decoder and its MoE layers."""

import ml_collections

from moejax.models import lm_loss
from moejax.pipeline import decoder as decoder_lib
from moejax.pipeline import schedules, staging
from moejax.validation import is_int, require

CONFIG_FIELDS = ("schedule", "stages", "virtual_stages")


def defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"schedule": "none", "stages": 1, "virtual_stages": 1})


def stages(config) -> int:
  """The 'stage' axis' size of a training config (1 without a pipeline section)."""
  section = config.get("pipeline")
  return 1 if section is None else section.stages


def two_batch(config) -> bool:
  """Whether the step runs each micro-batch as two interleaved halves (`moejax.pipeline.two_batch`)."""
  section = config.get("pipeline")
  return section is not None and schedules.of(section.schedule).halves


def check(config, model_cfg, moe_cfg) -> None:
  """ConfigError naming the field for a pipeline section the step cannot run with the rest of `config`."""
  section = config.get("pipeline")
  if section is None:
    return
  require(is_int(section.virtual_stages), "pipeline.virtual_stages", section.virtual_stages, "a positive int")
  schedule = schedules.SCHEDULES.get(section.schedule)
  require(
    section.virtual_stages == 1 or (schedule is not None and schedule.chunked),
    "pipeline.virtual_stages",
    section.virtual_stages,
    f"1 with pipeline.schedule={section.schedule!r} (> 1: the chunks a device runs with 'interleaved' only)",
  )
  require(schedule is not None, "pipeline.schedule", section.schedule, f"one of {schedules.NAMES}")
  schedule.check(section, config, model_cfg, moe_cfg)
  if not schedule.pipelined:
    return
  staging.staged_segment(model_cfg, section.stages, section.schedule, section.virtual_stages)
  require(not moe_cfg.collective_kind.ring_of_permutes, "moe.collective", moe_cfg.collective, staging.PADDED_REASON)
  schedule.check_moe(moe_cfg)


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
