"""Hugging Face checkpoints' names and `to_hf`: each `Decoder` parameter's name on the hub (`hf_key`, `layer_keys`),
and the model written as config.json and safetensors shards with an index, as transformers' from_pretrained loads them.
Reading one is `moejax.models.hf_load` (`from_hf`).

Names: the hub's, one tensor per expert (`model.layers.N.mlp.experts.E.gate_proj.weight`; Mixtral's
`block_sparse_moe.experts.E.w1`), torch Linear weights [out, in] (moejax kernels are [in, out]). moejax's expert
weights are w_gate (gate_proj, w1), w_in (up_proj, w3) and w_out (down_proj, w2), stacked over the experts.
"""

import itertools
import json
import os

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from moejax.models import families, hf_config, hf_files, hf_parts, token_mixers
from moejax.models import layers as layers_lib
from moejax.models.config import moe_block_indices
from moejax.models.decoder import Decoder
from moejax.models.decoder_config import DecoderConfig
from moejax.models.families.base import EXPERT_NAMES
from moejax.placement import apply as placement_lib

# Parameter names of a block that the hub spells differently (the rest keep their names).
RENAMES = {
  "ln_attn": "input_layernorm",
  "ln_ffn": "post_attention_layernorm",
  "attn": "self_attn",  # attention's; another token mixer's own (`token_mixers.Mixer.hf_module`)
  "ffn": "mlp",
  "router": "gate",
  "kernel": "weight",
  "expert_bias": "e_score_correction_bias",
}
SHARD_BYTES = 4 << 30  # per safetensors file written


def hf_key(path: tuple, cfg: DecoderConfig) -> tuple[str, bool]:
  """(HF name, transposed) of a parameter or state path of an unrolled `Decoder` (a layer's `blocks/i/...`; a
  scanned model's leaves are each layer's: `layer_keys`); expert weights give the name with '{e}'. The hub's usual
  names, then the family's own (`Family.hf_name`; the MoE layer's: `Family.moe_module`, `expert_names`, ...)."""
  family = families.get(cfg.family)
  name, transposed = _usual_key(list(path), cfg, family)
  return family.hf_name(name, cfg), transposed


def _usual_key(path: list, cfg: DecoderConfig, family: families.Family) -> tuple[str, bool]:
  """(HF name, transposed) of `path` under the hub's usual names outside the MoE layer."""
  if path[0] in ("embed", "norm", "lm_head"):
    return {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}[
      path[0]
    ], path[0] == "lm_head"
  if path[0] == "hc_head":  # DeepSeek-V4's hyper head (`hyper_block.HyperHead`)
    return f"model.hc_head.{path[1]}", False
  if path[0] == "mtp":  # DeepSeek-V3's layer num_layers + k: its own norms and projection, then a usual block
    layer, rest = cfg.num_layers + path[1], path[2:]
    rest = rest[1:] if rest[0] == "block" else [{"norm": "shared_head.norm"}.get(rest[0], rest[0]), *rest[1:]]
  else:
    layer, rest = path[1], path[2:]
  if rest[:2] == ["ffn", "moe"]:
    return _moe_key(f"model.layers.{layer}", rest[2:], family)
  # the layer's token mixer under its own module name (self_attn, Qwen3-Next's linear_attn)
  mixer = token_mixers.of(cfg, layer).hf_module
  names = (mixer if p == "attn" else RENAMES.get(str(p), str(p)) for p in rest)
  return ".".join([f"model.layers.{layer}", *names]), rest[-1] == "kernel"


def _moe_key(prefix: str, path: list, family: families.Family) -> tuple[str, bool]:
  """(HF name, transposed) of the MoE layer's parameter or state `path` (under ffn/moe) in the layer `prefix`."""
  container = f"{prefix}.{family.moe_module}"
  if family.moe_key(container, path) is not None:  # a family's own layout (gpt-oss: experts stacked, gate and up fused)
    return family.moe_key(container, path)
  if path[0] in family.expert_names:  # one tensor per expert
    return f"{container}.experts.{{e}}.{family.expert_names[path[0]]}.weight", True
  if path[0] == "shared":
    return f"{container}.{family.shared_module}.{EXPERT_NAMES[path[1]]}.weight", True
  if path[0] == "shared_gate":
    return f"{container}.{family.shared_gate_module}.weight", True
  if path[0] == "expert_bias":  # DeepSeek-V3's e_score_correction_bias is the router's
    path = ["gate", "expert_bias"]
  return ".".join([container, *(RENAMES.get(str(p), str(p)) for p in path)]), path[-1] == "kernel"


def layer_keys(path: tuple, cfg: DecoderConfig) -> tuple[list[str], bool]:
  """([HF name of each layer the leaf at `path` holds], transposed): one name, or a scanned segment's leaf
  (`segments/s/j/...`, stacked [repeats, ...]) the names of its layers."""
  if path[0] != "segments":
    name, transposed = hf_key(path, cfg)
    return [name], transposed
  segment = layers_lib.segments(cfg)[path[1]]
  keys = [hf_key(("blocks", segment.layer(r, path[2]), *path[3:]), cfg) for r in range(segment.repeats)]
  return [name for name, _ in keys], keys[0][1]


def tree_leaves(tree: dict, prefix=()):
  """(path, leaf) of every leaf of a nested dict, depth first."""
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from tree_leaves(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def _host_tensors(model: Decoder):
  """(HF name, host array) of every tensor to write, one part of the model at a time (the embeddings, each layer (a
  scanned segment's repeat r sliced on the devices first), each MTP module, the final norm and head), a placed
  model's MoE layers put back in the checkpoint's order."""
  cfg, moe_cfg = hf_config.exported(model.cfg), model.moe_cfg  # the written family's names (a VLM's: its text-only)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
  order = getattr(model, "expert_order", None)
  undo = None if order is None else placement_lib.inverse_order(np.asarray(order))  # index i: expert order[j][i]
  moe_layer = {block: j for j, block in enumerate(moe_block_indices(cfg))}
  host = lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True))
  # (the part's name in `hf_key`'s paths, where it is: path and index on the stacked leaves)
  parts = [((key,), ((key,), None)) for key in params if key not in ("blocks", "segments", "mtp")]
  parts += [(("blocks", i), placed) for i, placed in enumerate(layers_lib.where(cfg))]
  parts += [(("mtp", k), (("mtp", k), None)) for k in params.get("mtp", {})]
  for part, (path, r) in parts:
    tree = jax.tree.map(host, layers_lib.subtree(params, path, r))
    state = rest
    for key in path:
      state = state.get(key) if isinstance(state, dict) else None
    moe_state = {} if not isinstance(state, dict) else state.get("ffn", {}).get("moe", {})
    # the state written: the balancing bias; DeepSeek-V4's token id table (logical expert ids: never placed), as
    # transformers keeps it (int64)
    written = {name: moe_state.get(name) for name in ("expert_bias", "hash_table") if moe_state.get(name) is not None}
    written = {name: host(a if r is None else a[r]) for name, a in written.items()}
    if "hash_table" in written:
      written["hash_table"] = written["hash_table"].astype(np.int64)
    if part[0] == "blocks" and part[1] in moe_layer and undo is not None:
      j = moe_layer[part[1]]
      tree["ffn"]["moe"] = placement_lib.permute_experts([tree["ffn"]["moe"]], undo[j][None], moe_cfg)[0]
      if "expert_bias" in written:
        written["expert_bias"] = written["expert_bias"][
          placement_lib.padded_order(undo[j], len(written["expert_bias"]))
        ]
    leaves = [(part + p, a) for p, a in tree_leaves(tree)] if isinstance(tree, dict) else [(part, tree)]
    leaves += [(part + ("ffn", "moe", name), a) for name, a in written.items()]
    yield from hf_parts.join_parts(_named(leaves, cfg))


def _named(leaves, cfg: DecoderConfig):
  """(HF name, host array) of each (path, array) of a part of the model: one tensor per expert where the family has
  them; parts of a fused tensor as `hf_parts` names them."""
  for leaf_path, array in leaves:
    name, transposed = hf_key(leaf_path, cfg)
    if "{e}" in name:
      yield from ((name.format(e=e), np.ascontiguousarray(array[e].T)) for e in range(array.shape[0]))
    else:
      yield name, np.ascontiguousarray(array.T if transposed else array)


def _fp8_weight(name: str, array: np.ndarray) -> bool:
  """Whether DeepSeek's published FP8 format quantises the tensor `name`: the blocks' Linear weights, not the
  routers (`mlp.gate`, HunYuan's `mlp.gate.wg`), norms, embeddings, head or the MTP modules' eh_proj."""
  return (
    array.ndim == 2
    and name.startswith("model.layers.")
    and name.endswith(".weight")
    and not name.endswith((".gate.weight", ".gate.wg.weight", "eh_proj.weight"))
  )


def _quantized(tensors, fp8_blocks: tuple[int, int] | None):
  """(name, array) of `tensors` as written: with fp8_blocks each FP8 weight (`_fp8_weight`) followed by its
  weight_scale_inv (`hf_files.fp8_quantize`), the rest unchanged."""
  for name, array in tensors:
    if fp8_blocks is None or not _fp8_weight(name, array):
      yield name, array
    else:
      q, scale_inv = hf_files.fp8_quantize(array.astype(np.float32), fp8_blocks)
      yield name, q
      yield name + hf_files.FP8_SUFFIX, scale_inv


def _hf_config(model: Decoder, fp8_blocks: tuple[int, int] | None) -> dict:
  """config.json's dict, with fp8_blocks its quantization_config; made before anything is written, as it refuses
  what config.json cannot say and a block size `from_hf` would not read back."""
  config = hf_config.to_hf_config(model.cfg, model.moe_cfg)
  if fp8_blocks is not None:
    config["quantization_config"] = {
      "quant_method": "fp8",
      "fmt": "e4m3",
      "weight_block_size": list(fp8_blocks),
      "activation_scheme": "dynamic",
    }
    hf_files.quantization(config)  # refuses a block size it would not read back
  return config


def _write_shards(tensors, out_dir: str, shard_bytes: int, writer: bool) -> tuple[dict, int]:
  """(weight_map: each tensor's file, part-0000i.safetensors, and the total bytes) of (name, host array) `tensors`,
  each file written as soon as the next tensor would pass shard_bytes, so that the host holds about one shard.
  Every process gathers the tensors (the gathers are collective); only the writer writes."""
  weight_map, shard, size, total = {}, {}, 0, 0

  def flush():
    file = f"part-{len(set(weight_map.values())):05d}.safetensors"
    if writer:
      save_file(shard, os.path.join(out_dir, file), metadata={"format": "pt"})
    weight_map.update({name: file for name in shard})

  for name, array in tensors:
    if shard and size + array.nbytes > shard_bytes:
      flush()
      shard, size = {}, 0
    shard[name], size, total = array, size + array.nbytes, total + array.nbytes
  flush()
  return weight_map, total


def _finalize_files(out_dir: str, weight_map: dict, total: int, config: dict) -> None:
  """Renames the parts to the hub's names, known only once their number is (one: model.safetensors), readable as the
  user's umask allows, then writes the index (several files) and config.json."""
  parts = sorted(set(weight_map.values()))
  final = {
    part: "model.safetensors" if len(parts) == 1 else f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
    for i, part in enumerate(parts)
  }
  umask = os.umask(0)
  os.umask(umask)
  for part, file in final.items():
    os.replace(os.path.join(out_dir, part), os.path.join(out_dir, file))
    os.chmod(os.path.join(out_dir, file), 0o666 & ~umask)  # safetensors writes 0600; the user's umask decides here
  if len(parts) > 1:
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump(
        {
          "metadata": {"total_size": total},
          "weight_map": {name: final[part] for name, part in sorted(weight_map.items())},
        },
        f,
        indent=2,
      )
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)


def to_hf(
  model: Decoder, out_dir: str, shard_bytes: int = SHARD_BYTES, fp8_blocks: tuple[int, int] | None = None
) -> None:
  """Writes `model` as a Hugging Face checkpoint: config.json, model-0000i-of-0000n.safetensors (at most
  shard_bytes each, in the model's order; one model.safetensors if it fits) and model.safetensors.index.json.
  One part of the model is gathered to the host at a time and each file written when full, so the host holds
  about a block and a shard. Experts in their logical order: a placed model's experts (`from_hf(..., placement=)`,
  `with_placement`: its `expert_order`), their router columns and balancing biases are put back in the
  checkpoint's order; a slot table's replicas are not written. Tensors in the parameters' dtype, or with
  fp8_blocks=(rows, columns) (DeepSeek's (128, 128)) the blocks' Linear weights in DeepSeek's published FP8
  format (float8_e4m3fn with a float32 weight_scale_inv per block, amax / 448; config.json's quantization_config),
  as `from_hf` and transformers read it."""
  config = _hf_config(model, fp8_blocks)  # refuses what config.json cannot say, before writing
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(out_dir, exist_ok=True)
  family = families.get(hf_config.exported(model.cfg).family)
  tensors = itertools.chain(_host_tensors(model), family.unread_tensors(model.cfg, model.moe_cfg))
  weight_map, total = _write_shards(_quantized(tensors, fp8_blocks), out_dir, shard_bytes, writer)
  if writer:
    _finalize_files(out_dir, weight_map, total, config)
