"""Granite MoE SWA (`granitemoe_swa`, transformers' GraniteMoeSWAForCausalLM): granitemoeshared's decoder (muP
scalars, stacked experts, the shared MLP where shared_intermediate_size > 0, by default 0) with a learned sink logit
per head in every layer (`self_attn.sinks`), sliding-window layers by layer_types (GraniteMoeSWAConfig's default:
full where i % 4 == 0, the rest sliding; sliding_window 128) and a RoPE theta per layer (layer_rope_theta; 0: NoPE, no
RoPE in that layer; by default rope_theta in every layer). transformers has no weight renaming for it: the router and
the experts are saved under their modules' names (`block_sparse_moe.router.weight`, `block_sparse_moe.experts.gate_up_proj`
[E, 2f, d] and `experts.down_proj` [E, d, f]), not granitemoe's checkpoint names.

moejax holds one theta for the full-attention layers (`rope_theta`) and one for the sliding ones
(`DecoderConfig.sliding_overrides`, Mellum's mechanism), and the NoPE layers (`DecoderConfig.nope_layers`, no
temperature: Granite has no QK-norm to drop): a layer_rope_theta with two non-zero thetas among the layers of one
kind is refused, naming it."""

import dataclasses

from moejax.models.families.base import fused_expert_key, rope_theta
from moejax.models.families.granitemoe import GraniteMoe
from moejax.validation import require

FULL, SLIDING = "full_attention", "sliding_attention"
DEFAULTS = {"sliding_window": 128, "shared_intermediate_size": 0}  # GraniteMoeSWAConfig's


def _read(hf: dict) -> dict:
  """config.json with GraniteMoeSWAConfig's defaults and derived lists (a null sliding_window stays null: no layer
  then slides)."""
  hf = {**DEFAULTS, **hf}
  layers = hf["num_hidden_layers"]
  hf["layer_types"] = hf.get("layer_types") or [FULL if i % 4 == 0 else SLIDING for i in range(layers)]
  hf["layer_rope_theta"] = hf.get("layer_rope_theta") or [rope_theta(hf)] * layers
  require(
    len(hf["layer_rope_theta"]) == layers and len(hf["layer_types"]) == layers,
    "layer_rope_theta",
    hf["layer_rope_theta"],
    f"one theta per layer ({layers}), as layer_types has one kind per layer",
  )
  return hf


def _thetas(hf: dict) -> dict:
  """{layer kind: its layers' one non-zero RoPE theta} (a kind whose layers are all NoPE has none), refused where one
  kind's layers have two."""
  window = hf["sliding_window"]
  kinds = [SLIDING if kind == SLIDING and window is not None else FULL for kind in hf["layer_types"]]
  thetas = {}
  for kind, theta in zip(kinds, hf["layer_rope_theta"]):
    if theta:
      thetas.setdefault(kind, set()).add(float(theta))
  require(
    all(len(values) == 1 for values in thetas.values()),
    "layer_rope_theta",
    hf["layer_rope_theta"],
    "one non-zero theta for the full-attention layers and one for the sliding ones (0: NoPE): moejax holds a RoPE "
    "theta per layer kind, not per layer",
  )
  return {kind: values.pop() for kind, values in thetas.items()}


@dataclasses.dataclass(frozen=True)
class GraniteMoeSwa(GraniteMoe):
  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    hf = _read(hf)
    kinds = tuple(kind == SLIDING for kind in hf["layer_types"])
    return (hf["sliding_window"], kinds) if any(kinds) and hf["sliding_window"] is not None else (None, None)

  def decoder_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    thetas = _thetas(hf)
    full = thetas.get(FULL, thetas.get(SLIDING, rope_theta(hf)))
    nope = tuple(not theta for theta in hf["layer_rope_theta"])
    fields = {**super().decoder_fields(hf), "attention_sinks": True, "rope_theta": full}
    fields["nope_layers"] = nope if any(nope) else None
    if thetas.get(SLIDING, full) != full:
      fields["sliding_overrides"] = (("rope_theta", thetas[SLIDING]),)
    return fields

  def moe_fields(self, hf: dict) -> dict:
    return super().moe_fields({**DEFAULTS, **hf})

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    # transformers has no renaming for this model type: the router and experts keep their modules' names
    if path[0] == "router":
      return f"{container}.router.weight", True
    if path[0] == "shared":
      return super().moe_key(container, path)
    return fused_expert_key(path, f"{container}.experts.gate_up_proj", f"{container}.experts.down_proj")

  def to_hf(self, cfg, moe_cfg) -> dict:
    overrides = dict(cfg.sliding_overrides or ())
    for name, got, want in (
      ("sliding_overrides", sorted(set(overrides) - {"rope_theta"}), []),
      ("attention_sinks", cfg.attention_sinks, True),
      ("attn_temperature", cfg.attn_temperature, None),
      ("rope_scaling", cfg.rope_scaling, None),
      ("partial_rotary_factor", cfg.partial_rotary_factor, 1.0),
    ):
      require(got == want, name, got, f"{want!r}: GraniteMoeSWA's config.json cannot say otherwise")
    unwindowed = dataclasses.replace(cfg, sliding_window=None, sliding_layers=None, sliding_overrides=None)
    hf = super().to_hf(unwindowed, moe_cfg)
    theta = lambda i: 0 if cfg.nope_layers and cfg.nope_layers[i] else cfg.at(i).rope_theta
    types = [SLIDING if cfg.window(i) else FULL for i in range(cfg.num_layers)]
    # GraniteMoeSWAConfig's window and layer types would otherwise slide where moejax does not
    window = cfg.sliding_window if any(cfg.window(i) for i in range(cfg.num_layers)) else None
    hf.update(layer_types=types, sliding_window=window, layer_rope_theta=[theta(i) for i in range(cfg.num_layers)])
    return hf

  def sliding_to_hf(self, cfg) -> dict:
    return {}  # to_hf writes the window, the layer types and their thetas together


GRANITEMOE_SWA = GraniteMoeSwa(
  "granitemoe_swa", "GraniteMoeSWAForCausalLM", shared=True, attention_fields=("sliding_overrides",)
)
