"""A published fine-grained MoE model (moejax.models.presets) in the scaling sweep, on a DGX H100-like cluster.

The preset's routed layer at full width (d_model, expert d_ff, top-k, scores, group limit, shared expert, routed
scaling) with 8 experts per GPU, so 4 nodes x 8 GPUs hold DeepSeek-V3's 256 experts (Qwen3-MoE's 128 at 2 nodes);
the model's layer count from the preset, sequences of 4096 tokens, one per GPU. DeepSeek-V3 and Qwen3-MoE are sweep
families (`moejax.study.point_models`): their step is priced with their own attention (MLA; grouped-query with
QK-norm), dense FFNs (V3's first 3 layers) and head, and a measured point trains that decoder; another preset's
model is priced as SMILE's BERT with every layer MoE. The schemes are those of flat top-k routing (DeepSeek-V3's group limit is its own node
limit; SMILE's bi-level router cannot take sigmoid scores or the bias): flat dropless, hierarchical, and the
overlap schedules of the flat layer. The rows travel as the default sweep's (bfloat16 both ways), DeepSeek-V3's
dispatch in FP8 (e4m3 with a float32 scale per 128 elements, its report's Sec. 3.3.2), its combine in bfloat16.

  python -m experiments.scaling --config=configs/scaling_presets.py --workdir=/tmp/scaling_ds
  python -m experiments.scaling --config=configs/scaling_presets.py:qwen3_moe --workdir=/tmp/scaling_q3
  python -m experiments.scaling --config=configs/scaling_presets.py:deepseek_v4 --workdir=/tmp/scaling_ds4

A 2026 family of `moejax.models.hf_shaped` (DeepSeek-V4, Qwen3.5, ...) is its published decoder
(`moejax.study.hf_point_models`: its own mixers, every layer of its pattern) with its routed layer's fields from its
config.json, at 8 experts a GPU, over the schemes its layer composes with (Llama 4's weighted inputs leave out
'comet', the reason logged).
"""

import dataclasses

import ml_collections
from absl import logging

from configs import scaling_default
from moejax.models import hf_config, hf_shaped, presets
from moejax.moe.config import MoEConfig
from moejax.study import point_models
from moejax.study.points import SCHEME_FIELDS, scheme_config
from moejax.validation import ConfigError

# vocab_size of each model's config.json on the Hugging Face hub (the sources named in moejax.models.presets)
VOCAB = {"deepseek_v3": 129280, "qwen3_moe": 151936, "mixtral_8x7b": 32000}


def get_config(preset: str = "deepseek_v3") -> ml_collections.ConfigDict:
  if preset in hf_shaped.FAMILIES:
    return _hf_shaped(preset)
  if preset not in presets.PRESETS:
    known = sorted((*presets.PRESETS, *hf_shaped.FAMILIES))
    raise ValueError(f"unknown preset {preset!r}; choose one of {known}")
  published = presets.PRESETS[preset]
  fields = presets.moe_fields(preset)
  config = _dgx_h100()
  model = {
    "d_model": fields["d_model"],
    "d_ff": fields["d_ff"],
    "layers": published.layers,
    "moe_layers": published.layers,
    "seq_len": 4096,
    "micro_batch": 1,
    "vocab": VOCAB[preset],
  }
  if preset in point_models.FAMILIES:
    model.update(family=preset, moe_layers=published.layers - presets.PUBLISHED[preset].dense)
  config.models = ml_collections.ConfigDict({preset: model})
  # The sweep prices the layer and times no loss: the per-call balance loss (the small run's x is [tokens, d]).
  routed = {k: v for k, v in fields.items() if k not in SCHEME_FIELDS and k != "balance_loss"}
  config.moe.update(routed)
  config.moe.experts_per_gpu = 8
  if preset == "deepseek_v3":
    config.moe.dispatch_dtype = "float8_e4m3fn"
  return config


def _dgx_h100() -> ml_collections.ConfigDict:
  config = scaling_default.get_config()
  config.topology = "dgx_h100_ib"
  config.gemm_sms = 132  # H100 SXM5 datasheet: 132 SMs
  config.nodes = (1, 2, 4)
  config.gpus_per_node = (8,)
  config.schemes = ("flat_dropless", "hierarchical", "chunked", "comet")
  return config


def _hf_shaped(family: str) -> ml_collections.ConfigDict:
  """A 2026 family (`moejax.models.hf_shaped`) at its published shape: its point model
  (`moejax.study.hf_point_models`) with every layer of the published pattern, its routed layer's fields from its
  config.json (top-k, scores, groups, shared experts, zero experts, the clamped SwiGLU), 8 experts a GPU."""
  cfg, moe = hf_config.from_hf_config(hf_shaped.record(family)["config"])
  config = _dgx_h100()
  model = dict(family=family, d_model=cfg.d_model, d_ff=moe.d_ff, layers=cfg.num_layers, seq_len=4096, micro_batch=1)
  model.update(moe_layers=sum(cfg.moe_layers), vocab=cfg.vocab_size)
  config.models = ml_collections.ConfigDict({family: model})
  defaults = MoEConfig(num_experts=moe.num_experts, top_k=moe.top_k, d_model=moe.d_model, d_ff=moe.d_ff)
  changed = {
    k: v
    for k, v in dataclasses.asdict(moe).items()
    if k not in SCHEME_FIELDS and k not in ("balance_loss", "bias_update_rate") and v != getattr(defaults, k)
  }
  config.moe.update(changed, top_k=moe.top_k)
  config.moe.experts_per_gpu = 8
  config.schemes = tuple(s for s in config.schemes if _takes(s, config.moe, model["d_model"], model["d_ff"]))
  return config


def _takes(scheme: str, moe, d_model: int, d_ff: int) -> bool:
  """Whether the family's routed layer composes with `scheme` (Llama 4's weighted inputs refuse 'comet': logged with
  the design reason)."""
  try:
    scheme_config(scheme, 1, 8, moe, d_model, d_ff)
  except ConfigError as e:
    logging.info("scheme %s left out: %s", scheme, e)
    return False
  return True
