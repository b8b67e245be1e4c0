"""Pallas expert kernels, imported as `kernels`.

Modules (imported on demand, so that importing the package does not load Pallas):
  gmm: `gmm` grouped matmul and `tgmm`, its per-group weight gradient.
  ffn: `expert_ffn`, the fused grouped expert FFN.
  activations: the activation definitions every expert backend must share.
  tuning: tile sizes by device, kernel, dtype and shape class.
"""
