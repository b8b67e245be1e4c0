"""The decode-step price against a hand computation from the topology's terms."""

import numpy as np
import pytest

from moejax.cost import decode
from moejax.cost import topology as topology_lib
from moejax.validation import ConfigError


@pytest.mark.parametrize("mode", ["vanilla", "exflow"])
def test_one_node_step_by_hand(mode):
  """One node of 4 GPUs: each exchange is launch + 3 intra-node messages + the busiest GPU's bytes over
  the intra-node bandwidth; exflow adds a ring all-gather of the batch's states (3 steps)."""
  rng = np.random.default_rng(0)
  top = topology_lib.custom(
    "dgx_h100_ib",
    launch=rng.uniform(1e-6, 1e-5),
    intra_latency=rng.uniform(1e-6, 1e-5),
    intra_bw=rng.uniform(1e11, 5e11),
  )
  rows, batch, layers, row_bytes, state_bytes = rng.uniform(0.5, 3.0), 32, 3, 4096.0, 12288.0
  got = decode.decode_step(
    mode, {"intra_node": rows, "inter_node": 0.0}, batch, layers, (1, 4), row_bytes, state_bytes, top
  )
  exchanges = layers * (2 if mode == "vanilla" else 1)
  per_gpu_out = rows * batch / exchanges * row_bytes / 4  # evenly over the 4 senders
  one = top["launch"] + 3 * top["intra_latency"] + per_gpu_out / top["intra_bw"]
  gather = 0.0
  if mode == "exflow":
    gather = top["launch"] + 3 * top["intra_latency"] + 3 / 4 * batch * state_bytes / top["intra_bw"]
  np.testing.assert_allclose(got["exchange_s"], exchanges * one, rtol=1e-12)
  np.testing.assert_allclose(got["allgather_s"], gather, rtol=1e-12)


def test_spread_keeps_the_totals_and_bad_inputs_are_named():
  bytes_AxA = decode.uniform_exchange_bytes(5.0, 7.0, 2, 4, 10.0)
  node = np.arange(8) // 4
  assert bytes_AxA[node[:, None] == node[None, :]].sum() == pytest.approx(50.0)
  assert bytes_AxA[node[:, None] != node[None, :]].sum() == pytest.approx(70.0)
  assert np.all(np.diag(bytes_AxA) == 0)
  top = topology_lib.get("dgx_h100_ib")
  with pytest.raises(ConfigError, match="mode='beam'"):
    decode.decode_step("beam", {"intra_node": 1, "inter_node": 1}, 8, 2, (2, 4), 1.0, 1.0, top)
  with pytest.raises(ConfigError, match="batch=0"):
    decode.decode_step("vanilla", {"intra_node": 1, "inter_node": 1}, 0, 2, (2, 4), 1.0, 1.0, top)
