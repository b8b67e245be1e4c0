"""Autoregressive inference for the GPT-style decoder on the ('node', 'gpu') mesh.

cache    `init_cache`: the KV cache, one (k, v) [B, S, H, W] pair per block (S: prompt + generated)
exflow   `exflow_step`: one context-coherent decode step (ExFlow §IV-A), one exchange per MoE layer
decode   `generate`: prefill, then decode ('vanilla': two exchanges per MoE layer, or 'exflow'),
         greedy or sampled, with the exchange rows per generated token; `on_mesh` moves a model
         to another mesh, `with_placement` applies an expert placement (ExFlow §IV-D)
batch    `padded`: a batch padded to the mesh's devices (`generate_tokens`; the models pad their own calls so)
load     `load_trained`: a model from a training run's checkpoints (no trainer); `prompts_from`: prompts from texts

tokens_BxS = moejax.infer.generate_tokens(model, prompt_BxS, steps)   # greedy by default; prompt and steps tokens
"""

from moejax.infer.decode import generate, generate_tokens  # noqa: F401
