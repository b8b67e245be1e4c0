"""experiments.one_host_layer: one host's layer timed call by call, with the process's CPU use, and the program's
collectives as `moejax.cost.program` lists them for the same layer compiled here; a scheme it does not know is one
error line naming it."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from configs import one_host_layer
from moejax.cost import program
from moejax.moe.layer import moe_apply
from moejax.runtime import mesh as mesh_lib
from moejax.study import inputs, points
from tests.helpers import ENV, ROOT

pytestmark = pytest.mark.slow
ARGS = [
  "--config.calls=3",
  "--config.warmup=0",
  "--config.d_model=32",
  "--config.d_ff=64",
  "--config.tokens_per_gpu=16",
]


def test_the_layer_is_timed_call_by_call_with_its_collectives(tmp_path):
  run = subprocess.run(
    [sys.executable, "-m", "experiments.one_host_layer", f"--workdir={tmp_path}", "--config.scheme=smile", *ARGS],
    cwd=ROOT, env=ENV, capture_output=True, text=True,
  )  # fmt: skip
  assert run.returncode == 0, run.stderr[-2000:]
  record = json.loads((tmp_path / "one_host_layer.json").read_text())
  assert record["processes"] == 1 and len(record["calls"]) == 3
  assert all(c["seconds"] > 0 and c["cpu_s"] >= 0 and c["switches"] >= 0 for c in record["calls"])
  config = one_host_layer.get_config()
  cfg = points.scheme_config("smile", 1, 4, config.moe, 32, 64)
  mesh = mesh_lib.make_mesh(1, 4, devices=jax.devices("cpu")[:4])
  params = inputs.layer_params(cfg, mesh, 0, jnp.float32, balanced_router=True)
  x = inputs.random_tokens(mesh, 64, 32, 1, jnp.float32)
  compiled = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh)).lower(params, x).compile()
  expected = [
    dict(kind=c.kind, axes=list(c.axes), bytes=c.bytes, count=c.count) for c in program.collectives(compiled, mesh)
  ]
  assert record["collectives"] == expected and expected


def test_an_unknown_scheme_is_one_error_line(tmp_path):
  run = subprocess.run(
    [sys.executable, "-m", "experiments.one_host_layer", f"--workdir={tmp_path}", "--config.scheme=nope", *ARGS],
    cwd=ROOT, env=ENV, capture_output=True, text=True,
  )  # fmt: skip
  assert run.returncode != 0 and "nope" in run.stderr.strip().splitlines()[-1]
