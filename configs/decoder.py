"""The decoder families of today's MoE models trained from scratch: Qwen3-MoE (default), DeepSeek-V3 (MLA, group-
limited sigmoid routing with the loss-free bias, a shared expert, dense first layer, one MTP module), DeepSeek-V2,
Qwen2-MoE (shared expert with its gate, qkv biases), Mixtral (GQA, sliding window) and Qwen3-Next (gated DeltaNet
and gated attention layers, 512 experts published), tiny for a 2 x 4 mesh of simulated CPU devices, or at their
published sizes on their published meshes; and the 2026 families of `moejax.models.hf_shaped` (DeepSeek-V3.2, GLM-5,
DeepSeek-V4, Qwen3.5, Kimi Linear, MiniMax-M2, LongCat-Flash, MiMo-V2-Flash, Llama 4, GLM-4.7-Flash, ERNIE-4.5,
Sarvam, Solar Open), their shapes as config.json fields that transformers' own classes wrote: tiny the fixture's,
published the config class's defaults (`tests/fixtures/make_published_configs.py`).

  python -m experiments.train --config=configs/decoder.py --workdir=/tmp/qwen3
  python -m experiments.train --config=configs/decoder.py:deepseek_v3 --workdir=/tmp/ds3
  python -m experiments.train --config=configs/decoder.py:deepseek_v4 --workdir=/tmp/ds4
  python -m experiments.train --config=configs/decoder.py:qwen3_moe,published --workdir=... \\
      --config.data.train_files='/data/c4/en/c4-train.*-of-01024.json.gz'

  python -m experiments.train --config=configs/decoder.py:hf=/path/to/Qwen3-30B-A3B --workdir=...   # fine-tune

The model section holds `moejax.models.decoder_config.DecoderConfig`'s fields; the moe section every MoEConfig field
but d_model (the experts' d_ff is moe.d_ff; model.d_ff is the dense FFN's). `hf=PATH` reads both from a local
checkpoint's config.json and starts from its weights (`init_from`) with its tokenizer (see docs/models.md).
"""

import dataclasses
import json
import os

import ml_collections

from configs import mlm
from configs.moe_section import moe_section
from moejax.models import hf_config, hf_shaped, presets
from moejax.pipeline import section as pipeline_section
from moejax.validation import ConfigError

# Each family's published model (moejax.models.presets.PUBLISHED: its shapes, and the mesh it is served on).
FAMILIES = {
  "qwen3_moe": "qwen3_moe",
  "deepseek_v3": "deepseek_v3",
  "deepseek_v2": "deepseek_v2",
  "qwen2_moe": "qwen2_moe",
  "mixtral": "mixtral_8x7b",
  "qwen3_next": "qwen3_next",
}
# Tiny: the published routing on 16 experts (8 for Mixtral), widths for a CPU; DeepSeek's attention shapes scaled.
TINY = {
  "qwen3_moe": dict(model=dict(num_kv_heads=2, head_dim=16, qk_norm=True), moe=dict(num_experts=16, top_k=4)),
  "deepseek_v3": dict(
    dense=1,
    model=dict(
      num_kv_heads=4,
      head_dim=8,
      q_lora_rank=32,
      kv_lora_rank=16,
      qk_nope_head_dim=16,
      qk_rope_head_dim=8,
      v_head_dim=16,
      rope_interleaved=True,
      num_mtp_layers=1,
    ),
    moe=dict(num_experts=16, top_k=4, num_groups=4, topk_groups=2),
  ),
  "deepseek_v2": dict(
    dense=1,
    model=dict(
      num_kv_heads=4,
      head_dim=8,
      kv_lora_rank=16,
      qk_nope_head_dim=16,
      qk_rope_head_dim=8,
      v_head_dim=16,
      rope_interleaved=True,
    ),
    moe=dict(num_experts=16, top_k=4),
  ),
  "qwen2_moe": dict(model=dict(num_kv_heads=4, head_dim=16, qkv_bias=True), moe=dict(num_experts=8, top_k=2)),
  "mixtral": dict(model=dict(num_kv_heads=2, head_dim=16, sliding_window=64), moe=dict(num_experts=8, top_k=2)),
  # Gated DeltaNet and gated attention alternating (the published 3:1 over 8 layers would leave one period, which
  # neither scans nor splits into pipeline stages), the published head ratios.
  "qwen3_next": dict(
    model=dict(
      num_layers=8,
      num_kv_heads=2,
      head_dim=16,
      qk_norm=True,
      partial_rotary_factor=0.25,
      gated_attention=True,
      norm_offset=True,
      mixers=("gated_deltanet", "attention") * 4,
      linear_num_key_heads=2,
      linear_num_value_heads=4,
      linear_key_head_dim=16,
      linear_value_head_dim=16,
    ),
    moe=dict(num_experts=16, top_k=4, shared_d_ff=32),
  ),
}

# The 2026 families: their shapes as config.json fields (see the module docstring), one record each.
HF_SHAPED = hf_shaped.FAMILIES

# The families train with AdamW (DeepSeek-V3's report: b1 0.9, b2 0.95, weight decay 0.1, clipping at 1.0); SMILE's
# configs keep LAMB. Tiny models keep fp32 parameters, moments and no master copy.
ADAMW = dict(name="adamw", b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def _hf_sections(config: ml_collections.ConfigDict, hf: dict) -> None:
  """The model and moe sections from config.json fields `hf` (the MoE choices moejax adds at their defaults)."""
  model_cfg, moe_cfg = hf_config.from_hf_config(hf)
  config.model = ml_collections.ConfigDict(dataclasses.asdict(model_cfg))
  config.moe = ml_collections.ConfigDict({k: v for k, v in dataclasses.asdict(moe_cfg).items() if k != "d_model"})


def from_checkpoint(path: str) -> ml_collections.ConfigDict:
  """Fine-tuning a local Hugging Face checkpoint: the model and moe sections from its config.json (the MoE choices
  moejax adds at their defaults: override them on the command line), `init_from` the checkpoint (its weights and
  balancing biases are the step-0 state) and its tokenizer.json as data.tokenizer_model where there is one."""
  if not os.path.isdir(path):
    raise ConfigError(f"the checkpoint directory {path} does not exist", "hf", path)
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise ConfigError(f"{path} has no config.json: not a Hugging Face checkpoint directory", "hf", path)
  config = mlm.get_config()
  with open(os.path.join(path, "config.json")) as f:
    _hf_sections(config, json.load(f))
  config.update(init_from=path, seq_len=min(64, config.model.max_len), steps=200, batch_size=16)
  config.optim.update(ADAMW, learning_rate=1e-4, warmup_steps=20)
  config.log.every_steps = 10
  tokenizer = os.path.join(path, "tokenizer.json")
  config.data.tokenizer_model = tokenizer if os.path.exists(tokenizer) else ""
  return config


def published_mesh(num_experts: int) -> tuple[int, int]:
  """A 2026 family's mesh at its published size: nodes of 8 GPUs, one per 64 routed experts (8 a GPU), 1 to 8."""
  return max(1, min(8, num_experts // 64)), 8


def published_shape(family: str) -> dict:
  """The family's published model as this config's sections: model (its d_model included), moe (every field but
  d_model), the leading dense layers and the mesh."""
  published = presets.PUBLISHED[FAMILIES[family]]
  return dict(
    mesh=published.mesh,
    dense=published.dense,
    model={**published.model, "d_model": published.moe["d_model"]},
    moe={k: v for k, v in published.moe.items() if k != "d_model"},
  )


def get_config(spec: str = "qwen3_moe") -> ml_collections.ConfigDict:
  if spec.startswith("hf="):
    return from_checkpoint(spec[len("hf=") :])
  family, _, size = spec.partition(",")
  if family not in (*FAMILIES, *HF_SHAPED) or size not in ("", "tiny", "published"):
    known = sorted((*FAMILIES, *HF_SHAPED))
    raise ValueError(f"unknown spec {spec!r}; choose FAMILY[,tiny|published] with FAMILY one of {known}")
  config = mlm.get_config()
  if family in HF_SHAPED:
    _hf_sections(config, hf_shaped.record(family)["config" if size == "published" else "tiny"])
    if size != "published":
      config.model.vocab_size = 256  # the tokenizer's a CPU run trains
    mesh = published_mesh(config.moe.num_experts)
  else:
    published = published_shape(family)
    shape = published if size == "published" else TINY[family]
    _preset_sections(config, family, shape, published)
    mesh = published["mesh"]
  config.pipeline = pipeline_section.defaults()  # no pipeline: 'none', 1 stage, 1 virtual stage (docs/pipelines.md)
  config.seq_len, config.steps, config.batch_size = min(64, config.model.max_len), 200, 16
  config.optim.update(ADAMW, learning_rate=3e-3, warmup_steps=20)
  config.log.every_steps = 10
  config.model.update(dtype="float32", param_dtype="float32", fsdp=False, remat="none")
  config.moe.num_nodes = config.mesh.nodes
  if size == "published":
    _published_run(config, family, mesh)
  return config


def _preset_sections(config: ml_collections.ConfigDict, family: str, shape: dict, published: dict) -> None:
  """The model and moe sections of a family of FAMILIES at `shape` (TINY's or the published one)."""
  layers = shape["model"].get("num_layers", 3)
  dense = shape.get("dense", 0)
  model = dict(
    family=family,
    vocab_size=256,
    num_layers=layers,
    d_model=64,
    d_ff=128,
    num_heads=4,
    max_len=256,
    moe_layers=tuple(i >= dense for i in range(layers)),
  )
  model.update(shape["model"])
  config.model = ml_collections.ConfigDict(model)
  moe = {
    **{
      k: v
      for k, v in published["moe"].items()
      if k not in ("num_experts", "top_k", "d_ff", "num_groups", "topk_groups")
    },
    "d_ff": 32,
    **shape["moe"],
  }
  config.moe = moe_section(omit=("d_model",), num_nodes=config.mesh.nodes, **moe)  # SwiGLU, dropless as published


def _published_run(config: ml_collections.ConfigDict, family: str, mesh: tuple[int, int]) -> None:
  """At a published size: its mesh, bf16 parameters and the ragged exchange, 2 sequences of 4096 a device."""
  config.mesh.update(nodes=mesh[0], gpus_per_node=mesh[1])
  config.moe.update(num_nodes=mesh[0], collective="ragged", dtype="bfloat16", buffer_factor=2.0)
  config.model.update(dtype="bfloat16", param_dtype="bfloat16")
  # bf16 parameters: an fp32 master copy; DeepSeek-V3's own recipe also keeps AdamW's moments in bf16.
  config.optim.update(master_dtype="float32", moment_dtype="bfloat16" if family == "deepseek_v3" else None)
  devices = mesh[0] * mesh[1]
  config.update(seq_len=min(4096, config.model.max_len), batch_size=2 * devices, micro_batches=1)
  config.data.update(shards=devices, tokenizer_train_chars=100_000_000)
