"""The MoE layer run as 2 real processes x 4 CPU devices equals the same layer in one process."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.params import init_params
from tests.helpers import ENV, ROOT

pytestmark = pytest.mark.slow  # two real processes with jax.distributed


@pytest.mark.parametrize(
  "routing,path,cf", [("topk", "gpu_first", 1.25), ("topk", "flat", None), ("bilevel", "node_first", 2.0)]
)
def test_two_process_layer_equals_single_process(mesh_2x4, tmp_path, routing, path, cf):
  out = tmp_path / "demo.npz"
  overrides = [
    f"--config.moe.routing={routing}",
    f"--config.moe.path={path}",
    f"--workdir={tmp_path}",
    "--config.tokens=128",
    "--config.steps=1",
  ]
  if cf is not None:
    overrides.append(f"--config.moe.capacity_factor={cf}")
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "moejax.runtime.launch",
      "--processes",
      "2",
      "--devices-per-process",
      "4",
      "--",
      sys.executable,
      "-m",
      "experiments.demo",
      *overrides,
    ],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  result = np.load(out)

  from configs import demo  # the same config the processes read

  config = demo.get_config()
  moe = {**config.moe.to_dict(), "routing": routing, "path": path, "capacity_factor": cf}
  cfg = MoEConfig.from_mapping(moe)
  params = init_params(jax.random.key(config.seed), cfg)
  y, aux = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_2x4))(params, result["x"])
  np.testing.assert_allclose(result["y"], np.asarray(y), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(result["traffic_rows"], np.asarray(aux["traffic_rows"]))
  assert int(result["tokens_dropped"]) == int(aux["tokens_dropped"])
  assert (int(aux["tokens_dropped"]) > 0) == (cf is not None)
