"""The sweep models' families (a sweep model's `family`, `point_models.family`) as objects, by name (`FAMILIES`):
what the sweep's checks ask of a family, never its name. Each family's models themselves are `point_models`'."""

from moejax.validation import require


class SweepFamily:
  """A family of sweep models: where its MoE layers sit among the layers."""

  def __init__(self, name: str):
    self.name = name

  def check_layers(self, name: str, model) -> None:
    """ConfigError naming models.<name>.moe_layers unless the family can place `model`'s MoE layers."""
    require(
      model.moe_layers <= model.layers,
      f"models.{name}.moe_layers",
      model.moe_layers,
      f"at most layers={model.layers} (the others are dense, first)",
    )


class EveryKth(SweepFamily):
  """SMILE's BERT-MoE: an MoE layer every layers / moe_layers blocks."""

  def check_layers(self, name: str, model) -> None:
    require(
      model.layers % model.moe_layers == 0,
      f"models.{name}.moe_layers",
      model.moe_layers,
      f"a divisor of layers={model.layers} (an MoE layer every layers / moe_layers blocks)",
    )


# In `point_models.FAMILIES`' order: SMILE's BERT-MoE, then the decoders (their dense layers first).
FAMILIES: dict[str, SweepFamily] = {
  f.name: f for f in (EveryKth("bert"), SweepFamily("deepseek_v3"), SweepFamily("qwen3_moe"))
}
