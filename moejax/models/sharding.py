"""Where the language models' arrays live on the ('node', 'gpu') mesh: activations (`activation_spec`) and
parameters (`param_specs`: experts as the MoE layer lays them out, dense parts replicated or split over 'gpu' by
Megatron-style tensor parallelism)."""

from jax.sharding import PartitionSpec as P

from moejax.models.config import ModelConfig
from moejax.moe.config import MoEConfig
from moejax.moe.params import param_specs as moe_param_specs
from moejax.runtime import mesh as mesh_lib


def activation_spec(cfg: ModelConfig) -> P:
  """Activations [B, S, d]: the batch over both mesh axes, or over 'node' only with tensor parallelism."""
  return P(mesh_lib.NODE) if cfg.tensor_parallel else P(mesh_lib.AXES)


# Megatron's split of a block's dense kernels over 'gpu' (by the parameter's path suffix): heads of the
# attention projections, hidden units of the dense FFN; the other parameters are replicated.
TENSOR_PARALLEL_SPECS = {
    ("attn", "qkv", "kernel"): P(None, None, mesh_lib.GPU, None), ("attn", "qkv", "bias"): P(None, mesh_lib.GPU, None),
    ("attn", "out", "kernel"): P(mesh_lib.GPU, None, None),
    ("ffn", "w_in", "kernel"): P(None, mesh_lib.GPU), ("ffn", "w_in", "bias"): P(mesh_lib.GPU),
    ("ffn", "w_out", "kernel"): P(mesh_lib.GPU, None),
}


def param_specs(params: dict, moe_cfg: MoEConfig, tensor_parallel: bool = False) -> dict:
  """PartitionSpecs for a pure-dict parameter tree: experts as `moejax.moe.params.param_specs`, dense
  parameters replicated, or with tensor_parallel split over 'gpu' as `TENSOR_PARALLEL_SPECS`."""

  def specs(tree, path=()):
    if isinstance(tree, dict):
      if set(tree) == {"moe"} and isinstance(tree["moe"], dict):
        return {"moe": moe_param_specs(moe_cfg)}
      return {k: specs(v, path + (k,)) for k, v in tree.items()}
    return TENSOR_PARALLEL_SPECS.get(path[-3:], P()) if tensor_parallel else P()

  return specs(params)

