"""The shapes the GPU suite times, from the published models (moejax.models.presets.PUBLISHED): the kernels' expert
shapes, the same models as MoE layers (and the published fine-grained presets), the chunking step's piece counts and
the train step's BERT-MoE; each with its tiny smoke variant."""

from moejax.bench.kernel_cases import MODELS
from moejax.models import presets

ROWS = 16384  # routed rows (token-choices) of the kernel and layer benchmarks


# Expert shapes for the kernel benchmark. 'experts': experts on the one GPU (expert parallelism 1).
KERNEL_MODELS = {
  "mixtral_8x7b": MODELS["mixtral_8x7b"],
  "qwen2_moe": MODELS["qwen2_moe"],
  "qwen3_moe": MODELS["qwen3_moe"],
  "smile_3.7b_e8": dict(MODELS["smile_3.7b"], experts=8),
}
SMOKE_KERNEL_MODELS = {"smoke_gated_e8": dict(d=32, f=64, experts=8, top_k=2, gated=True, activation="silu")}


def _layer(case: dict) -> dict:
  """A kernel case as an MoE layer (MoEConfig's shape fields) of tokens * top_k = ROWS routed rows."""
  return dict(
    d_model=case["d"],
    d_ff=case["f"],
    num_experts=case["experts"],
    top_k=case["top_k"],
    gated=case["gated"],
    activation=case["activation"],
    tokens=ROWS // case["top_k"],
  )


# The kernel cases' models as MoE layers.
LAYER_MODELS = {name: _layer(KERNEL_MODELS[name]) for name in ("mixtral_8x7b", "qwen2_moe", "smile_3.7b_e8")}
# The published fine-grained layers (moejax.models.presets) at full width: Qwen3-MoE's 128 experts, and a quarter of
# DeepSeek-V3's 256 (their weights, 5.6 GB in bf16, fit one GPU with the backward's), with V3's sigmoid, group-limited
# routing and shared expert; the balance loss per call (the benchmark's x is [tokens, d], not sequences).
for _name, _experts in (("qwen3_moe", 1), ("deepseek_v3", 4)):
  _fields = presets.moe_fields(_name, expert_scale=_experts)
  LAYER_MODELS[_name] = dict(_fields, balance_loss="batch", tokens=ROWS // _fields["top_k"])
SMOKE_LAYER_MODELS = {
  "smoke_gated_e8": dict(d_model=32, d_ff=64, num_experts=8, top_k=2, gated=True, activation="silu", tokens=32),
}

CHUNKS = (1, 2, 4, 8)  # chunking: pieces of the decomposed GEMMs

# A small BERT-MoE (every other FFN an MoE layer, as in SMILE) of SMILE 3.7B's widths, and its batch.
_SMILE = presets.PUBLISHED["smile_3.7b"]
TRAIN_SHAPE = dict(
  vocab_size=32768,
  num_layers=4,
  d_model=_SMILE.moe["d_model"],
  num_heads=_SMILE.model["num_heads"],
  d_ff=_SMILE.moe["d_ff"],
  seq_len=512,
  batch=32,
  num_experts=8,
  top_k=2,
)
SMOKE_TRAIN_SHAPE = dict(
  vocab_size=128, num_layers=2, d_model=32, num_heads=2, d_ff=64, seq_len=16, batch=4, num_experts=4, top_k=2
)


def _attention(name: str) -> dict:
  """A published model's attention heads: query heads, key/value heads, q/k width and v width (MLA's q/k are its
  non-rotary and rotary parts, its keys and values one per head)."""
  model = presets.PUBLISHED[name].model
  if "kv_lora_rank" in model:
    return dict(
      heads=model["num_heads"],
      kv_heads=model["num_heads"],
      width=model["qk_nope_head_dim"] + model["qk_rope_head_dim"],
      v_width=model["v_head_dim"],
    )
  return dict(
    heads=model["num_heads"], kv_heads=model["num_kv_heads"], width=model["head_dim"], v_width=model["head_dim"]
  )


# The attention step: DeepSeek-V3's MLA (128 heads, q/k 192, v 128) and Qwen3-30B-A3B's GQA (32 query heads over 4
# key/value heads, 128 wide), one sequence of ATTENTION_SEQ_LEN tokens per call.
ATTENTION_MODELS = {name: _attention(name) for name in ("deepseek_v3", "qwen3_moe")}
ATTENTION_SEQ_LEN = 4096
SMOKE_ATTENTION_MODELS = {
  "smoke_mla": dict(heads=4, kv_heads=4, width=24, v_width=16),
  "smoke_gqa": dict(heads=4, kv_heads=2, width=16, v_width=16),
}
SMOKE_ATTENTION_SEQ_LEN = 32

# The mixers step: Qwen3-Next-80B-A3B's gated DeltaNet layers (transformers' Qwen3NextConfig defaults, the published
# model's: d 2048, 16 key heads and 32 value heads of 128, a convolution of 4), in config.json's field names
# (`GatedDeltaNetConfig.from_hf`); one sequence of each length of MIXER_SEQ_LENS.
MIXER_MODELS = {
  "qwen3_next_80b_a3b": dict(
    hidden_size=2048,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
  )
}
MIXER_SEQ_LENS = (4096, 16384)
MIXER_CHUNKS = (64, 128)  # the chunked rule's chunk sizes (64: transformers' and the layer's)
MIXER_CHECK_LEN = 256  # tokens of the prefix checked against the recurrent rule (a multiple of tokamax's chunk 64)
SMOKE_MIXER_MODELS = {
  "smoke_gdn": dict(
    hidden_size=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
  )
}
SMOKE_MIXER_SEQ_LENS, SMOKE_MIXER_CHUNKS, SMOKE_MIXER_CHECK_LEN = (40,), (16,), 24  # chunks padded in both
