"""Token mixers beside attention (issue 59), as pure JAX functions over parameter dicts in transformers' layout.

delta_rule      the gated delta rule: chunked (prefill, training) and token by token (decode)
gated_deltanet  Qwen3-Next's and Qwen3.5-MoE's gated DeltaNet layer around it (`gated_deltanet_mixer`)
deepseek_v4_attention  DeepSeek-V4's sliding-window attention: one shared K=V head, sinks, a grouped low-rank output
                       (its compressed KV, CSA and HCA, not yet)
hyper_connections  DeepSeek-V4's manifold-constrained hyper-connections (mHC): N residual streams mixed by
                   Sinkhorn-projected weights, and the hyper head
"""
