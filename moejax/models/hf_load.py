"""Hugging Face checkpoints in: `from_hf` (a local directory's config.json and safetensors shards, read lazily, each
tensor placed straight into its shards on the mesh, refused naming the tensor where it differs from the config) and
`load_state` (the same state without the model, for a trainer's `init_from`). The names are `hf_checkpoint`'s.
"""

import dataclasses
import json
import os
import re

import jax
import numpy as np
from absl import logging
from flax import nnx

from moejax.cost import expert_backend
from moejax.models import families, hf_checkpoint, hf_config, hf_files, hf_parts
from moejax.models import state as state_lib
from moejax.models.decoder import Decoder
from moejax.models.decoder_config import DecoderConfig
from moejax.models.placed import with_placement
from moejax.moe.config import MoEConfig
from moejax.placement import apply as placement_lib
from moejax.validation import ConfigError, is_int, require

READABLE_DTYPES = ("F32", "BF16", "F16")
# State leaves read from a checkpoint (the rest start as the model builds them): DeepSeek-V3's balancing bias and
# DeepSeek-V4's token id table (tid2eid), the one integer tensor read (int64 or int32).
LOADED_STATE = {"expert_bias": READABLE_DTYPES, "hash_table": ("I64", "I32")}


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


def _expected(abstract: dict, cfg: DecoderConfig, num_experts: int) -> dict:
  """HF name -> (path, HF shape, transposed, expert or None) for every parameter and state leaf loaded (a scanned
  segment's leaf [repeats, ...]: each of its layers' tensors)."""
  expected = {}
  for path, leaf in abstract:
    names, transposed = hf_checkpoint.layer_keys(path, cfg)
    shape = tuple(leaf.shape)[1:] if path[0] == "segments" else tuple(leaf.shape)  # one layer's
    for name in names:
      if "{e}" in name:
        for e in range(num_experts):
          expected[name.format(e=e)] = (path, shape[1:][::-1], True, e)
      else:
        expected[name] = (path, shape[::-1] if transposed else shape, transposed, None)
  return expected


def _check(shards: hf_files.Shards, expected: dict, directory: str, ignored: tuple = ()) -> None:
  """Refuses a checkpoint whose tensors are not exactly the expected ones (but those matching `ignored`, regexes
  of tensors the family's transformers class ignores too), naming the tensor."""
  stored = {hf_parts.split_part(n)[0] for n in expected}  # a tensor's parts (`hf_parts`): the tensor
  skip = lambda n: any(re.search(pattern, n) for pattern in (r"rotary_emb\.inv_freq$", *ignored))
  extra = sorted(n for n in shards.names if n not in stored and not skip(n))
  missing = sorted(n for n in stored if n not in shards.names)
  if missing or extra:
    raise ConfigError(
      f"checkpoint {directory}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
      f"unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''} for its config.json"
    )
  for name, (path, shape, _, _) in expected.items():
    tensor = shards.tensor(name)
    if tuple(tensor.get_shape()) != shape:
      raise ConfigError(f"checkpoint tensor {name} has shape {tuple(tensor.get_shape())}, expected {shape}")
    stored = tensor.tensor if isinstance(tensor, hf_parts.VIEWS) else tensor
    readable = LOADED_STATE.get(path[-1], READABLE_DTYPES)
    if tensor.get_dtype() not in readable and not isinstance(stored, hf_files.QUANTISED):
      raise ConfigError(f"checkpoint tensor {name} has dtype {tensor.get_dtype()}, expected one of {readable}")


def _load_leaf(shards: hf_files.Shards, names: list[str], leaf, transposed: bool, expert: bool, stacked: bool):
  """One array placed on the mesh by its sharding, each device's block read from the files on its own (a scanned
  segment's leaf [repeats, ...]: the block's layers, each from its own tensors)."""
  shape = leaf.shape[1:] if stacked else leaf.shape  # one layer's

  def block(name, index):
    if expert:  # [E, in, out]: read only this block's experts
      experts = range(*index[0].indices(shape[0]))
      return np.stack([np.asarray(shards.tensor(name.format(e=e))[index[2], index[1]]).T for e in experts])
    if transposed:
      return np.asarray(shards.tensor(name)[index[1], index[0]]).T
    return np.asarray(shards.tensor(name)[index])

  def read(index):
    index = tuple(index) + (slice(None),) * (len(leaf.shape) - len(index))  # one slice per dimension
    if not stacked:
      return block(names[0], index)
    return np.stack([block(names[r], index[1:]) for r in range(*index[0].indices(leaf.shape[0]))])

  return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: read(index).astype(leaf.dtype))


def has_mtp(shards: hf_files.Shards, cfg: DecoderConfig) -> bool:
  """Whether the checkpoint holds tensors of DeepSeek-V3's MTP layers (model.layers.{num_layers + k}.*);
  transformers' save_pretrained writes none, whatever num_nextn_predict_layers says."""
  return any(
    name.startswith(f"model.layers.{cfg.num_layers + k}.") for name in shards.names for k in range(cfg.num_mtp_layers)
  )


def _initial(cfg: DecoderConfig, moe_cfg: MoEConfig, mesh, seed: int, abstract: dict, key: str) -> dict:
  """The model's initial parameters under `key` (placed as `abstract`), one compiled program computing only them."""
  build = lambda: nnx.to_pure_dict(nnx.split(state_lib.build(cfg, moe_cfg, mesh, seed), nnx.Param, ...)[1])[key]
  return jax.jit(build, out_shardings=jax.tree.map(lambda a: a.sharding, abstract))()


def load_state(path: str, cfg: DecoderConfig, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, seed: int = 0):
  """(graphdef, params, rest) of the decoder (cfg, moe_cfg) on `mesh` with the checkpoint's tensors, placed as
  `state_lib.abstract_state` places them (as the Trainer's state): every tensor checked against the config before
  any is read, each device reading its own block; rest (the key streams, seed `seed`) holds the checkpoint's
  balancing biases. MTP modules (cfg.num_mtp_layers) that the checkpoint holds no tensors of (transformers writes
  none) keep their initialisation, said in the log."""
  graphdef, params, rest = state_lib.abstract_state(cfg, moe_cfg, mesh, seed)
  loaded_rest = [(p, leaf) for p, leaf in hf_checkpoint.tree_leaves(rest) if p[-1] in LOADED_STATE]
  shards = hf_files.Shards(path)
  try:
    fresh_mtp = cfg.num_mtp_layers > 0 and not has_mtp(shards, cfg)
    if fresh_mtp:  # a checkpoint saved by transformers: its MTP modules start from their initialisation
      logging.info(
        "checkpoint %s holds no MTP tensors (model.layers.%d.*): its %d MTP module(s) start from their initialisation",
        path,
        cfg.num_layers,
        cfg.num_mtp_layers,
      )
    leaves = [
      (p, leaf)
      for p, leaf in list(hf_checkpoint.tree_leaves(params)) + loaded_rest
      if not (fresh_mtp and p[0] == "mtp")
    ]
    expected = _expected(leaves, cfg, moe_cfg.num_experts)
    _check(shards, expected, path, families.get(cfg.family).ignored_tensors(moe_cfg))
    leaves = {p: leaf for p, leaf in list(hf_checkpoint.tree_leaves(params)) + loaded_rest}
    arrays = {}
    for leaf_path, _, transposed, expert in expected.values():
      if leaf_path not in arrays:
        arrays[leaf_path] = _load_leaf(
          shards,
          hf_checkpoint.layer_keys(leaf_path, cfg)[0],
          leaves[leaf_path],
          transposed,
          expert is not None,
          leaf_path[0] == "segments",
        )
  finally:
    shards.close()
  rest = state_lib.init_state(cfg, moe_cfg, mesh, seed, only_rest=True)  # params: the abstract tree, filled in
  if fresh_mtp:
    params["mtp"] = _initial(cfg, moe_cfg, mesh, seed, params["mtp"], "mtp")
  for leaf_path, array in arrays.items():
    _set(params if leaf_path[-1] not in LOADED_STATE else rest, leaf_path, array)
  return graphdef, params, rest


def from_hf(
  path: str,
  mesh: jax.sharding.Mesh,
  dtype: str = "float32",
  moe: dict | None = None,
  param_dtype: str = "float32",
  placement=None,
  model: dict | None = None,
  tokens: int | None = None,
) -> Decoder:
  """The decoder of a local Hugging Face checkpoint directory on `mesh`: config.json read (`hf_config`), then every
  tensor read lazily from the safetensors shards into its shards on the mesh (experts split over the
  expert-parallel devices: each reads its own experts). dtype: the compute dtype; param_dtype: the parameters';
  moe: MoEConfig fields over the checkpoint's (transport, schedule, dedup, ...); model: DecoderConfig fields (fsdp,
  remat, tensor_parallel, grad_sync, scan_layers: how the model is laid out and trained, not what it computes). A
  checkpoint whose tensors differ from its config (missing, unexpected, wrong shape or dtype, unreadable file) is
  refused, naming the tensor; a quantised one is read dequantised (`hf_files`: DeepSeek's FP8 blocks, gpt-oss's
  MXFP4 experts). A config.json naming MTP layers (num_nextn_predict_layers) whose checkpoint holds none of their
  tensors (transformers' save_pretrained writes none) loads without them (num_mtp_layers 0), said in the log.
  placement: an expert placement (a `moejax.placement.Placement` or [M, E] flat devices over the M MoE layers),
  checked before anything is read, then applied to the loaded model (`moejax.models.placed.with_placement`: expert e
  of MoE layer j on device placement[j, e], router columns and balancing bias with it, outputs unchanged) and
  recorded on it (`expert_order`), so `to_hf` writes the experts back in the checkpoint's order.
  tokens: the tokens one forward call sees, for moe={'expert_backend': 'auto'} (`moejax.cost.expert_backend`)."""
  config_path = os.path.join(path, "config.json")
  if not os.path.exists(config_path):
    raise ConfigError(f"{path}: no config.json (from_hf reads a local checkpoint directory)")
  with open(config_path) as f:
    cfg, moe_cfg = hf_config.from_hf_config(json.load(f), dtype=dtype, param_dtype=param_dtype, moe=moe, model=model)
  # 'auto' is measured at a per-device shape, which needs the tokens per call; other backends come back unchanged
  auto = moe_cfg.backend_kind.needs_resolving
  require(
    not auto or is_int(tokens), "tokens", tokens, "the tokens one forward call sees, with moe.expert_backend='auto'"
  )
  moe_cfg = expert_backend.resolve(moe_cfg, tokens, mesh, "fwd")
  if cfg.num_mtp_layers:  # inference without the MTP modules a checkpoint does not hold
    shards = hf_files.Shards(path)
    if not has_mtp(shards, cfg):
      logging.info(
        "checkpoint %s holds no MTP tensors (model.layers.%d.*): loaded without its MTP modules", path, cfg.num_layers
      )
      cfg = dataclasses.replace(cfg, num_mtp_layers=0)
    shards.close()
  if placement is not None:  # refused before reading: a group split, a slot table, a wrong shape
    placement_lib.check_placement(placement, moe_cfg, cfg.num_moe_layers)
  decoder = nnx.merge(*load_state(path, cfg, moe_cfg, mesh))
  return decoder if placement is None else with_placement(decoder, placement)
