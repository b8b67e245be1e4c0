"""Platform rules (moejax.runtime.platform): one decision each, one error naming the field."""

import jax.numpy as jnp
import pytest

from moejax.moe import collective as collective_lib
from moejax.moe import experts
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.runtime import platform as platform_lib
from moejax.validation import ConfigError
from tests.helpers import random_params


@pytest.mark.parametrize("platform,ragged", [("cpu", False), ("gpu", True), ("tpu", True)])
def test_exchange_rules(platform, ragged):
  assert platform_lib.has_ragged_all_to_all(platform) == ragged
  assert collective_lib.resolve("auto", platform) == ("ragged" if ragged else "padded")
  for name in ("ragged", "padded", "capacity"):
    assert collective_lib.resolve(name, platform) == name
  assert platform_lib.pallas_interprets(platform) == (platform != "gpu")


def test_ragged_on_cpu_names_the_field():
  with pytest.raises(ConfigError, match=r"moe\.collective='ragged'.*no ragged all-to-all"):
    collective_lib.check("ragged", "cpu", field="moe.collective")
  collective_lib.check("ragged", "gpu")  # allowed
  collective_lib.check("auto", "cpu")  # resolves to 'padded' there


def test_layer_asks_the_platform(mesh_2x4):
  cfg = MoEConfig(num_experts=8, top_k=1, d_model=8, d_ff=8, collective="ragged")
  params = random_params(cfg, 0)
  with pytest.raises(ConfigError, match="collective='ragged'"):
    moe_apply(params, jnp.ones((16, 8)), cfg, mesh_2x4)


def test_only_pallas_off_gpu_interprets():  # shard_map's check_vma is off only for the Pallas interpreter
  assert experts.BACKENDS["pallas"].interprets_on("cpu")
  assert not experts.BACKENDS["pallas"].interprets_on("gpu")
  assert not experts.BACKENDS["ragged_dot"].interprets_on("cpu")


def test_gpu_target_mesh_names_an_abstract_gpu():
  mesh = platform_lib.gpu_target_mesh({"gpu": 2})
  assert dict(mesh.shape) == {"gpu": 2}
  assert mesh.abstract_device.platform == "gpu"
  assert mesh.abstract_device.device_kind == platform_lib.TARGET_GPU
  assert platform_lib.gpu_target_mesh().axis_names == ()
