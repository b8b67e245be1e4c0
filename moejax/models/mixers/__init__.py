"""Token mixers beside attention (issue 59), as pure JAX functions over parameter dicts in transformers' layout.

delta_rule      the gated delta rule: chunked (prefill, training) and token by token (decode)
gated_deltanet  Qwen3-Next's and Qwen3.5-MoE's gated DeltaNet layer around it (`gated_deltanet_mixer`)
"""
