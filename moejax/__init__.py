"""moejax: communication-efficient Mixture-of-Experts on ('node', 'gpu') device meshes.

The public API for notebooks and other frameworks:

  mesh = moejax.make_mesh(2, 4)                       # axes ('node', 'gpu')
  cfg = moejax.MoEConfig(num_experts=16, top_k=2, d_model=64, d_ff=128)
  y, aux = moejax.MoELayer(cfg, mesh, rngs=nnx.Rngs(0))(x)
  y, aux = moejax.moe_apply(params, x, cfg, mesh)     # the same layer as a pure function
  y, aux, cfg = moejax.apply_without_overflow(params, x, cfg, mesh)  # with cfg.buffer_factor: nothing dropped
  y_ref, aux_ref = moejax.moe_reference(params, x, cfg)

Subpackages: `moe` (the layer and its parts), `models` (SMILE's models and the decoder families of Mixtral,
Qwen2/3-MoE and DeepSeek-V2/V3, from and to Hugging Face checkpoints: `moejax.models.from_hf`), `data`, `train`
(the trainer), `infer` (generation, ExFlow), `placement`, `replication`, `runtime` (mesh, processes), `cost` (cluster
cost model), `study` (scaling sweeps, timing, memory). The Pallas kernels are the top-level package `kernels`.
"""

# Loaded on first use, so that `import moejax` (and `python -m moejax.runtime.launch`) stays light.
_PUBLIC = {
  "ConfigError": "moejax.validation",
  "MoEConfig": "moejax.moe.config",
  "MoELayer": "moejax.moe.module",
  "init_params": "moejax.moe.params",
  "moe_apply": "moejax.moe.layer",
  "apply_without_overflow": "moejax.moe.overflow",
  "moe_reference": "moejax.moe.reference",
  "make_mesh": "moejax.runtime.mesh",
  "simulate_cpu_devices": "moejax.runtime.mesh",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'moejax' has no attribute {name!r}")
  import importlib

  return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__():
  return sorted(list(globals()) + __all__)
