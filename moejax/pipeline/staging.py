"""Which layers a pipeline stage runs, and what a stage cannot run: the decoder's staged segment (the last segment of
its scanned layers, split into the schedule's stages of layers in equal runs of its repeats, each scanned as the
segment is) and the padded exchange's refusal inside a stage.
"""

import copy

from moejax.models import layers as layers_lib
from moejax.models.decoder_config import DecoderConfig
from moejax.moe import collective as collective_lib
from moejax.pipeline import schedules
from moejax.validation import require

# Why the padded exchange cannot run inside a stage (checked on the resolved collective too: `check_collective`).
PADDED_REASON = (
  "'capacity', or 'ragged' (or 'auto') on a GPU, with pipeline.stages > 1: the padded exchange's ring "
  "of collective permutes is one XLA collective over every device of the program, and at a tick the "
  "stages run different slots (a forward on one, a backward or nothing on another), so a stage's "
  "permutes would wait for devices that never reach them; all-to-alls have groups within a stage"
)


def check_collective(moe_cfg, platform: str) -> None:
  """The refusal of the padded exchange, on the collective `moe_cfg.collective` resolves to on `platform`."""
  resolved = collective_lib.resolve(moe_cfg.collective, platform)
  require(resolved != "padded", "moe.collective", moe_cfg.collective, PADDED_REASON)


def staged_segment(cfg, stages: int, schedule: str, virtual_stages: int = 1) -> int:
  """The index of the segment split over the schedule's stages of layers (the last; `Schedule.layer_stages`: dualpipev's
  2 x `stages` devices, the V; interleaved's `stages` x `virtual_stages`); ConfigError naming the field where the
  layers cannot be split into them equally (pipeline.virtual_stages where the devices alone would split them)."""
  require(
    isinstance(cfg, DecoderConfig),
    "model.family",
    getattr(cfg, "family", type(cfg).__name__),
    "a decoder family with pipeline.stages > 1 (the stages are the decoder's embeddings, layers and head)",
  )
  require(
    cfg.scan_layers,
    "model.scan_layers",
    cfg.scan_layers,
    "True with pipeline.stages > 1 (a stage runs a slice of a scanned segment's stacked repeats)",
  )
  segments = layers_lib.segments(cfg)
  seg = segments[-1]
  cut = schedules.of(schedule, pipelined=True).layer_stages(stages, virtual_stages)
  chunks = f" x {virtual_stages} virtual stages" if virtual_stages > 1 else ""
  into = f"{cut} stages of layers ({schedule}, {stages} devices{chunks})" if cut != stages else f"{stages} stages"
  field, value = (
    ("pipeline.virtual_stages", virtual_stages)
    if virtual_stages > 1 and splits(cfg, seg, stages)
    else ("pipeline.stages", stages)
  )
  require(
    seg.repeats % cut == 0,
    field,
    value,
    f"{into} dividing {seg.repeats}, the repeats of the last segment of layers (layers {seg.start}.."
    f"{seg.stop - 1}, split evenly over the stages; the {seg.start} before it run on the first stage)",
  )
  require(
    splits(cfg, seg, cut),
    field,
    value,
    f"{into} dividing {seg.repeats}, each stage at least two repeats of the segment's {seg.period} "
    "different layers (a stage's slice is scanned as the segment is)",
  )
  return len(segments) - 1


def splits(cfg, seg, cut: int) -> bool:
  """Whether `cut` stages split segment `seg`'s repeats evenly, each stage's slice scanned as the segment is."""
  if seg.repeats % cut:
    return False
  sub = layers_lib.find_segments(layers_lib.kinds(cfg)[seg.start : seg.start + seg.period * seg.repeats // cut])
  return sub == (layers_lib.Segment(0, seg.period, seg.repeats // cut),)


PER_LAYER = ("moe_layers", "sliding_layers", "nope_layers", "mixers")  # DecoderConfig's fields of an entry a layer


def sub_config(cfg: DecoderConfig, start: int, stop: int) -> DecoderConfig:
  """cfg with layers start .. stop - 1 only (their segments are those `layers.segments` finds there): a view of a
  stretch of the checked model's layers, not a model, so it is not checked again (a stretch may begin at a
  'dsa_shared' layer, reading the choice a 'dsa' layer before it made; a model may not)."""
  view = copy.copy(cfg)
  for name in PER_LAYER:
    if getattr(cfg, name, None) is not None:
      object.__setattr__(view, name, getattr(cfg, name)[start:stop])
  object.__setattr__(view, "num_layers", stop - start)
  return view
