"""Expert data parallelism (`MoEConfig.expert_data_parallel`): experts over a node's GPUs only, replicated over
'node'. Fewer experts than devices run and equal the single-device reference, gradients included (each node's
replica of an expert sees its node's tokens: the gradient is their sum over the nodes), move no row between
nodes, and the choices that cannot meet it are refused with the reason."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.moe.config import MoEConfig
from moejax.moe.params import param_specs
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError
from tests import helpers


@pytest.mark.parametrize(
  "n,m,num_experts,fields",
  [
    (2, 4, 4, {}),
    (2, 4, 4, {"dedup": False}),
    (4, 2, 4, {"schedule": "comet", "num_chunks": 2}),
    (2, 4, 8, {"buffer_factor": 2.0, "slots_per_device": 3}),
    (4, 2, 2, {"collective": "capacity", "capacity_factor": 1.0}),
  ],
)
def test_experts_over_gpus_equal_the_reference_and_stay_in_the_node(n, m, num_experts, fields):
  cfg = MoEConfig(num_experts=num_experts, top_k=2, d_model=16, d_ff=8, gated=True, expert_data_parallel=True, **fields)
  mesh = mesh_lib.make_mesh(n, m)
  params, x = helpers.random_params(cfg, n + num_experts), helpers.normal(m, (8 * n * m, 16))
  table = None
  if cfg.slots_per_device:  # each GPU keeps its experts and a replica of expert 0 or 1
    per = num_experts // m
    table = np.array([list(range(g * per, (g + 1) * per)) + [g % 2] for g in range(m)], np.int32)
  _, aux = helpers.assert_matches_reference(cfg, mesh, params, x, dispatch_groups=n * m, slot_expert=table)
  traffic = np.asarray(aux["traffic_rows"])
  assert traffic.shape[0] == 1  # one hop, over 'gpu'
  node = np.arange(n * m) // m
  assert traffic[0][node[:, None] != node[None, :]].sum() == 0 and traffic[0].sum() > 0
  assert param_specs(cfg)["w_in"] == P(mesh_lib.GPU)  # replicated over 'node'


def test_fewer_experts_than_devices_need_it():
  cfg = MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=8)
  with pytest.raises(ConfigError, match="multiple of the mesh's 8 devices"):
    cfg.check_mesh(2, 4)
  assert MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=8, expert_data_parallel=True).experts_per_holder(2, 4) == 1


@pytest.mark.parametrize(
  "fields",
  [
    {"esp_schedule": "s1"},
    {"routing": "bilevel", "num_nodes": 2},
    {"routing": "node_limited", "num_nodes": 2},
    {"path": "gpu_first"},
    {"path": "node_first"},
  ],
)
def test_choices_that_cannot_meet_it_are_refused(fields):
  with pytest.raises(ConfigError, match="expert_data_parallel=True.*every node holds every expert"):
    MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=8, expert_data_parallel=True, **fields)
