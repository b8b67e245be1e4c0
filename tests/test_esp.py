"""Parm's expert-sharding schedules equal the single-device reference, and move what the paper says they move."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.cost import parm
from moejax.moe import esp_ops
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.reference import moe_reference
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError
from tests import helpers
from tests.helpers import normal, random_params

SCHEDULES = parm.ESP_SCHEDULES


def _matches(cfg, mesh, schedule, params, x, reference, grads=True):
  """The layer under `schedule` equals `reference` (a `helpers.reference_run` with the schedule's capacity
  groups)."""
  return helpers.assert_matches_reference(
    dataclasses.replace(cfg, esp_schedule=schedule), mesh, params, x, reference=reference, grads=grads
  )


def _groups(schedule, n, m):
  """Capacity groups of a schedule (esp module docstring): S1 gates per GPU, the others per node."""
  return n * m if schedule == "s1" else n


# Per mesh: routing, activation, gating, expert backend and forced routing (None = random; the 4x2 case
# sends both choices of every token to the two experts of the last node). The 2x4 mesh is covered, with
# drops, by test_drops_follow_each_schedules_dispatch_groups.
CASES = [
  pytest.param(2, 2, "bilevel", "silu", False, "dense", None, id="2x2-bilevel"),
  pytest.param(4, 2, "topk", "relu", True, "ragged_dot", [6, 7], id="4x2-topk-one-node"),
]


@pytest.mark.parametrize("n,m,routing,activation,gated,backend,forced", CASES)
@pytest.mark.slow
def test_schedules_match_reference_without_drops(n, m, routing, activation, gated, backend, forced):
  num_experts, k = 2 * n, 2
  # (Not renormalising bilevel weights: with one node per token that cancels the node probability, and
  # the node router's gradient would be float noise.)
  # capacity_factor E / k: every capacity >= its group's tokens, so no schedule drops anything and all
  # schedules equal one reference.
  cfg = MoEConfig(
    num_experts=num_experts,
    top_k=k,
    d_model=8,
    d_ff=4 * m,
    routing=routing,
    num_nodes=n,
    collective="capacity",
    capacity_factor=num_experts / k,
    expert_backend=backend,
    activation=activation,
    gated=gated,
    renormalize=routing == "topk",
    z_loss_coef=1e-3,
  )
  params = helpers.random_params(cfg, 10 * n + m)
  x = helpers.normal(10 * n + m + 1, (n * m * 8, 8))
  if forced:
    params, x = helpers.force_routing(params, x, forced)
  reference = helpers.reference_run(cfg, params, x, dispatch_groups=1)
  for schedule in SCHEDULES:
    _, aux = _matches(cfg, mesh_lib.make_mesh(n, m), schedule, params, x, reference)
    assert int(aux["tokens_dropped"]) == 0
    if forced:
      counts = np.asarray(aux["expert_counts"])
      assert set(np.flatnonzero(counts)) == set(forced) and counts.sum() == x.shape[0] * k


@pytest.mark.slow
def test_drops_follow_each_schedules_dispatch_groups(mesh_2x4):
  """Every token to expert 2 (node 1), with drops. The baseline and S2 keep the node-group set
  (reference dispatch_groups=n), S1 the per-GPU set (dispatch_groups=n*m), and these differ. capacity_factor 1.1
  gives a capacity of 9 per node, which S2 pads to 12 slots for its split over 4 GPUs, and 3 per GPU in S1."""
  cfg = MoEConfig(num_experts=4, top_k=1, d_model=8, d_ff=8, collective="capacity", capacity_factor=1.1)
  params, x = helpers.force_routing(helpers.random_params(cfg, 7), helpers.normal(8, (64, 8)), [2])
  references = {groups: helpers.reference_run(cfg, params, x, groups) for groups in (2, 8)}
  results = {s: _matches(cfg, mesh_2x4, s, params, x, references[_groups(s, 2, 4)]) for s in SCHEDULES}
  assert int(results["s2"][1]["tokens_dropped"]) == 64 - 2 * 9
  assert int(results["s1"][1]["tokens_dropped"]) == 64 - 8 * 3
  assert helpers.relative_error(results["baseline"][0], results["s2"][0]) < 1e-6  # the same tokens kept
  assert helpers.relative_error(results["s1"][0], results["s2"][0]) > 0.1  # different tokens kept

  gpu = np.arange(8) % 4
  for schedule, (_, aux) in results.items():
    traffic = np.asarray(aux["traffic_rows"])[0]  # [source, destination] flat devices
    assert traffic[:, :4].sum() == 0  # nothing is sent to node 0's GPUs
    if schedule == "baseline":  # EP all-to-all over 'node' of the m gathered copies, to the sender's GPU index
      assert traffic[gpu[:, None] != gpu[None, :]].sum() == 0 and traffic.sum() == 4 * 2 * 9 * 4
    else:  # Dump: every GPU of node 1 receives each kept row
      assert (traffic[:, 4:] == traffic[:, 4:5]).all() and traffic.sum() == 4 * (64 - aux["tokens_dropped"])


def test_dropless_schedules_match_reference():
  """collective='padded' (the ragged exchange's CPU form), no capacity: every schedule is the reference
  (gradients compared for S2, whose split and all-gather act on the token-choice rows; the exchange's
  own gradient is the layer's, tested in test_layer)."""
  n, m = 2, 2
  cfg = MoEConfig(
    num_experts=4, top_k=2, d_model=8, d_ff=8, collective="padded", gated=True, activation="silu", z_loss_coef=1e-3
  )
  params = helpers.random_params(cfg, 21)
  x = helpers.normal(22, (n * m * 6, 8))
  reference = helpers.reference_run(cfg, params, x, dispatch_groups=1)
  for schedule in SCHEDULES:
    _, aux = _matches(cfg, mesh_lib.make_mesh(n, m), schedule, params, x, reference, grads=schedule == "s2")
    assert int(aux["tokens_dropped"]) == 0 == int(aux["tokens_overflowed"])


@pytest.mark.parametrize("schedule", ["baseline", "s2"])  # S1 shares S2's fused exchange
def test_dropless_overflow_outputs_zero_and_is_counted(mesh_2x4, schedule):
  """Every token to expert 3 with receive buffers of ceil(0.5 x rows sent): a token either gets its
  reference output or, overflowed, exactly zero; each overflowed token is counted once and the counts
  hold what the experts processed."""
  cfg = MoEConfig(num_experts=4, top_k=1, d_model=8, d_ff=8, collective="padded", buffer_factor=0.5)
  params, x = helpers.force_routing(helpers.random_params(cfg, 23), helpers.normal(24, (64, 8)), [3])
  y, aux = jax.jit(lambda p, x: moe_apply(p, x, dataclasses.replace(cfg, esp_schedule=schedule), mesh_2x4))(params, x)
  zero = helpers.zero_or_reference_rows(cfg, params, x, y)
  overflowed = int(aux["tokens_overflowed"])
  assert overflowed == zero.sum() > 0
  assert int(aux["expert_counts"][3]) == 64 - overflowed and int(aux["tokens_dropped"]) == 0


def test_router_jitter_is_split_with_the_tokens(mesh_2x4):
  """S1 splits the router's noisy input with the tokens; the draw is the layer's (`moe_apply`)."""
  cfg = MoEConfig(num_experts=4, top_k=1, d_model=8, d_ff=8, collective="capacity", capacity_factor=4.0, jitter=0.5)
  params = helpers.random_params(cfg, 13)
  x = helpers.normal(14, (64, 8))
  rng = jax.random.key(15)
  y, _ = moe_apply(params, x, dataclasses.replace(cfg, esp_schedule="s1"), mesh_2x4, rng=rng, train=True)
  reference = jax.jit(lambda noise: moe_reference(params, x, cfg, noise=noise)[0])
  noise = jax.random.uniform(rng, x.shape, jnp.float32, 0.5, 1.5)
  assert helpers.relative_error(y, reference(noise)) < 1e-5
  assert helpers.relative_error(y, reference(jnp.ones_like(x))) > 1e-3  # the jitter changed some routes


def _mesh_axes_groups(text, mesh_name, axes):
  """Replica groups (as dense<[[...]]> prints them) of the mesh axes `axes` of `sdy.mesh @mesh_name`,
  the form jax 0.12 lowers replica groups to: per value of the other axes, the devices along `axes`."""
  declared = re.search(rf"sdy\.mesh @{mesh_name} = <\[(.*?)\](?:, device_ids=\[([\d, ]*)\])?>", text)
  names, sizes = zip(*((n, int(v)) for n, v in re.findall(r'"(\w+)"=(\d+)', declared.group(1))))
  ids = (
    np.array([int(i) for i in declared.group(2).split(",")]) if declared.group(2) else np.arange(int(np.prod(sizes)))
  ).reshape(sizes)
  order = [names.index(a) for a in axes]
  others = [i for i in range(len(names)) if i not in order]
  grouped = ids.transpose(others + order).reshape(-1, int(np.prod([sizes[i] for i in order])))
  return str(grouped.tolist()).replace(" ", "")


def _collectives(text):
  """[(op, replica groups, operand element counts, dtypes)] of the collectives in StableHLO text;
  replica groups as device lists, whether printed as such (jax 0.10, 0.11) or as mesh axes (0.12)."""
  pattern = (
    r'"stablehlo\.(all_to_all|all_gather|all_reduce|reduce_scatter|collective_permute)"\(.*?'
    r"replica_groups = (?:dense<(\[\[.*?\]\])>|#stablehlo\.replica_group_mesh_axes<mesh = @([\w.]+), "
    r"axes = \[(.*?)\]>).*?\}[>)]\s*:\s*\(([^)]*)\)"
  )
  found = []
  for op, groups, mesh_name, axes, operands in re.findall(pattern, text, re.S):
    if not groups:
      assert "sub_axis_info" not in axes, axes
      groups = _mesh_axes_groups(text, mesh_name, re.findall(r'axis_ref<name = "(\w+)">', axes))
    shapes = re.findall(r"tensor<([0-9x]*)(\w+)>", operands)
    found.append(
      (
        op,
        groups.replace(" ", ""),
        [int(np.prod([int(s) for s in dims.split("x") if s])) for dims, _ in shapes],
        [dtype for _, dtype in shapes],
      )
    )
  return found


def test_collective_inventory_matches_parm(mesh_2x4):
  """Parm Eqs. (1), (11), (14) as volumes, read from the lowered forward and backward programs:
  S1/S2 all-to-all payload = baseline / N_MP; no ESP all-gather or all-reduce of token data; the MP
  all-gather moves BLM (S1) or ETM (S2); the MP splits cost an all-gather in the backward; and the
  expert matmuls get N_MP times fewer rows (no redundant compute)."""
  n, m, d, num_experts, k, tokens = 2, 4, 24, 4, 2, 64  # d = 24 marks token data among the collectives
  cfg = MoEConfig(num_experts=num_experts, top_k=k, d_model=d, d_ff=32, collective="capacity", capacity_factor=2.0)
  params = helpers.random_params(cfg, 0)
  x = helpers.normal(1, (tokens, d))
  blm = tokens // n * d  # a node's tokens
  etm = num_experts * 32 * d  # T = ceil(2.0 * 32 * 2 / 4) = 32 per node
  gpus, nodes, flat = "[[0,1,2,3],[4,5,6,7]]", "[[0,4],[1,5],[2,6],[3,7]]", "[[0,1,2,3,4,5,6,7]]"

  def lowered(schedule, backward=False):
    apply = lambda p, x: moe_apply(p, x, dataclasses.replace(cfg, esp_schedule=schedule), mesh_2x4)
    program = jax.grad(lambda p, x: jnp.sum(apply(p, x)[0]), argnums=(0, 1)) if backward else apply
    return jax.jit(program).lower(params, x).as_text()

  def token_elements(size):
    """Elements of token data [rows, d]; the combine's rows carry one more column (the arrival marker)."""
    return size if size % d == 0 else size // (d + 1) * d if size % (d + 1) == 0 else None

  def inventory(schedule, backward=False):
    return sorted(
      (op, groups, token_elements(sizes[0]))
      for op, groups, sizes, dtypes in _collectives(lowered(schedule, backward))
      if dtypes[0] == "f32" and token_elements(sizes[0])
    )

  assert inventory("baseline") == sorted(
    [
      ("all_gather", gpus, blm),  # AG_ESP: BLM in, BLM x N_ESP out
      ("all_to_all", nodes, etm * m),
      ("all_to_all", nodes, etm * m),
      ("all_reduce", gpus, etm * m),
    ]
  )
  assert inventory("s1") == sorted(
    [("all_to_all", flat, etm), ("all_to_all", flat, etm), ("all_gather", gpus, blm // m)]
  )  # gathers BLM / N_MP per GPU into BLM
  assert inventory("s2") == sorted(
    [("all_to_all", flat, etm), ("all_to_all", flat, etm), ("all_gather", gpus, etm // m)]
  )  # into ETM
  for schedule, split in (("s1", blm // m), ("s2", etm // m)):
    backward = inventory(schedule, backward=True)
    assert ("all_gather", gpus, split) in backward  # the MP split's backward
    assert not [c for c in backward if c[0] == "all_reduce" and c[1] == gpus]

  # The first expert matmul (ragged_dot as lowered here), [E / n, R, d] x [E / n, d, d_ff / m], R = all
  # capacity slots this GPU received: baseline n sources x m copies x T; S1 / S2 n m sources x T / m.
  rows = {s: re.findall(r"\(tensor<2x(\d+)x24xf32>, tensor<2x24x8xf32>\)", lowered(s)) for s in SCHEDULES}
  slots = num_experts // n * n * m * 32
  assert rows == {"baseline": [str(slots)], "s1": [str(slots // m)], "s2": [str(slots // m)]}


def test_mp_split_backward_is_the_gathered_cotangent(mesh_2x4):
  """mp_split's custom backward gives the same gradient as the plain slice it replaces."""

  def run(split):
    def body(x):
      return jnp.sum(jnp.sin(split(x)) * (1.0 + jax.lax.axis_index("gpu")))[None, None]

    f = jax.shard_map(body, mesh=mesh_2x4, in_specs=P("node"), out_specs=P("node", "gpu"))
    return jax.jit(jax.grad(lambda x: jnp.sum(f(x))))(helpers.normal(3, (16, 3)))

  plain = lambda x: jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("gpu") * 2, 2, 0)
  np.testing.assert_allclose(np.asarray(run(lambda x: esp_ops.mp_split(x))), np.asarray(run(plain)), rtol=1e-6)


def test_bad_inputs_are_named_before_compiling(mesh_2x4):
  base = dict(num_experts=4, top_k=2, d_model=8, d_ff=8, collective="capacity", capacity_factor=2.0)
  cfg = MoEConfig(**base)
  params = helpers.random_params(cfg, 0)
  x = jnp.ones((64, 8))

  def raises(match, cfg=cfg, params=params, x=x, schedule="s1", train=False):
    with pytest.raises(ConfigError, match=match):
      moe_apply(params, x, dataclasses.replace(cfg, esp_schedule=schedule), mesh_2x4, train=train)

  raises(r"esp_schedule='auto'", schedule="auto")
  raises(r"num_experts=3.*multiple of the mesh's 2 nodes", cfg=MoEConfig(**{**base, "num_experts": 3}))
  raises(r"d_ff=6.*multiple of the mesh's 4 GPUs", cfg=MoEConfig(**{**base, "d_ff": 6}))
  raises(r"path='gpu_first'.*no intra-node hop", cfg=MoEConfig(**{**base, "path": "gpu_first"}), schedule="baseline")
  raises(r"collective='ragged'.*use collective='padded'", cfg=MoEConfig(**{**base, "collective": "ragged"}))
  raises(r"expert_backend='pallas'", cfg=MoEConfig(**{**base, "expert_backend": "pallas"}))
  raises(r"60 tokens, not a multiple of 8 \(esp_schedule='s1'", x=x[:60])
  raises(r"63 tokens, not a multiple of 2 \(esp_schedule='s2'", x=x[:63], schedule="s2")
  raises(r"x has shape \(64, 7\)", x=jnp.ones((64, 7)))
  raises("parameter shapes", params={**params, "w_in": params["w_in"][:, :, :4]})
  raises("needs an rng", cfg=MoEConfig(**{**base, "jitter": 0.5}), schedule="s2", train=True)


@pytest.mark.parametrize("top_k,capacity_factor,want", [(1, 1.0, "s2"), (2, 2.0, "s1")])
def test_auto_is_resolved_before_the_layer_runs_algorithm_1s_pick(top_k, capacity_factor, want):
  """'auto' resolves with Parm's Algorithm 1 when the config is made (the layer refuses it). S1 all-gathers the layer output
  (BLM), S2 the expert outputs (ETM = k f BLM): with k f = 1 S2 saves S1's second all-to-all, with
  k f = 4 and large messages S1's smaller all-gather wins. The result equals the reference."""
  mesh = mesh_lib.make_mesh(2, 2)
  cfg = MoEConfig(
    num_experts=4,
    top_k=top_k,
    d_model=1024,
    d_ff=1024,
    collective="capacity",
    capacity_factor=capacity_factor,
    esp_schedule="auto",
  )
  assert parm.resolve_auto(cfg, 2 * 8192, 2, 2).esp_schedule == want
  small = dataclasses.replace(cfg, d_model=8, d_ff=12, capacity_factor=4.0)
  chosen = parm.resolve_auto(small, 32, 2, 2)
  params = random_params(small, 3)
  x = normal(4, (32, 8))
  y, aux = moe_apply(params, x, chosen, mesh)
  y_ref, _ = moe_reference(params, x, small, dispatch_groups=4 if chosen.esp_schedule == "s1" else 2)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
  assert int(aux["tokens_dropped"]) == 0
  with pytest.raises(ConfigError, match="esp_cost='nowhere'"):
    parm.resolve_auto(dataclasses.replace(cfg, esp_cost="nowhere"), 2 * 1024, 2, 2)
