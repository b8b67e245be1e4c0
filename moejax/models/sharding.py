"""Where the language models' arrays live on the ('node', 'gpu') mesh: activations (`activation_spec`) and
parameters (`param_specs`: experts as the MoE layer lays them out, dense parts replicated or split over 'gpu' by
Megatron-style tensor parallelism, and with FSDP sharded over the data-parallel devices; XLA gathers each where it
is used, in the forward and again in the backward, and reduce-scatters its gradient; a scanned segment's stacked
leaves [repeats, ...] as one layer's, the layer axis unsharded)."""

import math

import jax
from jax.sharding import PartitionSpec as P

from moejax.models.config import ModelConfig
from moejax.moe.config import MoEConfig
from moejax.moe.params import EXPERT_PARAMS, param_shapes
from moejax.moe.params import param_specs as moe_param_specs
from moejax.runtime import mesh as mesh_lib


def activation_spec(cfg: ModelConfig) -> P:
  """Activations [B, S, d]: the batch over both mesh axes, or over 'node' only with tensor parallelism."""
  return P(mesh_lib.NODE) if cfg.tensor_parallel else P(mesh_lib.AXES)


# Megatron's split of a block's dense kernels over 'gpu' (by the parameter's path suffix): heads of the
# attention projections, hidden units of the dense FFN; the other parameters are replicated.
TENSOR_PARALLEL_SPECS = {
  ("attn", "qkv", "kernel"): P(None, None, mesh_lib.GPU, None),
  ("attn", "qkv", "bias"): P(None, mesh_lib.GPU, None),
  ("attn", "out", "kernel"): P(mesh_lib.GPU, None, None),
  ("ffn", "w_in", "kernel"): P(None, mesh_lib.GPU),
  ("ffn", "w_in", "bias"): P(mesh_lib.GPU),
  ("ffn", "w_out", "kernel"): P(mesh_lib.GPU, None),
}
# The same for the decoder families: q, k, v (and MLA's q_b, kv_b) projections by heads, the output projection by
# its input heads, the SwiGLU FFN by hidden units; MLA's latent projections and the norms are replicated.
_COLUMNS, _ROWS = P(None, mesh_lib.GPU), P(mesh_lib.GPU, None)
TENSOR_PARALLEL_SPECS.update(
  {
    **{("attn", name, "kernel"): _COLUMNS for name in ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj")},
    **{("attn", name, "bias"): P(mesh_lib.GPU) for name in ("q_proj", "k_proj", "v_proj")},
    ("attn", "o_proj", "kernel"): _ROWS,
    ("ffn", "gate_proj", "kernel"): _COLUMNS,
    ("ffn", "up_proj", "kernel"): _COLUMNS,
    ("ffn", "down_proj", "kernel"): _ROWS,
  }
)


def param_specs(params: dict, moe_cfg: MoEConfig, tensor_parallel: bool = False, fsdp_over: dict | None = None) -> dict:
  """PartitionSpecs for a pure-dict parameter tree: the MoE layers' as `moejax.moe.params.param_specs` (experts
  sharded by the layer), dense parameters replicated, or with tensor_parallel split over 'gpu' as
  `TENSOR_PARALLEL_SPECS`. fsdp_over: the data-parallel axes and their sizes (FSDP, ZeRO-3): every parameter but the
  routed experts, the MoE layers' routers and shared experts included, is also sharded over those of them its spec
  does not use yet, on its first dimension not split yet that they divide (none, e.g. a small norm: replicated)."""

  def fsdp(spec: P, shape) -> P:
    used = {a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None}
    axes = tuple(a for a in fsdp_over if a not in used)
    devices = math.prod(fsdp_over[a] for a in axes)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for i, size in enumerate(shape):
      if axes and entries[i] is None and size % devices == 0:
        entries[i] = axes if len(axes) > 1 else axes[0]
        return P(*entries)
    return spec

  def moe_specs() -> dict:
    layer = moe_param_specs(moe_cfg)
    if not fsdp_over:
      return layer
    shapes = param_shapes(moe_cfg)
    return {
      k: v if k in EXPERT_PARAMS else jax.tree.map(fsdp, v, shapes[k], is_leaf=_is_spec) for k, v in layer.items()
    }

  def specs(tree, path=()):
    lead = layer_axes(path)
    if isinstance(tree, dict):
      if set(tree) == {"moe"} and isinstance(tree["moe"], dict):
        return {"moe": jax.tree.map(lambda spec: P(*(None,) * lead, *spec), moe_specs(), is_leaf=_is_spec)}
      return {k: specs(v, path + (k,)) for k, v in tree.items()}
    spec = TENSOR_PARALLEL_SPECS.get(path[-3:], P()) if tensor_parallel else P()
    spec = fsdp(spec, tree.shape[lead:]) if fsdp_over else spec
    return P(*(None,) * lead, *spec) if lead else spec

  return specs(params)


def layer_axes(path: tuple) -> int:
  """Leading axes of a state leaf at `path` that index layers: 1 for a scanned segment's stacked leaves
  (`segments/s/j/...`: [repeats, ...], never sharded), 0 otherwise."""
  return int(len(path) > 3 and path[0] == "segments")


def _is_spec(x) -> bool:
  return isinstance(x, P)


def model_param_specs(params: dict, cfg, moe_cfg: MoEConfig, mesh) -> dict:
  """`param_specs` as a model config (`ModelConfig` or `DecoderConfig`) asks on `mesh`: tensor parallelism, and with
  cfg.fsdp the dense parameters sharded over the data-parallel axes (both, or 'node' with tensor parallelism)."""
  over = ((mesh_lib.NODE,) if cfg.tensor_parallel else mesh_lib.AXES) if cfg.fsdp else ()
  return param_specs(params, moe_cfg, cfg.tensor_parallel, {axis: mesh.shape[axis] for axis in over})


def separate_axes(params: dict) -> dict:
  """A tree like the pure-dict params: per leaf, how many leading axes index separate tensors, each of which the
  optimizer treats as its own parameter (LAMB's trust ratio, Muon's matrices, weight decay on matrices only): the
  layers of a scanned segment ([repeats, ...], `layer_axes`), and the routed experts of an MoE layer's stacked w_in, w_out,
  w_gate and biases ([E, ...]); however the leaf is sharded."""

  def marks(tree, path=()):
    if isinstance(tree, dict):
      return {k: marks(v, path + (k,)) for k, v in tree.items()}
    expert = len(path) >= 2 and path[-2] == "moe" and path[-1] in EXPERT_PARAMS
    return layer_axes(path) + int(expert)

  return marks(params)
