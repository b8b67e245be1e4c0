"""Expert placement of the decoder families' checkpoints (DeepSeek-V3: group-limited routing, balancing bias, a
shared expert; Qwen2-MoE: a gated shared expert): `from_hf(..., placement=)` against the fixtures' reference
logits and greedy tokens, each expert's weights found in its device's shard, `to_hf` writing the checkpoint back
bit for bit, and the placements that would split a group refused. Also a SMILE model's bias and shared experts."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import moejax.infer
import moejax.models
from moejax.infer import decode
from moejax.models import hf_config, layers
from moejax.models import state as state_lib
from moejax.models.config import ModelConfig, moe_block_indices
from moejax.moe import reference
from moejax.moe.config import MoEConfig
from moejax.placement import apply as apply_lib
from moejax.placement.affinity import affinity_counts
from moejax.placement.solve import solve
from moejax.validation import ConfigError
from tests.helpers import relative_error

HF = Path(__file__).parent / "data" / "hf"
TILE = 4  # the fixtures' batch of 2, tiled onto the 8 devices
DEVICES = 8
FAMILIES = ("deepseek_v3", "qwen2_moe")
EXPERT_TENSORS = {"w_in": "up_proj", "w_out": "down_proj", "w_gate": "gate_proj"}


def _configs(family):
  with open(HF / family / "config.json") as f:
    return hf_config.from_hf_config(json.load(f))


def _moe_layers(tensors) -> list[int]:
  """The checkpoint's layers with routed experts, read from its tensor names."""
  return sorted({int(n.split(".")[2]) for n in tensors if ".mlp.experts.0.up_proj." in n})


def _group_preserving(rng, layers, experts, groups):
  """[M, E] flat devices: every group's experts onto a random group's aligned block of devices, spread over
  them in a random order (groups of E / groups experts, each block of devices holding exactly one group)."""
  per_group, per_device = experts // groups, experts // DEVICES
  place = np.empty((layers, experts), np.int64)
  for j in range(layers):
    blocks = rng.permutation(groups)
    for g in range(groups):
      slots = blocks[g] * per_group + rng.permutation(per_group)
      place[j, g * per_group : (g + 1) * per_group] = slots // per_device
  return place


def _placement(family, seed=0):
  cfg, moe = _configs(family)
  rng = np.random.default_rng(seed)
  if moe.num_groups is not None:
    return _group_preserving(rng, cfg.num_moe_layers, moe.num_experts, moe.num_groups)
  per_device = moe.num_experts // DEVICES
  return np.stack([rng.permutation(np.arange(moe.num_experts) // per_device) for _ in range(cfg.num_moe_layers)])


@pytest.fixture(scope="module")
def placed(mesh_2x4):
  """family -> (placement, the checkpoint loaded with it)."""
  out = {}
  for family in FAMILIES:
    placement = _placement(family)
    out[family] = placement, moejax.models.from_hf(str(HF / family), mesh_2x4, placement=placement)
  return out


def _check_layout(model, tensors, order, mesh):
  """Index i of every placed MoE layer holds the checkpoint's expert order[j][i]: each device's shard of the
  expert weights holds those experts' tensors, and the router columns and biases follow them."""
  flat = {device.id: k for k, device in enumerate(mesh.devices.flat)}
  for j, (block, layer) in enumerate(zip(moe_block_indices(model.cfg), _moe_layers(tensors))):
    moe = layers.layer_module(model, block).ffn.moe
    prefix = f"model.layers.{layer}.mlp"
    for name, hf_name in EXPERT_TENSORS.items():
      weights = getattr(moe, name)[...]
      held = set()
      for shard in weights.addressable_shards:
        rows = range(*shard.index[0].indices(weights.shape[0]))
        assert len(rows) == weights.shape[0] // DEVICES  # expert-parallel: the shard is this device's experts
        for row, data in zip(rows, np.asarray(shard.data)):
          expert = order[j][row]
          assert row // len(rows) == flat[shard.device.id]
          np.testing.assert_array_equal(data, tensors[f"{prefix}.experts.{expert}.{hf_name}.weight"].T)
          held.add(row)
      assert held == set(range(weights.shape[0]))
    router = np.asarray(moe.router.kernel[...])
    np.testing.assert_array_equal(router, tensors[f"{prefix}.gate.weight"].T[:, list(order[j])])
    if moe.expert_bias is not None:
      bias = np.asarray(moe.expert_bias[...])
      np.testing.assert_array_equal(bias, tensors[f"{prefix}.gate.e_score_correction_bias"][list(order[j])])
    assert moe.shared is not None
    np.testing.assert_array_equal(
      np.asarray(moe.shared.w_in[...]),
      tensors[f"{prefix}.{'shared_expert' if moe.shared_gate else 'shared_experts'}.up_proj.weight"].T,
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.sampled(1)
def test_placed_checkpoint_keeps_the_logits_and_puts_experts_on_their_devices(family, placed, mesh_2x4):
  placement, model = placed[family]
  tensors = load_file(HF / family / "model.safetensors")
  ref = np.load(HF / family / "reference.npz")
  order = model.expert_order
  np.testing.assert_array_equal(np.asarray(order), apply_lib.expert_order(placement))
  per_device = placement.shape[1] // DEVICES
  for j, row in enumerate(order):  # index i on device i // per_device, the device the placement gave its expert
    assert [placement[j, e] for e in row] == [i // per_device for i in range(len(row))]
  assert np.any(placement != np.arange(placement.shape[1]) // per_device, axis=1).all()  # every layer moved
  _check_layout(model, tensors, order, mesh_2x4)
  if family == "deepseek_v3":  # the bias matters here: the placed bias is no longer the checkpoint's order
    bias = tensors[f"model.layers.{_moe_layers(tensors)[0]}.mlp.gate.e_score_correction_bias"]
    assert not np.array_equal(np.asarray(layers.layer_module(model, 1).ffn.moe.expert_bias[...]), bias)
  logits, _ = model(np.tile(ref["tokens"], (TILE, 1)))
  logits = np.asarray(logits)
  for copy in range(TILE):
    assert relative_error(logits[2 * copy : 2 * copy + 2], ref["logits"]) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_placed_checkpoint_is_written_back_bit_for_bit(family, placed, tmp_path, mesh_2x4):
  placement, model = placed[family]
  want = load_file(HF / family / "model.safetensors")
  moejax.models.to_hf(model, str(tmp_path / "once"))
  got = load_file(tmp_path / "once" / "model.safetensors")
  assert sorted(got) == sorted(want)
  for name in want:
    assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
  if family == "deepseek_v3":
    assert any(name.endswith("e_score_correction_bias") for name in want)
  # Placed again: the orders compose, and the checkpoint is still the same.
  again = _placement(family, seed=1)
  twice = decode.with_placement(model, again)
  composed = np.take_along_axis(np.asarray(model.expert_order), apply_lib.expert_order(again), axis=1)
  np.testing.assert_array_equal(np.asarray(twice.expert_order), composed)
  assert not np.array_equal(composed, np.asarray(model.expert_order))
  _check_layout(twice, want, twice.expert_order, mesh_2x4)
  moejax.models.to_hf(twice, str(tmp_path / "twice"))
  got = load_file(tmp_path / "twice" / "model.safetensors")
  assert all(np.array_equal(got[name], want[name]) for name in want)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_placed_checkpoint_generates_the_greedy_tokens(family, placed):
  _, model = placed[family]
  ref = np.load(HF / family / "reference.npz")
  tokens = moejax.infer.generate_tokens(model, ref["prompt"], 8, mode="exflow")
  np.testing.assert_array_equal(tokens, ref["greedy"])


def _split_group(family):
  """A balanced placement that keeps every group but moves expert 5 (group 1) of MoE layer 1 to group 2's block
  and expert 8 (group 2) to group 1's, on the devices' contiguous layout."""
  cfg, moe = _configs(family)
  placement = np.tile(np.arange(moe.num_experts) // (moe.num_experts // DEVICES), (cfg.num_moe_layers, 1))
  placement[1, [5, 8]] = placement[1, [8, 5]]
  return placement


def test_a_placement_splitting_a_group_is_refused(mesh_2x4):
  family = "deepseek_v3"
  cfg, moe = _configs(family)
  assert (moe.num_experts, moe.num_groups, moe.topk_groups) == (16, 4, 2)
  split = _split_group(family)
  with pytest.raises(ConfigError, match="expert 5 of MoE layer 1 from group 1 to the block of group 2") as err:
    moejax.models.from_hf(str(HF / family), mesh_2x4, placement=split)
  assert err.value.field == "placement" and err.value.value == (1, 5, 2) and "topk_groups=2" in str(err.value)
  model = moejax.models.from_hf(str(HF / family), mesh_2x4)
  with pytest.raises(ConfigError, match="expert 5 of MoE layer 1 from group 1"):
    decode.with_placement(model, split)
  assert not hasattr(model, "expert_order")
  # Why: the same relabelling done anyway changes which experts the tokens reach; a group-preserving one does not.
  tensors = load_file(HF / family / "model.safetensors")
  layer = _moe_layers(tensors)[1]
  prefix = f"model.layers.{layer}.mlp"
  params = {
    "router": {"kernel": tensors[f"{prefix}.gate.weight"].T},
    **{
      name: np.stack([tensors[f"{prefix}.experts.{e}.{hf}.weight"].T for e in range(16)])
      for name, hf in EXPERT_TENSORS.items()
    },
  }
  bias = tensors[f"{prefix}.gate.e_score_correction_bias"]
  routed = dataclasses.replace(moe, num_shared_experts=0, shared_d_ff=None, balance_loss="batch")
  layer_fn = jax.jit(lambda p, b, x: reference.moe_reference(p, x, routed, expert_bias=b)[0])
  x = np.random.default_rng(5).normal(size=(256, moe.d_model)).astype(np.float32)
  y = np.asarray(layer_fn(params, bias, x))

  def relabelled(order):
    return {
      "router": {"kernel": params["router"]["kernel"][:, order]},
      **{name: params[name][order] for name in EXPERT_TENSORS},
    }, bias[order]

  split_order = apply_lib.expert_order(split)[1]
  assert relative_error(layer_fn(*relabelled(split_order), x), y) > 1e-2
  kept_order = apply_lib.expert_order(_placement(family))[1]
  assert relative_error(layer_fn(*relabelled(kept_order), x), y) < 1e-5
  assert np.abs(y).max() > 1e-2


def test_group_limit_off_when_every_group_is_kept():
  """topk_groups = num_groups masks nothing: any placement keeps the outputs, so none is refused."""
  cfg, moe = _configs("deepseek_v3")
  all_groups = dataclasses.replace(moe, topk_groups=moe.num_groups)
  apply_lib.check_placement(_split_group("deepseek_v3"), all_groups, cfg.num_moe_layers)
  with pytest.raises(ConfigError):
    apply_lib.check_placement(_split_group("deepseek_v3"), moe, cfg.num_moe_layers)


def test_solve_finds_group_preserving_placements():
  """solve(counts, nodes=num_groups, gpus_per_node=D // num_groups, routing='node_limited'): its 'nodes' are the
  groups' blocks of devices, so its placements keep every group together, which a free solve does not."""
  cfg, moe = _configs("deepseek_v3")
  groups, experts = moe.num_groups, moe.num_experts
  rng = np.random.default_rng(11)
  traces = np.empty((cfg.num_moe_layers, 2000), np.int64)
  traces[0] = rng.integers(0, experts, 2000)
  traces[1] = (traces[0] + 2) % experts  # half of each group continues in the next group
  counts = affinity_counts(traces, experts)
  kept = solve(counts, groups, DEVICES // groups, time_limit_s=5, routing="node_limited")
  order = apply_lib.check_placement(kept, moe, cfg.num_moe_layers)
  assert np.all(
    order.reshape(-1, groups, experts // groups) // (experts // groups)
    == order.reshape(-1, groups, experts // groups)[..., :1] // (experts // groups)
  )
  free = solve(counts, groups, DEVICES // groups, time_limit_s=5)
  assert free.cross_gpu < kept.cross_gpu
  with pytest.raises(ConfigError, match="group"):
    apply_lib.check_placement(free, moe, cfg.num_moe_layers)


def test_a_model_with_a_slot_table_is_refused(mesh_2x4):
  path = str(HF / "qwen2_moe")
  with pytest.raises(ConfigError, match="slot table") as err:
    moejax.models.from_hf(path, mesh_2x4, moe={"slots_per_device": 2}, placement=_placement("qwen2_moe"))
  assert err.value.field == "slots_per_device"
  model = moejax.models.from_hf(path, mesh_2x4, moe={"slots_per_device": 2})
  with pytest.raises(ConfigError, match="replicas"):
    decode.with_placement(model, _placement("qwen2_moe"))


@pytest.mark.slow
def test_smile_model_placement_moves_the_bias_and_keeps_the_shared_experts(mesh_2x4):
  """A SMILE model with DeepSeek-class MoE layers (groups, bias, gated shared expert): experts, router columns and
  bias move together, the shared experts stay, the orders compose, and the outputs are unchanged."""
  cfg = ModelConfig(
    kind="gpt",
    vocab_size=64,
    num_layers=4,
    d_model=16,
    num_heads=2,
    d_ff=32,
    max_len=16,
    dropout=0.0,
    embed_init_std=0.5,
  )
  moe = MoEConfig(
    num_experts=16,
    top_k=2,
    d_model=16,
    d_ff=32,
    gated=True,
    score="sigmoid",
    num_groups=4,
    topk_groups=2,
    bias_update_rate=1e-3,
    num_shared_experts=1,
    shared_gate=True,
  )
  graphdef, _, _ = state_lib.abstract_state(cfg, moe, mesh_2x4, 3)
  params, rest = state_lib.init_state(cfg, moe, mesh_2x4, 3)
  rng = np.random.default_rng(3)
  biases = rng.normal(scale=0.3, size=(cfg.num_moe_layers, 16)).astype(np.float32)
  model = nnx.merge(graphdef, params, state_lib.with_expert_biases(cfg, rest, biases))
  first, second = (_group_preserving(rng, cfg.num_moe_layers, 16, 4) for _ in range(2))
  placed = decode.with_placement(model, first)
  twice = decode.with_placement(placed, second)
  order = np.take_along_axis(apply_lib.expert_order(first), apply_lib.expert_order(second), axis=1)
  np.testing.assert_array_equal(np.asarray(twice.expert_order), order)
  for j, block in enumerate(moe_block_indices(cfg)):
    old, new = layers.layer_module(model, block).ffn.moe, layers.layer_module(twice, block).ffn.moe
    np.testing.assert_array_equal(np.asarray(new.w_gate[...]), np.asarray(old.w_gate[...])[order[j]])
    np.testing.assert_array_equal(np.asarray(new.router.kernel[...]), np.asarray(old.router.kernel[...])[:, order[j]])
    np.testing.assert_array_equal(np.asarray(new.expert_bias[...]), biases[j][order[j]])
    np.testing.assert_array_equal(np.asarray(new.shared.w_in[...]), np.asarray(old.shared.w_in[...]))
    np.testing.assert_array_equal(np.asarray(new.shared_gate.kernel[...]), np.asarray(old.shared_gate.kernel[...]))
  tokens = np.random.default_rng(4).integers(0, 64, (8, 12))
  forward = jax.jit(lambda p, r, t: nnx.merge(graphdef, p, r)(t)[0])  # one graph for all three
  state = lambda m: tuple(nnx.to_pure_dict(s) for s in nnx.split(m, nnx.Param, ...)[1:])
  want = np.asarray(forward(*state(model), tokens))
  assert relative_error(forward(*state(twice), tokens), want) < 1e-5
  # Control: the bias left in the checkpoint's order (experts moved without it) changes the outputs.
  twice_params, twice_rest = state(twice)
  stale = state_lib.with_expert_biases(cfg, twice_rest, biases)
  assert relative_error(forward(twice_params, stale, tokens), want) > 1e-3
