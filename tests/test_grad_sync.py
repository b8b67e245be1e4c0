"""Lina's prioritised gradient synchronisation: identical gradients, and in the partitioned program the
lower MoE layer's backward exchange waits for the gradient all-reduces of the blocks above it."""

import json
import subprocess
import sys

import pytest

from moejax.models.config import ModelConfig
from moejax.validation import ConfigError
from tests.helpers import ENV, ROOT


@pytest.mark.slow
def test_prioritized_reduces_each_bucket_before_the_next_exchange(tmp_path):
  """Unrolled, exchanges in program order: the two MoE layers' forward, then their backward (upper layer first).
  default: no exchange depends on any gradient all-reduce (XLA may run them at the same time);
  prioritized: the lower layer's backward exchange depends on the all-reduces of the blocks above it.
  Scanned (the layers' backward one loop): with prioritized only, the gradient the loop carries into the next
  iteration's exchanges is computed after the iteration's all-reduces. The same gradients in every case."""
  # No persistent compilation cache: a program loaded from it is not compiled, so XLA dumps nothing for it.
  env = {k: v for k, v in ENV.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(
    JAX_ENABLE_COMPILATION_CACHE="false",
    XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} --xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=spmd-partitioning",
  )
  done = subprocess.run(
    [sys.executable, "tests/programs/grad_sync_check.py", str(tmp_path)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
  assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
  result = json.loads(lines[0][len("RESULT ") :])
  assert result["max_grad_difference"] == 0.0
  assert len(result["default"]) == len(result["prioritized"]) == 4
  assert result["default"] == [0, 0, 0, 0]
  assert result["prioritized"][:3] == [0, 0, 0] and result["prioritized"][3] > 0
  assert result["scanned_default"] is False and result["scanned_prioritized"] is True
  assert result["scanned_relative_difference"] < 1e-5


def test_bad_grad_sync_is_named():
  with pytest.raises(ConfigError, match="grad_sync='lina'"):
    ModelConfig(kind="gpt", vocab_size=96, num_layers=2, d_model=32, num_heads=4, d_ff=64, max_len=16, grad_sync="lina")
