"""The language model's state as pure dicts: abstract (`abstract_state`, nothing allocated) or built on the mesh
(`init_state`), and the MoE layers' non-parameter state stacked over the layers ([M, ...], `moe_layer_paths`: the
MTP modules' MoE layers after the blocks'; scanned layers hold theirs stacked per segment already): slot tables,
balancing biases, earlier micro-batches' choice counts."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.models import layers as layers_lib
from moejax.models.config import ModelConfig, moe_block_indices
from moejax.models.decoder import Decoder
from moejax.models.decoder_config import DecoderConfig
from moejax.models.language_model import LanguageModel
from moejax.models.sharding import model_param_specs
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib


def build(cfg: ModelConfig | DecoderConfig, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, seed: int = 0):
  """The model of a config: a SMILE `LanguageModel` (`ModelConfig`) or a decoder family's `Decoder`."""
  model_class = Decoder if isinstance(cfg, DecoderConfig) else LanguageModel
  return model_class(cfg, moe_cfg, mesh, rngs=nnx.Rngs(seed))


def abstract_state(cfg: ModelConfig | DecoderConfig, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, seed: int = 0):
  """(graphdef, params, rest) of the model without allocating anything: params and the other state
  (the MoE layers' key streams) as pure dicts of jax.ShapeDtypeStruct carrying their shardings,
  parameters placed by `param_specs` and everything else replicated."""
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: build(cfg, moe_cfg, mesh, seed)), nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  cfg.check_mesh(*mesh_lib.axis_sizes(mesh))
  specs = model_param_specs(params, cfg, moe_cfg, mesh)
  with_sharding = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
  return (graphdef, jax.tree.map(with_sharding, params, specs), jax.tree.map(lambda a: with_sharding(a, P()), rest))


def init_state(
  cfg: ModelConfig | DecoderConfig, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, seed: int = 0, only_rest: bool = False
):
  """(params, rest) as pure dicts, built by one compiled program that places every array as
  `abstract_state` says (with several processes, each holds only its shards). only_rest: rest alone (the
  parameters' initialisation is then dead code, so nothing of them is computed or allocated)."""
  _, params, rest = abstract_state(cfg, moe_cfg, mesh, seed)
  split = lambda: tuple(nnx.to_pure_dict(s) for s in nnx.split(build(cfg, moe_cfg, mesh, seed), nnx.Param, ...)[1:])
  if only_rest:
    return jax.jit(lambda: split()[1], out_shardings=jax.tree.map(lambda a: a.sharding, rest))()
  shardings = jax.tree.map(lambda a: a.sharding, (params, rest))
  return jax.jit(split, out_shardings=shardings)()


def moe_layer_paths(cfg: ModelConfig | DecoderConfig) -> list[tuple[tuple, int | None]]:
  """Where the M MoE layers sit in the model's state, in the order of aux['expert_counts'] in training: per MoE
  layer (the path of its block's subtree, its index on the stacked leaves' leading axis or None; `layers.where`), the
  blocks' (`moe_block_indices`), then the MTP modules' (DeepSeek-V3: each module's block has the model's MoE layer)."""
  placed = layers_lib.where(cfg)
  paths = [placed[i] for i in moe_block_indices(cfg)]
  if paths and getattr(cfg, "num_mtp_layers", 0):
    paths += [(("mtp", k, "block"), None) for k in range(cfg.num_mtp_layers)]
  return paths


def _moe(rest: dict, path: tuple) -> dict:
  for key in path:
    rest = rest[key]
  return rest["ffn"]["moe"]


def _rows_by_path(cfg) -> dict:
  """path -> (the MoE layers' rows [m, ...] of the stacked state it holds, their indices on its leading axis or
  None): a scanned sub-layer holds all its repeats' rows, in order."""
  by_path = {}
  for row, (path, r) in enumerate(moe_layer_paths(cfg)):
    rows, indices = by_path.setdefault(path, ([], []))
    rows.append(row)
    indices.append(r)
  return by_path


def _stacked(cfg: ModelConfig, rest: dict, name: str):
  """The MoE layers' state `name` stacked over the layers ([M, ...]) from the pure-dict `rest`, or None
  when the layers have none (ShapeDtypeStructs in, one ShapeDtypeStruct with the sharding out). One slice or stack
  per path (a scanned sub-layer's leaves already hold [repeats, ...]), then one gather into layer order if needed."""
  by_path = _rows_by_path(cfg)
  values = [_moe(rest, path).get(name) for path in by_path]
  if not values or values[0] is None:
    return None
  if isinstance(values[0], jax.ShapeDtypeStruct):
    like = values[0]
    shape = like.shape[1:] if by_path[next(iter(by_path))][1][0] is not None else like.shape
    return jax.ShapeDtypeStruct((len(moe_layer_paths(cfg)), *shape), like.dtype, sharding=like.sharding)
  blocks = [value if indices[0] is not None else value[None] for value, (_, indices) in zip(values, by_path.values())]
  order = [row for rows, _ in by_path.values() for row in rows]
  stacked = jnp.concatenate(blocks)
  return stacked if order == sorted(order) else stacked[jnp.argsort(jnp.asarray(order))]


def _with_stacked(cfg: ModelConfig, rest: dict, name: str, stacked) -> dict:
  """`rest` with MoE layer j's state `name` replaced by stacked[j] (the rest of the tree shared)."""

  def replaced(tree, path, value):
    if not path:
      return {**tree, "ffn": {**tree["ffn"], "moe": {**tree["ffn"]["moe"], name: value}}}
    return {**tree, path[0]: replaced(tree[path[0]], path[1:], value)}

  for path, (rows, indices) in _rows_by_path(cfg).items():
    if indices[0] is None:
      value = stacked[rows[0]]
    else:  # a scanned sub-layer's repeats: contiguous rows (period 1) or every len(sub-layers)-th
      contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
      value = stacked[rows[0] : rows[0] + len(rows)] if contiguous else stacked[jnp.asarray(rows)]
    rest = replaced(rest, path, value)
  return rest


def slot_tables(cfg: ModelConfig, rest: dict):
  """[M, A, Z] int32: the MoE layers' slot tables stacked from the pure-dict `rest` (the non-parameter
  state of `abstract_state`/`init_state`), or None without replication (moe.slots_per_device unset)."""
  return _stacked(cfg, rest, "slot_expert")


def with_slot_tables(cfg: ModelConfig, rest: dict, tables_MxAxZ) -> dict:
  """`rest` with MoE layer j's slot table replaced by tables_MxAxZ[j] (the rest of the tree shared)."""
  return _with_stacked(cfg, rest, "slot_expert", tables_MxAxZ)


def expert_biases(cfg: ModelConfig, rest: dict):
  """[M, E] float32: the MoE layers' auxiliary-loss-free balancing biases (`ExpertBias`) stacked from the
  pure-dict `rest`, or None without them (moe.bias_update_rate = 0)."""
  return _stacked(cfg, rest, "expert_bias")


def with_expert_biases(cfg: ModelConfig, rest: dict, bias_MxE) -> dict:
  """`rest` with MoE layer j's balancing bias replaced by bias_MxE[j] (the rest of the tree shared)."""
  return _with_stacked(cfg, rest, "expert_bias", bias_MxE)


def balance_counts(cfg: ModelConfig, rest: dict):
  """[M, cfg.balance_counts_size] float32: the MoE layers' earlier-micro-batch choice counts (`BalanceCounts`,
  balance_loss='global_batch') from the pure-dict `rest`, or None without them."""
  return _stacked(cfg, rest, "balance_counts")


def with_balance_counts(cfg: ModelConfig, rest: dict, earlier_counts) -> dict:
  """`rest` with MoE layer j's earlier-micro-batch choice counts replaced by earlier_counts[j]."""
  return _with_stacked(cfg, rest, "balance_counts", earlier_counts)
