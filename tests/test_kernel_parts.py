"""The kernel benchmark's parts (moejax/bench/kernel_parts.py) compute what their names say: each against float64
NumPy on random inputs, skewed groups with an empty one and rows past the groups."""

import jax
import numpy as np
import pytest

from moejax.bench import kernel_parts
from tests.numpy_moe import ACT


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.sampled(1)
def test_each_part_matches_numpy(gated):
  model = dict(d=8, f=16, experts=3, top_k=1, gated=gated, activation="silu" if gated else "gelu")
  sizes = np.array([9, 0, 4], np.int32)  # 13 of 16 rows in groups
  a = kernel_parts.part_inputs(model, 16, sizes, np.float32, seed=4)
  n = {k: None if v is None else np.asarray(v, np.float64) for k, v in a.items() if k != "gs"}
  act = ACT[model["activation"]]
  group = np.repeat(np.arange(3), sizes)  # group of each row in groups
  rows = np.arange(len(group))

  def per_row(lhs, w, transpose=False):  # each row times its group's weight
    out = np.zeros((16, w.shape[1] if transpose else w.shape[2]))
    for r, g in zip(rows, group):
      out[r] = lhs[r] @ (w[g].T if transpose else w[g])
    return out

  def per_group(lhs, rhs):  # sum over a group's rows of lhs^T rhs
    return np.stack([lhs[: len(group)][group == g].T @ rhs[: len(group)][group == g] for g in range(3)])

  z_in = per_row(n["x"], n["w_in"])
  z_gate = per_row(n["x"], n["w_gate"]) if gated else None
  h = act(z_gate) * z_in if gated else act(z_in)
  dh = per_row(n["dy"], n["w_out"], transpose=True)
  eps = 1e-6
  dact = lambda z: (act(z + eps) - act(z - eps)) / (2 * eps)
  want = {
    "hidden": h,
    "out": per_row(n["h"], n["w_out"]),
    "bwd_dx": per_row(n["dz_in"], n["w_in"], True) + (per_row(n["dz_gate"], n["w_gate"], True) if gated else 0),
    "bwd_dw_in": per_group(n["x"], n["dz_in"]),
    "bwd_dw_out": per_group(n["h"], n["dy"]),
  }
  want["bwd_hidden"] = (h, dh * act(z_gate), dh * z_in * dact(z_gate)) if gated else (h, dh * dact(z_in), None)
  want["hidden_saved"] = (h, z_in, z_gate)
  kept_in, kept_gate = n["z_in"], n.get("z_gate")  # the pre-activations 'bwd_hidden_saved' reads, random here
  want["bwd_hidden_saved"] = (
    (act(kept_gate) * kept_in, dh * act(kept_gate), dh * kept_in * dact(kept_gate))
    if gated
    else (act(kept_in), dh * dact(kept_in), None)
  )
  if gated:
    want["bwd_dw_gate"] = per_group(n["x"], n["dz_gate"])
  parts = kernel_parts.part_functions(model, interpret=True)
  assert (
    set(parts)
    == set(want)
    == {p for names in kernel_parts.FFN_PARTS.values() for p in names if gated or p != "bwd_dw_gate"}
  )
  for name, (fn, _) in parts.items():
    got = jax.tree.leaves(fn(a))
    expected = [w for w in (want[name] if isinstance(want[name], tuple) else (want[name],)) if w is not None]
    assert len(got) == len(expected), name
    for g, w in zip(got, expected):
      g = np.asarray(g, np.float64)
      if g.shape[0] == 16:  # rows past the groups: zero in every row-shaped output
        assert not np.any(g[len(group) :]), name
        g, w = g[: len(group)], w[: len(group)]
      np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4, err_msg=name)
