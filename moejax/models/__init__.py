"""The language models with expert-parallel MoE blocks: SMILE's (a BERT-like encoder, a GPT-style decoder) and the
decoder families of today's MoE models, loaded from and saved to their Hugging Face checkpoints.

  model = moejax.models.from_hf(path, mesh, dtype="float32", moe={MoEConfig field: value, ...})
  logits_BxSxV, aux = model(tokens_BxS)
  moejax.models.to_hf(model, out_dir)                             # config.json + safetensors (+ index)
  moe_model = moejax.models.upcycle(dense_model, num_experts=8, top_k=2)   # a dense checkpoint made an MoE

  config          `ModelConfig` (SMILE's models); the model and MoE configs of a run config's sections
  parallelism     the layout fields both model configs share (tensor_parallel, grad_sync, fsdp, remat, scan_layers)
  decoder_config  `DecoderConfig` (the families: Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, Llama, Qwen3)
  families        one module per family (`Family`: its config.json fields, checkpoint names, attention), by model_type
  presets         published MoE layer shapes (DeepSeek-V3, Qwen3-MoE, Mixtral) as MoEConfig fields
  layers          where the layers live: unrolled `blocks` or scanned `segments` (stacked per segment), per layer
  backbone        what both kinds of model share: the MoE layer as an FFN (`MoEFFN`), the loop over the layers
  blocks          SMILE's attention, dense FFN and blocks
  language_model  `LanguageModel`: SMILE's embeddings, blocks, tied output layer
  rope, rms_norm, attention, decoder   the families' `Decoder`: RoPE/YaRN, RMSNorm, GQA and latent attention, MTP
  hf_config, hf_load, hf_checkpoint, hf_files   config.json and safetensors in and out (`from_hf`, `to_hf`)
  placed          `with_placement`: a model's experts placed on the devices, the order `to_hf` undoes
  upcycling       dense FFNs copied (and split) into experts, output unchanged at step 0
  sharding        where activations and parameters live on the mesh (`activation_spec`, `param_specs`)
  state           the state as pure dicts (`abstract_state`, `init_state`), the MoE layers' state stacked
  grad_sync       Lina's prioritised gradient synchronisation
"""

# Loaded on first use. Generation builds on this package: `moejax.infer.generate_tokens`.
_PUBLIC = {
  "from_hf": "moejax.models.hf_load",
  "to_hf": "moejax.models.hf_checkpoint",
  "upcycle": ("moejax.models.upcycling", "upcycle"),
}


def __getattr__(name: str):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'moejax.models' has no attribute {name!r}")
  import importlib

  module, attribute = _PUBLIC[name] if isinstance(_PUBLIC[name], tuple) else (_PUBLIC[name], name)
  return getattr(importlib.import_module(module), attribute)
