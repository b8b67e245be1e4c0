"""Published MoE models' shapes: the one table of them (`PUBLISHED`), each entry with its source.

The decoder families' configs (configs/decoder.py), the trainer's presets (`moejax.models.presets`), the scaling
sweep's presets, the kernel benchmark's cases (moejax/bench/kernel_cases.py), the GPU suite's layers and the
validation against Comet take their shapes from here.

Sources: each entry's `source`, the model's config.json on the Hugging Face hub (names as there: hidden_size is
d_model, moe_intermediate_size the experts' d_ff, intermediate_size the dense FFN's) or its paper. Balance-loss
coefficients: DeepSeek-V3's sequence-wise alpha 0.0001 and bias update speed 0.001 (Sec. 4.2), the others'
router_aux_loss_coef. A shared expert's width left out is d_ff (MoEConfig's shared_d_ff None).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Published:
  """A published MoE model. `moe`: its MoE layer as MoEConfig fields at full size (d_model; d_ff the routed
  experts' width). `model`: the rest of the model as its config's fields (DecoderConfig's for the decoders:
  vocabulary, layers, attention, d_ff the dense FFN's width; ModelConfig's for SMILE's BERT), empty where moejax
  builds none. `dense`: leading dense layers. `mesh`: the (nodes, GPUs per node) it is trained or served on."""

  source: str
  moe: dict
  model: dict = dataclasses.field(default_factory=dict)
  dense: int = 0
  mesh: tuple[int, int] = (1, 8)


_SWIGLU = dict(gated=True, activation="silu", capacity_factor=None)  # dropless SwiGLU experts

PUBLISHED = {
  "mixtral_8x7b": Published(
    "mistralai/Mixtral-8x7B-v0.1",
    moe=dict(
      d_model=4096,
      d_ff=14336,
      num_experts=8,
      top_k=2,
      score="softmax",
      renormalize=True,
      **_SWIGLU,
      load_balance_coef=0.02,
    ),
    model=dict(
      vocab_size=32000,
      num_layers=32,
      d_ff=14336,
      num_heads=32,
      num_kv_heads=8,
      head_dim=128,
      max_len=32768,
      rope_theta=1e6,
      rms_eps=1e-5,
    ),
  ),
  "qwen2_moe": Published(  # 60 experts: served on 4 GPUs
    "Qwen/Qwen1.5-MoE-A2.7B",
    moe=dict(
      d_model=2048,
      d_ff=1408,
      num_experts=60,
      top_k=4,
      num_shared_experts=1,
      shared_d_ff=5632,
      shared_gate=True,
      **_SWIGLU,
      load_balance_coef=0.001,
    ),
    model=dict(
      vocab_size=151936,
      num_layers=24,
      d_ff=5632,
      num_heads=16,
      num_kv_heads=16,
      head_dim=128,
      max_len=8192,
      rope_theta=1e6,
      qkv_bias=True,
    ),
    mesh=(1, 4),
  ),
  "qwen3_next": Published(  # 3 gated DeltaNet layers, then one of gated attention, 12 times; 512 experts on 4 x 8
    "Qwen/Qwen3-Next-80B-A3B-Instruct",
    moe=dict(
      d_model=2048,
      d_ff=512,
      num_experts=512,
      top_k=10,
      num_shared_experts=1,
      shared_d_ff=512,
      shared_gate=True,
      score="softmax",
      renormalize=True,
      **_SWIGLU,
      load_balance_coef=0.001,
    ),
    model=dict(
      vocab_size=151936,
      num_layers=48,
      d_ff=5120,
      num_heads=16,
      num_kv_heads=2,
      head_dim=256,
      max_len=262144,
      rope_theta=1e7,
      partial_rotary_factor=0.25,
      qk_norm=True,
      gated_attention=True,
      norm_offset=True,
      mixers=(("gated_deltanet",) * 3 + ("attention",)) * 12,
      linear_num_key_heads=16,
      linear_num_value_heads=32,
      linear_key_head_dim=128,
      linear_value_head_dim=128,
      linear_conv_kernel=4,
      rms_eps=1e-6,
    ),
    mesh=(4, 8),
  ),
  "qwen3_moe": Published(
    "Qwen/Qwen3-30B-A3B",
    moe=dict(
      d_model=2048,
      d_ff=768,
      num_experts=128,
      top_k=8,
      score="softmax",
      renormalize=True,
      **_SWIGLU,
      load_balance_coef=0.001,
    ),
    model=dict(
      vocab_size=151936,
      num_layers=48,
      d_ff=6144,
      num_heads=32,
      num_kv_heads=4,
      head_dim=128,
      max_len=40960,
      rope_theta=1e6,
      qk_norm=True,
    ),
    mesh=(2, 8),
  ),
  "deepseek_v2": Published(
    "deepseek-ai/DeepSeek-V2-Lite",
    moe=dict(
      d_model=2048, d_ff=1408, num_experts=64, top_k=6, num_shared_experts=2, **_SWIGLU, load_balance_coef=0.001
    ),
    model=dict(
      vocab_size=102400,
      num_layers=27,
      d_ff=10944,
      num_heads=16,
      num_kv_heads=16,
      head_dim=64,
      max_len=163840,
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
      rope_interleaved=True,
    ),
    dense=1,
  ),
  "deepseek_v3": Published(
    "deepseek-ai/DeepSeek-V3",
    moe=dict(
      d_model=7168,
      d_ff=2048,
      num_experts=256,
      top_k=8,
      score="sigmoid",
      renormalize=True,
      routed_scaling=2.5,
      num_groups=8,
      topk_groups=4,
      bias_update_rate=0.001,
      num_shared_experts=1,
      **_SWIGLU,
      balance_loss="sequence",
      load_balance_coef=0.0001,
    ),
    model=dict(
      vocab_size=129280,
      num_layers=61,
      d_ff=18432,
      num_heads=128,
      num_kv_heads=128,
      head_dim=64,
      max_len=163840,
      q_lora_rank=1536,
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
      rope_interleaved=True,
      num_mtp_layers=1,
    ),
    dense=3,
    mesh=(32, 8),
  ),
  "phi3.5_moe": Published(  # its SparseMixer router is not modelled: the expert shape only
    "microsoft/Phi-3.5-MoE-instruct", moe=dict(d_model=4096, d_ff=6400, num_experts=16, top_k=2, **_SWIGLU)
  ),
  # SMILE (arXiv 2212.05191) Table 2: BERT with every other FFN an MoE layer, 128 experts on 16 nodes x 8 GPUs,
  # top-1, capacity factor 2.0, sequences of 128 tokens, T5's vocabulary (Sec. 4.1).
  **{
    f"smile_{size}": Published(
      "SMILE Table 2",
      moe=dict(
        d_model=d_model, d_ff=d_ff, num_experts=128, top_k=1, gated=False, activation="gelu", capacity_factor=2.0
      ),
      model=dict(
        kind="bert", vocab_size=32128, num_layers=layers, num_heads=heads, d_ff=d_ff, max_len=128, moe_every=2
      ),
      mesh=(16, 8),
    )
    for size, layers, d_model, heads, d_ff in (
      ("3.7b", 12, 768, 12, 3072),
      ("13b", 24, 1024, 16, 4096),
      ("48b", 36, 1600, 25, 6400),
    )
  },
}
