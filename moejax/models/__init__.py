"""The SMILE language models (a BERT-like encoder, a GPT-style decoder) with expert-parallel MoE blocks, used by
training (`moejax.train`) and inference (`moejax.infer`).

  config          `ModelConfig`; the model and MoE layer configs of a run config's sections (`from_sections`)
  presets         published MoE layer shapes (DeepSeek-V3, Qwen3-MoE, Mixtral) as MoEConfig fields
  blocks          attention (with a KV cache), the dense and the MoE FFN, the Transformer block
  language_model  `LanguageModel`: embeddings, blocks, tied output layer
  sharding        where activations and parameters live on the mesh (`activation_spec`, `param_specs`)
  state           the state as pure dicts (`abstract_state`, `init_state`), the MoE layers' state stacked
  grad_sync       Lina's prioritised gradient synchronisation
"""
