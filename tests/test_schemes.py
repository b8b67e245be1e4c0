"""The one scheme table (moejax.study.schemes): composed names, the dedup suffix, the placeholders, and the sweep's and
the convergence study's schemes as they were written before they derived from it (with the path and collective that
the transport they named was: 'padded' on CPU, the flat transport of those days, is collective 'auto' there)."""

import pytest

from configs import convergence, scaling_default
from moejax.moe.config import MoEConfig
from moejax.study import points, schemes

# The sweep's schemes as its own table wrote them (routing, path and collective explicit), on a 4-node CPU mesh.
SWEEP_BEFORE = {
  "switch": dict(routing="topk", top_k=1, path="flat", collective="capacity", capacity_factor=2.0),
  "flat_dropless": dict(routing="topk", path="flat", collective="auto"),
  "hierarchical": dict(routing="topk", path="gpu_first", collective="auto"),
  "smile": dict(
    routing="bilevel", num_nodes=4, node_top_k=1, path="node_first", collective="auto", capacity_factor=2.0
  ),
  "node_limited": dict(routing="node_limited", num_nodes=4, path="node_first", collective="auto"),
  "smile_nodedup": dict(
    routing="bilevel", num_nodes=4, node_top_k=1, path="node_first", collective="auto", capacity_factor=2.0, dedup=False
  ),
  "node_limited_nodedup": dict(routing="node_limited", num_nodes=4, path="node_first", collective="auto", dedup=False),
  "chunked": dict(routing="topk", path="flat", collective="auto", schedule="chunked"),
  "comet": dict(routing="topk", path="flat", collective="auto", schedule="comet"),
  **{
    s: dict(routing="topk", path="flat", collective="capacity", capacity_factor=1.2, esp_schedule=e)
    for s, e in (("esp_baseline", "baseline"), ("s1", "s1"), ("s2", "s2"))
  },
}


def test_composed_schemes_fill_the_mesh_in():
  assert schemes.fields("smile+node_first", 4) == dict(
    routing="bilevel", num_nodes=4, node_top_k=1, path="node_first", collective="auto"
  )
  assert schemes.fields("flat", 2) == {"path": "flat", "collective": "auto"}
  assert schemes.fields("node_first+fp8_bf16_nodedup", 2) == dict(
    path="node_first", collective="auto", dispatch_dtype="float8_e4m3fn", combine_dtype="bfloat16", dedup=False
  )
  assert schemes.fields("flat+s2", 2)["esp_schedule"] == "s2"  # later names add to earlier ones


@pytest.mark.parametrize("scheme", ["bilevel", "node_first_dedup", "flat+fp16", "smile+"])
def test_an_unknown_name_is_named(scheme):
  with pytest.raises(ValueError, match="unknown scheme '"):
    schemes.fields(scheme, 2)


def test_the_sweep_schemes_are_what_its_own_table_set():
  moe = scaling_default.get_config().moe
  common = {k: v for k, v in moe.items() if k not in points.SWEEP_FIELDS}
  assert set(points.SCHEMES) == set(SWEEP_BEFORE)
  for scheme, fields in SWEEP_BEFORE.items():
    before = MoEConfig(**{**common, "num_experts": 8, "d_model": 32, "d_ff": 64, **fields})
    assert points.scheme_config(scheme, 4, 2, moe, 32, 64) == before, scheme
  assert points.OVERLAP_SCHEMES == ("chunked", "comet")
  assert points.ESP_SCHEMES == {"esp_baseline": "baseline", "s1": "s1", "s2": "s2"}


def test_the_convergence_routers_take_the_tables_routing():
  for router, overrides in convergence.routers(128, 8, 2).items():
    table = schemes.fields(router, 2)
    assert {k: overrides["moe"][k] for k in table} == table, router
  assert convergence.routers(128)["smile"]["moe"]["routing"] == "bilevel"
