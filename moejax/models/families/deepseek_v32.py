"""DeepSeek-V3.2 (`deepseek_v32`, transformers' DeepseekV32ForCausalLM): DeepSeek-V3's decoder whose every layer's
attention is DeepSeek sparse attention ('dsa', `moejax.models.sparse_attention`: MLA with q LoRA whose queries each
see the index_topk keys a lightning indexer chooses; layer_types all 'indexed_attention'). The indexer's heads
(index_n_heads), width (index_head_dim) and top-k (index_topk) are `DecoderConfig.indexer`; its RoPE is half-split
while MLA's is in interleaved pairs (config.json has no rope_interleave: always). MoE layers by mlp_layer_types, else
after first_k_dense_replace dense layers (DeepseekV32Config's default 3); routed as DeepSeek-V3 whatever
scoring_func and topk_method say. The published MTP layer (`model.layers.61.*`) is ignored on load, as transformers
ignores it (moejax reads no num_nextn_predict_layers here: its block would be a DSA layer).
"""

import dataclasses

from moejax.models.families.glm4_moe_lite import Glm4MoeLite
from moejax.validation import require

KIND = "indexed_attention"  # config.json's layer_types of a DSA layer


@dataclasses.dataclass(frozen=True)
class DeepSeekV32(Glm4MoeLite):
  """index_heads: the config class's default index_n_heads; index_rope_interleaved: the indexer's RoPE layout."""

  hybrid: bool = True  # layer_types names the layers' mixer (DSA), not windows
  index_heads: int = 64
  index_rope_interleaved: bool = False

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    if hf.get("mlp_layer_types"):
      return super().moe_layers(hf, layers)
    return tuple(i >= hf.get("first_k_dense_replace", 3) for i in range(layers))

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    types = hf.get("layer_types") or [KIND] * layers
    require(list(types) == [KIND] * layers, "layer_types", types, f"{layers} x {KIND!r} (every layer DSA)")
    return None, None

  def decoder_fields(self, hf: dict) -> dict:
    indexer = dict(
      heads=hf.get("index_n_heads", self.index_heads),
      head_dim=hf.get("index_head_dim", 128),
      topk=hf.get("index_topk", 2048),
      rope_interleaved=self.index_rope_interleaved,
    )
    return {
      **super().decoder_fields(hf),
      "rope_interleaved": True,
      "num_mtp_layers": 0,
      "mixers": ("dsa",) * hf["num_hidden_layers"],
      "indexer": tuple(sorted(indexer.items())),
    }

  def layer_mixers(self, cfg) -> tuple:
    """The mixers config.json can say for cfg's layers: 'dsa' in every one."""
    return ("dsa",) * cfg.num_layers

  def to_hf(self, cfg, moe_cfg) -> dict:
    fields = dict(cfg.indexer or ())
    for name, got, want in (
      ("mixers", cfg.mixers, self.layer_mixers(cfg)),
      ("indexer", fields.get("rope_interleaved"), self.index_rope_interleaved),
      ("rope_interleaved", cfg.rope_interleaved, True),
      ("num_mtp_layers", cfg.num_mtp_layers, 0),
      ("sliding_window", cfg.sliding_window, None),
      ("gated_attention", cfg.gated_attention, False),
      ("norm_offset", cfg.norm_offset, False),
    ):
      require(got == want, name, got, f"{want!r}: {cfg.family}'s config.json cannot say otherwise")
    return {
      **super().to_hf(cfg, moe_cfg),
      "layer_types": [KIND] * cfg.num_layers,
      "index_n_heads": fields["heads"],
      "index_head_dim": fields["head_dim"],
      "index_topk": fields["topk"],
    }

  def version_to_hf(self, cfg, moe_cfg) -> dict:
    return {}  # no rope_interleave (always), no MTP count


DEEPSEEK_V32 = DeepSeekV32("deepseek_v32", "DeepseekV32ForCausalLM", ignored=(r"^model\.layers\.61\.",))
