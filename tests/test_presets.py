"""The table of published models and its presets scaled down (`moejax.models.presets`): every entry a valid config,
its numbers written nowhere else; the routed experts are a multiple of the mesh's devices and of the groups, and
routing keeps a choice at every scale (more candidates than top-k, two or more experts per group), raised where the
scaled count would not and logged; the published shapes unchanged. Expectations come from a brute-force search
here, not from the module. Fast: no compilation."""

import ast
import dataclasses
import logging
import math

import pytest

from configs import moe_preset
from moejax.models import presets
from moejax.models.config import ModelConfig
from moejax.models.decoder_config import DecoderConfig
from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError
from tests.helpers import ROOT

EXPERT_SCALES = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 1024)
MIN_EXPERTS = (1, 2, 3, 4, 6, 8, 16, 32)  # 8: the 2 x 4 CPU mesh


# Copies of the table's numbers still written elsewhere, by file (SMILE's sizes and the decoders' vocabularies), each
# to be derived from moejax.models.presets.PUBLISHED by its owner.
PENDING_COPIES = {
  "configs/mlm.py": {1600, 3072, 6400, 32128},
  "configs/scaling_default.py": {32128},
  "configs/scaling_presets.py": {32000, 129280, 151936},
  "configs/scaling_smile.py": {1600, 3072, 6400, 32128},
  "moejax/study/papers/smile.py": {3072, 32128},
  "moejax/study/plots.py": {1600, 3072, 6400},
}


def test_every_published_model_is_a_valid_config():
  """Each entry's moe builds a MoEConfig whose experts spread evenly over its mesh; its model names fields of
  DecoderConfig (the decoders) or builds a ModelConfig (SMILE's BERT)."""
  decoder_fields = {f.name for f in dataclasses.fields(DecoderConfig)}
  for name, published in presets.PUBLISHED.items():
    MoEConfig(**published.moe)
    assert published.moe["num_experts"] % math.prod(published.mesh) == 0, name
    assert published.dense < published.model.get("num_layers", 1), name
    if published.model.get("kind") == "bert":
      ModelConfig(**published.model, d_model=published.moe["d_model"])
    else:
      assert set(published.model) <= decoder_fields - {"d_model"}, name


def without_config_defaults(path):
  """The module's syntax tree less its `DEFAULTS = {...}`: a family's copy of its transformers config class's
  defaults (a source of its own, which may share a number with a published model)."""
  tree = ast.parse(path.read_text())
  tree.body = [
    node
    for node in tree.body
    if not (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["DEFAULTS"])
  ]
  return tree


def test_published_numbers_are_written_in_the_table_only():
  """The table's distinctive numbers (over 1000, not a power of two: widths, vocabularies, context lengths) appear
  as an integer literal in no other module of configs/, experiments/, benchmarks/, moejax/ or kernels/ (comments
  and docstrings aside), but for the copies still pending."""
  numbers = {
    v
    for published in presets.PUBLISHED.values()
    for fields in (published.moe, published.model)
    for v in fields.values()
    if type(v) is int and v > 1000 and v & (v - 1)
  }
  assert {14336, 1408, 32000, 151936} <= numbers
  found = {}
  for folder in ("configs", "experiments", "benchmarks", "moejax", "kernels"):
    for path in (ROOT / folder).rglob("*.py"):
      name = path.relative_to(ROOT).as_posix()
      if name != "moejax/models/published.py":
        literals = {node.value for node in ast.walk(without_config_defaults(path)) if isinstance(node, ast.Constant)}
        if literals & numbers:
          found[name] = literals & numbers
  assert {
    name: copies - PENDING_COPIES.get(name, set())
    for name, copies in found.items()
    if copies - PENDING_COPIES.get(name, set())
  } == {}


def honest(moe: dict, experts: int) -> bool:
  """Routing over `experts` has a choice: more candidates than top-k, and at least two experts in each group."""
  groups = moe.get("num_groups")
  if groups is None:
    return experts > moe["top_k"]
  return experts // groups >= 2 and experts // groups * moe.get("topk_groups", 1) > moe["top_k"]


def expected_experts(moe: dict, expert_scale: int, min_experts: int) -> tuple[int, int | None]:
  """(scaled, routed experts) by the rule, searched count by count: the scaled count is the published one over
  `expert_scale` rounded down to a multiple of the devices and the groups (at least the first such multiple); the
  routed count is it if routing over it has a choice, else the smallest such multiple above it, up to the
  published count, over which routing has one (None: there is none)."""
  published, groups = moe["num_experts"], moe.get("num_groups") or 1
  fits = lambda n: n % min_experts == 0 and n % groups == 0
  first = next(n for n in range(1, min_experts * groups + 1) if fits(n))
  base = max([n for n in range(1, published // expert_scale + 1) if fits(n)], default=first)
  if honest(moe, base):
    return base, base
  return base, next((n for n in range(base + 1, published + 1) if fits(n) and honest(moe, n)), None)


def cases():
  for name, preset in sorted(presets.PRESETS.items()):
    for scale in sorted({1, preset.cpu_scale}):
      for expert_scale in sorted({*EXPERT_SCALES, preset.cpu_expert_scale}):
        for min_experts in MIN_EXPERTS:
          yield name, scale, expert_scale, min_experts


@pytest.mark.parametrize("name,scale,expert_scale,min_experts", list(cases()))
def test_scaled_experts_are_a_multiple_of_devices_and_groups_and_route_with_a_choice(
  name, scale, expert_scale, min_experts
):
  moe = presets.PRESETS[name].moe
  base, want = expected_experts(moe, expert_scale, min_experts)
  assert want is not None  # every published preset has an honest count at every scale and mesh tried here
  fields, note = presets.scaled(name, scale, expert_scale, min_experts)
  experts = fields["num_experts"]
  assert experts == want == presets.moe_fields(name, scale, expert_scale, min_experts)["num_experts"]
  groups = moe.get("num_groups")
  candidates = experts // groups * moe["topk_groups"] if groups else experts
  assert candidates > moe["top_k"] and experts % min_experts == 0
  if groups:
    assert experts % groups == 0 and experts // groups >= 2
  for key, value in moe.items():  # everything else as published, the widths divided by the scale
    if key != "num_experts":
      assert fields[key] == (value // scale if key in ("d_model", "d_ff", "shared_d_ff") else value), key
  assert bool(note) == (want != base)  # only an adjustment says something: the scale, both counts and why
  if note:
    assert note.startswith(f"preset {name} at expert scale {expert_scale}: {base} expert")
    assert f"using {experts} experts" in note and ("top_k" in note or "one expert per group" in note)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_published_shapes_are_honest_and_unchanged(name):
  moe = presets.PRESETS[name].moe
  assert honest(moe, moe["num_experts"])
  fields, note = presets.scaled(name)
  assert (fields, note) == (moe, "")
  assert presets.moe_fields(name, 1, 1, 8) == moe  # on the 2 x 4 mesh too


def _cpu_config(name: str):
  config = moe_preset.get_config()
  config.preset = name
  assert (config.mesh.nodes, config.mesh.gpus_per_node) == (2, 4)
  return config


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_cpu_defaults(name, caplog):
  """DeepSeek-V3's CPU default (expert scale 16: 16 experts in 8 groups of 2, 4 kept, top-8) leaves 8 candidates,
  so it is raised to 24 (3 per group, 12 candidates) and says so; Qwen3-MoE's (16, top-8) and Mixtral's (8, top-2)
  route with a choice as they are."""
  preset = presets.PRESETS[name]
  base, want = expected_experts(preset.moe, preset.cpu_expert_scale, 8)
  assert want == {"deepseek_v3": 24, "qwen3_moe": 16, "mixtral_8x7b": 8}[name]
  with caplog.at_level(logging.INFO):
    config = presets.apply(_cpu_config(name))
  assert config.moe.num_experts == want
  assert config.model.d_model == preset.moe["d_model"] // preset.cpu_scale
  notes = [r.getMessage() for r in caplog.records if "preset" in r.getMessage()]
  if name != "deepseek_v3":
    assert notes == []
    return
  assert base == preset.moe["num_experts"] // preset.cpu_expert_scale == 16  # what the scale alone gives
  assert notes == [
    "preset deepseek_v3 at expert scale 16: 16 experts in 8 groups keep 8 candidates = top_k 8, "
    "so routing would only pick groups; using 24 experts (3 per group, 12 candidates)"
  ]
  assert caplog.records[-1].levelno == logging.WARNING


def test_groups_of_one_and_fewer_experts_than_top_k_are_named():
  _, note = presets.scaled("deepseek_v3", 1, 64)  # 4 experts, raised to the 8 groups: one each, 4 candidates
  assert "8 experts in 8 groups keep 4 candidates < top_k 8" in note and "one expert per group" in note
  assert note.endswith("using 24 experts (3 per group, 12 candidates)")
  _, note = presets.scaled("mixtral_8x7b", 1, 4)  # 2 experts = top-2: every token takes both
  assert "2 experts = top_k 2" in note and note.endswith("using 3 experts (3 candidates)")
  _, note = presets.scaled("qwen3_moe", 1, 128, 2)
  assert "1 expert < top_k 8" not in note and "2 experts < top_k 8" in note and "using 10 experts" in note


def test_no_honest_count_up_to_the_published_one_is_an_error_naming_the_field(monkeypatch):
  deepseek = presets.PRESETS["deepseek_v3"]
  tiny = dataclasses.replace(deepseek, moe={**deepseek.moe, "num_experts": 16})  # 8 groups of 2: 8 candidates
  monkeypatch.setitem(presets.PRESETS, "tiny", tiny)
  assert expected_experts(tiny.moe, 1, 1) == (16, None)
  with pytest.raises(ConfigError, match="preset_expert_scale=1 .*8 candidates = top_k 8.*published 16") as e:
    presets.moe_fields("tiny", 1, 1)
  assert e.value.field == "preset_expert_scale"
  config = _cpu_config("tiny")
  config.preset_scale = 1
  config.preset_expert_scale = 1
  with pytest.raises(ConfigError, match="preset_expert_scale") as e:
    presets.apply(config)
  assert e.value.field == "preset_expert_scale"
