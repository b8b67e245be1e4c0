"""The presets a training config applies (`apply`, named by a config's top-level `preset` field): published MoE
layers (`moejax.models.published.PUBLISHED`, the one table of their shapes), scaled down on request.

  python -m experiments.train --config=configs/moe_preset.py --workdir=/tmp/ds   # DeepSeek-V3-like, CPU-sized
  python -m experiments.train --config=configs/moe_preset.py --workdir=/tmp/q3 \\
      --config.preset=qwen3_moe --config.preset_scale=1 --config.preset_expert_scale=1   # the published shape

`scale` divides the widths (d_model, the experts' d_ff, the shared experts' width) and `expert_scale` the
number of routed experts (default `scale`), rounded down to a multiple of `min_experts` (the mesh's devices:
experts are spread over them) and of the routing's groups, never below one such multiple. Routing (top-k,
scores, groups, scaling, the balancing bias's rate) stays as published. Where the scaled count would leave
routing no choice (candidates <= top_k, the candidates being E / num_groups * topk_groups with group-limited
routing, else E; or groups of one expert, whose score, the sum of a group's two best, degenerates), the count
is raised to the smallest such multiple that routes honestly, and `apply` logs what it changed and why
(DeepSeek-V3's CPU default: 16 experts in 8 groups keep 8 candidates = top-8, so 24). Where no count up to the
published one would, it is an error naming preset_expert_scale. The published shapes route honestly as they are.
"""

import dataclasses
import math
from typing import NamedTuple

import ml_collections
from absl import logging

from moejax.models.published import PUBLISHED
from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError, is_int, require

EXPERT_FIELDS = ("d_model", "d_ff", "num_experts", "top_k", "gated", "activation")  # an expert FFN's shape


def expert_shape(name: str, **changes) -> dict:
  """The expert FFN of published model `name`: its EXPERT_FIELDS, with `changes` (e.g. the experts one GPU
  holds)."""
  moe = PUBLISHED[name].moe
  return {**{field: moe[field] for field in EXPERT_FIELDS}, **changes}


def experts_per_device(name: str) -> int:
  """Routed experts on each GPU of published model `name`'s own mesh."""
  published = PUBLISHED[name]
  return published.moe["num_experts"] // math.prod(published.mesh)


@dataclasses.dataclass(frozen=True)
class Preset:
  """A published MoE layer: `moe` holds its MoEConfig fields at full size (d_model and d_ff included);
  layers and heads describe the whole model (not applied: the trainer's model section keeps its own)."""

  moe: dict
  layers: int
  heads: int
  # The default scales for CPU runs (`apply` with preset_scale / preset_expert_scale 0).
  cpu_scale: int
  cpu_expert_scale: int


CONFIG_FIELDS = ("preset", "preset_scale", "preset_expert_scale")  # a training config's optional top-level fields

# The presets a training config can name, with their CPU scales (preset_scale, preset_expert_scale).
PRESETS = {
  name: Preset(
    PUBLISHED[name].moe,
    PUBLISHED[name].model["num_layers"],
    PUBLISHED[name].model["num_heads"],
    cpu_scale,
    cpu_expert_scale,
  )
  for name, cpu_scale, cpu_expert_scale in (("deepseek_v3", 32, 16), ("qwen3_moe", 16, 8), ("mixtral_8x7b", 64, 1))
}


class Scaled(NamedTuple):
  """A scaled preset: its MoEConfig `fields`, and `note`, what the expert count's adjustment changed and why
  ('' when the scaled count routes honestly as it is)."""

  fields: dict
  note: str


def moe_fields(name: str, scale: int = 1, expert_scale: int | None = None, min_experts: int = 1) -> dict:
  """The MoEConfig fields of preset `name` with d_model, d_ff and the shared width divided by `scale` and the
  routed experts by `expert_scale` (default `scale`; a multiple of `min_experts` and of the groups of
  group-limited routing, raised where routing would degenerate: `scaled`, which also says why). Checked by
  building the MoEConfig; errors name the scale."""
  return scaled(name, scale, expert_scale, min_experts).fields


def scaled(name: str, scale: int = 1, expert_scale: int | None = None, min_experts: int = 1) -> Scaled:
  """`moe_fields`'s fields and the note on their expert count (see the module docstring)."""
  require(name in PRESETS, "preset", name, f"one of {sorted(PRESETS)}")
  expert_scale = scale if expert_scale is None else expert_scale
  for field, value in (("preset_scale", scale), ("preset_expert_scale", expert_scale)):
    require(is_int(value), field, value, "a positive int")
  require(is_int(min_experts), "min_experts", min_experts, "a positive int (the mesh's devices)")
  fields = dict(PRESETS[name].moe)
  for width in ("d_model", "d_ff", "shared_d_ff"):
    if width in fields:
      require(fields[width] % scale == 0, "preset_scale", scale, f"a divisor of {name}'s {width}={fields[width]}")
      fields[width] //= scale
  experts, note = _routed_experts(name, fields, expert_scale, min_experts)
  fields["num_experts"] = experts
  try:
    MoEConfig(**fields)
  except ConfigError as e:
    raise ConfigError(
      f"preset {name!r} at scale {scale}, expert scale {expert_scale} ({experts} experts): {e}",
      "preset_expert_scale",
      expert_scale,
      "a smaller scale",
    ) from e
  return Scaled(fields, note)


def _degenerate(fields: dict, experts: int) -> str:
  """Why routing over `experts` experts with the preset's top-k and groups has no choice ('' if it has)."""
  top_k, groups, kept = fields["top_k"], fields.get("num_groups"), fields.get("topk_groups", 1)
  per_group = experts // groups if groups else experts
  candidates = per_group * kept if groups else experts
  count = f"{experts} expert" + "s" * (experts != 1)
  where = f"{count} in {groups} groups keep {candidates} candidates" if groups else count
  reasons = []
  if candidates < top_k:
    reasons.append(f"{where} < top_k {top_k}, too few to choose from")
  elif candidates == top_k:
    reasons.append(
      f"{where} = top_k {top_k}, so routing would only pick groups"
      if groups
      else f"{where} = top_k {top_k}, so every token would take every expert"
    )
  if groups and per_group < 2:
    reasons.append(
      f"{'and' if reasons else f'{count} in {groups} groups'} leave one expert per group, so the "
      "group score (the sum of a group's two best scores) degenerates"
    )
  return "; ".join(reasons)


def _routed_experts(name: str, fields: dict, expert_scale: int, min_experts: int) -> tuple[int, str]:
  """(routed experts, note): the published count over `expert_scale`, rounded down to a multiple of the mesh's
  devices and the groups (at least one), raised by such multiples, never above the published count, while
  routing over it would degenerate."""
  published, groups = fields["num_experts"], fields.get("num_groups")
  step = math.lcm(min_experts, groups or 1)
  experts = max(published // expert_scale // step * step, step)
  why = _degenerate(fields, experts)
  if not why:
    return experts, ""
  fixed = next((n for n in range(experts + step, published + 1, step) if not _degenerate(fields, n)), None)
  head = f"preset {name} at expert scale {expert_scale}: {why}"
  if fixed is None:
    raise ConfigError(
      f"config field preset_expert_scale={expert_scale} is not allowed: {head}, and no multiple of "
      f"{step} (the mesh's {min_experts} devices{f' and {groups} groups' if groups else ''}) up to "
      f"the published {published} experts routes with a choice",
      "preset_expert_scale",
      expert_scale,
      "a scale leaving more candidates than top_k (a smaller scale, or fewer devices)",
    )
  kept = fields.get("topk_groups", 1)
  detail = f"{fixed // groups} per group, {fixed // groups * kept} candidates" if groups else f"{fixed} candidates"
  return fixed, f"{head}; using {fixed} experts ({detail})"


def apply(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of the training config with its preset (top-level `preset`, '' or absent = none) applied: model.d_model
  and model.d_ff from the preset (scaled by preset_scale, 0 = the preset's CPU scale), and the preset's MoE fields in
  the moe section (experts scaled by preset_expert_scale, 0 = the CPU default; a multiple of the mesh's devices,
  raised where routing would degenerate, which is logged). The config unchanged without a preset."""
  name = config.get("preset") or ""
  if not name:
    return config
  require(name in PRESETS, "preset", name, f"'' or one of {sorted(PRESETS)}")
  preset = PRESETS[name]
  scale = config.get("preset_scale") or preset.cpu_scale
  expert_scale = config.get("preset_expert_scale") or preset.cpu_expert_scale
  nodes, gpus = config.mesh.get("nodes"), config.mesh.get("gpus_per_node")
  devices = nodes * gpus if is_int(nodes) and is_int(gpus) else 1  # a bad mesh is reported by its own check
  fields, note = scaled(name, scale, expert_scale, min_experts=devices)
  if note:
    logging.warning(note)
  config = ml_collections.ConfigDict(config.to_dict())  # a copy: the caller's config keeps its values
  config.model.d_model, config.model.d_ff = fields.pop("d_model"), fields.pop("d_ff")
  for key, value in fields.items():
    config.moe[key] = value
  return config
