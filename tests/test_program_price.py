"""The price of a compiled program (`moejax.cost.program_price`): each collective of known shape against NCCL's ring
and pairwise formulas written out here in float64, and a compiled MoE layer and training step priced in full (every
collective the program runs has a price; a collective planted into the layer adds its own)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.cost import program, program_ops, program_price, program_segments, topology
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.runtime import mesh as mesh_lib
from moejax.study import program_calibration
from tests.helpers import compiled_train_step, normal, random_params

TOPO = topology.get("dgx_h100_ib")
ROWS, COLS = 16, 32
BLOCK = ROWS * COLS * 4  # one device's f32 block, bytes
BOTH = ("node", "gpu")


def _priced(mesh, body):
  f = jax.shard_map(body, mesh=mesh, in_specs=P(BOTH), out_specs=P(BOTH), check_vma=False)
  compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((mesh.devices.size * ROWS, COLS), jnp.float32)).compile()
  return program_price.price(compiled, mesh, TOPO)


def _one(priced):
  assert len(priced.collectives) == 1, priced.collectives
  return priced.collectives[0].seconds


def t(field):
  return float(TOPO[field])


def test_all_reduce_over_node_is_a_two_node_ring_sharing_the_nics(mesh_2x4):
  # 4 rings (one per GPU) of 2 devices on 2 nodes: 2 steps across the NICs, each edge 2 x 1/2 of the buffer, the
  # node's NIC shared by its 4 GPUs' rings.
  want = t("launch") + 2 * t("inter_latency") + BLOCK / min(t("intra_bw"), t("nic_bw") / 4)
  assert _one(_priced(mesh_2x4, lambda a: jax.lax.psum(a, "node"))) == pytest.approx(want, rel=1e-12)


def test_all_reduce_over_gpu_stays_in_the_node(mesh_2x4):
  want = t("launch") + 2 * 3 * t("intra_latency") + 2 * 3 / 4 * BLOCK / t("intra_bw")
  assert _one(_priced(mesh_2x4, lambda a: jax.lax.psum(a, "gpu"))) == pytest.approx(want, rel=1e-12)


def test_all_to_all_over_gpu_is_three_messages_and_three_quarters_of_the_block(mesh_2x4):
  body = lambda a: jax.lax.all_to_all(a, "gpu", 0, 0, tiled=True)  # noqa: E731
  want = t("launch") + 3 * t("intra_latency") + 3 / 4 * BLOCK / t("intra_bw")
  assert _one(_priced(mesh_2x4, body)) == pytest.approx(want, rel=1e-12)


def test_permute_across_nodes_shares_the_nic(mesh_2x4):
  body = lambda a: jax.lax.ppermute(a, "node", [(0, 1), (1, 0)])  # noqa: E731
  # every GPU sends its block to the other node: 4 blocks leave each node over its NICs.
  want = t("launch") + t("inter_latency") + 4 * BLOCK / t("nic_bw")
  assert _one(_priced(mesh_2x4, body)) == pytest.approx(want, rel=1e-12)


def test_unknown_runs_and_kinds_are_refused():
  c = program.Collective("all-reduce", "ar.1", 64, "f32", ("gpu",), ((0, 1),), None, True)
  with pytest.raises(ValueError, match=r"\['ar.1'\] run an unknown number of times"):
    program_price.price_collectives([c], np.zeros(2, np.int64), TOPO)
  odd = program.Collective("all-to-none", "x.2", 64, "f32", ("gpu",), ((0, 1),), 1, False)
  with pytest.raises(ValueError, match="kind 'all-to-none' has no price"):
    program_price.price_collective(odd, np.zeros(2, np.int64), TOPO)


def _layer(mesh, extra=None):
  cfg = MoEConfig(num_experts=16, top_k=2, d_model=8, d_ff=16, path="node_first", collective="padded")
  params = random_params(cfg, 0)

  def f(p, x):
    y, aux = moe_apply(p, x, cfg, mesh)
    return (y if extra is None else extra(y)), aux

  x = jax.ShapeDtypeStruct((8 * 8, cfg.d_model), jnp.float32)
  return jax.jit(f).lower(params, x).compile()


def _check_priced_in_full(compiled, mesh):
  priced = program_price.price(compiled, mesh, TOPO)
  listed = program.summary(program.collectives(compiled, mesh))
  assert {k: v[0] for k, v in listed.items()} == {k: v[0] for k, v in priced.by_kind().items()}
  multi = [p for p in priced.collectives if max(len(g) for g in p.collective.groups) > 1]
  assert multi and all(p.seconds > 0 for p in multi)
  assert priced.compute_s > 0 and priced.serial_s == pytest.approx(priced.compute_s + priced.communication_s)
  return priced


def test_a_layer_is_priced_in_full_and_a_planted_collective_adds_its_price(mesh_2x4):
  base = _check_priced_in_full(_layer(mesh_2x4), mesh_2x4)
  # A psum over 'gpu' of the [64, 8] f32 output (sharded 8 rows a device), inside a shard_map of its own.
  plant = jax.shard_map(lambda y: jax.lax.psum(y, "gpu"), mesh=mesh_2x4, in_specs=P(BOTH), out_specs=P(BOTH))
  planted = _check_priced_in_full(_layer(mesh_2x4, plant), mesh_2x4)
  extra = set(planted.by_kind()) - set(base.by_kind())
  before = base.by_kind().get(("all-reduce", ("gpu",)), (0, 0.0))
  runs, seconds = planted.by_kind()[("all-reduce", ("gpu",))]
  block = 8 * 8 * 4
  want = t("launch") + 2 * 3 * t("intra_latency") + 2 * 3 / 4 * block / t("intra_bw")
  assert runs == before[0] + 1 and seconds - before[1] == pytest.approx(want, rel=1e-9), extra


@pytest.mark.slow
def test_a_training_step_is_priced_in_full(devices):
  compiled, mesh = compiled_train_step(2)
  priced = _check_priced_in_full(compiled, mesh)
  kinds = {kind for kind, _ in priced.by_kind()}
  assert "all-reduce" in kinds and kinds & set(program_price.EXCHANGE)  # the gradient sync and the layers' exchanges


def test_calibration_fits_each_kind_and_axes_from_three_sizes(mesh_2x4):
  """terms_from() with seconds that answer alpha + (operands - 1) x per_operand + beta x bytes (+ extra x the bytes
  above the middle size) per (kind, axes), and for a chain of links alpha + (links - 1) x (launch + beta x bytes):
  the line through the two small sizes, the slope above, the many-operand form and the chain give them back exactly,
  and a collective priced from them is the planted clock at any size; a negative slope is clipped to 0."""
  rng = np.random.default_rng()
  truth = {}

  middle = program_calibration.SIZES[1]

  def timer(kind, axes, nbytes, operands, links):
    alpha, beta, each, launch, extra = truth.setdefault(
      (kind, axes), (*rng.uniform(1e-5, 1e-3, 3), rng.uniform(1e-6, 1e-5), rng.uniform(0, 1e-8))
    )
    beta = beta * 1e-5  # s/byte
    moved = nbytes * operands
    return (
      alpha
      + (operands - 1) * each
      + beta * moved
      + extra * max(0, moved - middle)
      + (links - 1) * (launch + beta * nbytes)
    )

  compute = dict(flops_per_s=1e9, bytes_per_s=1e8, op_bytes_per_s={"sort": 1e6}, launch_s=1e-5, call_s=1e-4)
  seconds = {key: timer(*key) for key in program_calibration.collective_keys(mesh_2x4)}
  terms = program_calibration.terms_from(seconds, compute, mesh_2x4, say=lambda *a: None)
  assert set(terms.per_kind) == {(k, a) for k in program_calibration.KINDS for a in (("node",), ("gpu",), BOTH)}
  for key, (alpha, beta, each, launch, extra) in truth.items():
    assert terms.per_kind[key] == pytest.approx((alpha, beta * 1e-5), rel=1e-9)
    assert terms.large[key] == pytest.approx(beta * 1e-5 + extra, rel=1e-9)
    for nbytes in rng.uniform(program_calibration.SIZES[0], 4 * program_calibration.SIZES[2], 4):
      assert terms.collective_seconds(*key, nbytes) == pytest.approx(timer(*key, nbytes, 1, 1), rel=1e-9)
    assert terms.per_operand[key] == pytest.approx(each, rel=1e-6)
    assert terms.chained.get(key) == (
      pytest.approx(launch, rel=1e-6) if key[0] in program_calibration.CHAINABLE else None
    )
    tiny = (alpha + beta * 1e-5 * program_calibration.TINY, each + beta * 1e-5 * program_calibration.TINY)
    assert terms.tiny.get(key) == (pytest.approx(tiny, rel=1e-6) if key[0] == "all-reduce" else None)
  assert program_calibration.line((10, 5.0), (100, 4.0)) == (5.0, 0.0)
  kept = dict(per_operand=terms.per_operand, chained=terms.chained, tiny=terms.tiny, large=terms.large)
  assert program_calibration.Terms(terms.per_kind, **compute, **kept) == terms


def test_a_many_operand_collective_pays_for_each_operand(mesh_2x4):
  """A psum of a tuple of 5 arrays is one all-reduce of 5 operands (as a step's combined gradients): listed with its
  operands and priced alpha + 4 x per_operand + beta x its bytes, from float64 arithmetic here."""
  sizes = (16, 8, 32, 4, 8)
  spec = (P(("node", "gpu")),) * len(sizes)
  body = jax.shard_map(lambda *xs: jax.lax.psum(xs, ("node", "gpu")), mesh=mesh_2x4, in_specs=spec, out_specs=spec)
  args = tuple(jnp.ones((8 * n,), jnp.float32) for n in sizes)
  compiled = jax.jit(body).lower(*args).compile()
  (found,) = [c for c in program.collectives(compiled, mesh_2x4) if c.kind == "all-reduce"]
  assert (found.operands, found.bytes, found.axes) == (5, 4 * sum(sizes), BOTH)
  rng = np.random.default_rng()
  alpha, beta, each = rng.uniform(1e-5, 1e-4), rng.uniform(1e-9, 1e-8), rng.uniform(1e-5, 1e-4)
  terms = program_calibration.Terms(
    {("all-reduce", BOTH): (alpha, beta)}, 1e9, 1e8, per_operand={("all-reduce", BOTH): each}
  )
  priced = program_price.price_measured(compiled, mesh_2x4, terms)
  assert priced.communication_s == pytest.approx(alpha + 4 * each + beta * 4 * sum(sizes), rel=1e-12)
  # with a term at TINY bytes per operand: 54.4 B each lies a fifth of the way from TINY (4 B) to the small size (256)
  tiny_alpha, tiny_each = rng.uniform(1e-6, 1e-5, 2)
  tiny_terms = dataclasses.replace(terms, tiny={("all-reduce", BOTH): (tiny_alpha, tiny_each)})
  at = (4 * sum(sizes) / 5 - 4) / (256 - 4)
  want = (tiny_alpha + at * (alpha - tiny_alpha)) + 4 * (tiny_each + at * (each - tiny_each)) + beta * 4 * sum(sizes)
  priced = program_price.price_measured(compiled, mesh_2x4, tiny_terms)
  assert priced.communication_s == pytest.approx(want, rel=1e-12)
  # an all-to-all in XLA's tuple form holds one piece per peer of one array: one operand, not eight
  a2a = jax.shard_map(
    lambda x: jax.lax.all_to_all(x, BOTH, 0, 0, tiled=True), mesh=mesh_2x4, in_specs=P(BOTH), out_specs=P(BOTH)
  )
  (exchange,) = program.collectives(jax.jit(a2a).lower(jnp.ones((64, 4))).compile(), mesh_2x4)
  assert (exchange.kind, exchange.operands, exchange.bytes) == ("all-to-all", 1, 8 * 4 * 4)


@pytest.mark.parametrize("kind", program_calibration.CHAINABLE)
def test_a_collective_right_after_another_is_chained_and_priced_at_its_chained_cost(mesh_2x4, kind):
  """The calibration's chain of LINKS collectives is listed with every link but the first chained; with a sort
  between two, the second follows compute: not chained. price_measured charges a chained one Terms.chained's alpha,
  the others per_kind's (float64 arithmetic here)."""
  chain = jax.shard_map(
    program_calibration._chain(kind, BOTH, mesh_2x4, program_calibration.LINKS),
    mesh=mesh_2x4,
    in_specs=P(BOTH),
    out_specs=P(BOTH),
  )
  x = jnp.ones((8 * 16, 8), jnp.float32)
  compiled = jax.jit(chain).lower(x).compile()
  found = [c for c in program.collectives(compiled, mesh_2x4) if c.kind == kind]
  assert [c.chained for c in found] == [False] + [True] * (program_calibration.LINKS - 1)
  one = program_calibration._body(kind, BOTH, mesh_2x4)
  apart = jax.shard_map(lambda a: one(jnp.sort(one(a), axis=0)), mesh=mesh_2x4, in_specs=P(BOTH), out_specs=P(BOTH))
  assert [c.chained for c in program.collectives(jax.jit(apart).lower(x).compile(), mesh_2x4)] == [False, False]
  rng = np.random.default_rng()
  alpha, beta, after = rng.uniform(1e-4, 1e-3), rng.uniform(1e-9, 1e-8), rng.uniform(1e-6, 1e-5)
  terms = program_calibration.Terms({(kind, BOTH): (alpha, beta)}, 1e9, 1e8, chained={(kind, BOTH): after})
  expected = sum((after if c.chained else alpha) + beta * c.bytes for c in found)
  assert program_price.price_measured(compiled, mesh_2x4, terms).communication_s == pytest.approx(expected, rel=1e-12)


def test_a_program_pays_the_launch_skew_once_at_its_first_collective(mesh_2x4):
  """Terms.skew is paid once per program run, at the first collective the program runs over some axis (its kind and
  axes'), whether that one runs once or in a loop of three: the price with skew less the one without, both here."""
  gpu = ("gpu",)
  once = lambda a: jnp.sort(a + jax.lax.psum(a, gpu), axis=0)  # noqa: E731
  step = lambda i, v: jnp.sort(v + jax.lax.psum(v, BOTH), axis=0)  # noqa: E731
  looped = lambda a: jax.lax.fori_loop(0, 3, step, a)  # noqa: E731
  rng = np.random.default_rng()
  per_kind = {("all-reduce", a): (rng.uniform(1e-5, 1e-4), rng.uniform(1e-9, 1e-8)) for a in (gpu, BOTH)}
  skew = {key: rng.uniform(1e-4, 1e-3) for key in per_kind}
  x = jnp.asarray(rng.uniform(-1, 1, (8 * 16, 8)), jnp.float32)
  for body, first in ((lambda a: looped(once(a)), gpu), (lambda a: once(looped(a)), BOTH)):
    fn = jax.shard_map(body, mesh=mesh_2x4, in_specs=P(BOTH), out_specs=P(BOTH))
    compiled = jax.jit(fn).lower(x).compile()
    found = program.collectives(compiled, mesh_2x4)
    assert sum(c.count for c in found if c.axes == BOTH) == 3
    named = program_price.first_collective(program_segments.segments(compiled.as_text()), found)
    assert next(c.axes for c in found if c.name == named) == first
    plain = program_calibration.Terms(per_kind, 1e9, 1e8)
    skewed = dataclasses.replace(plain, skew=skew)
    extra = program_price.price_measured(compiled, mesh_2x4, skewed).serial_s
    extra -= program_price.price_measured(compiled, mesh_2x4, plain).serial_s
    assert extra == pytest.approx(skew[("all-reduce", first)], rel=1e-9)


def test_measured_terms_price_each_collective_of_a_layer(mesh_2x4):
  """price_measured: each collective alpha + beta x bytes of its (kind, axes), summed over its runs (recomputed
  here from the listed collectives), compute the call plus each listed op's runs x (launch + its FLOPs or bytes at
  its category's rate); a kind not measured is refused."""
  compiled = _layer(mesh_2x4)
  found = program.collectives(compiled, mesh_2x4)
  rng = np.random.default_rng()
  per_kind = {(c.kind, c.axes): (rng.uniform(1e-5, 1e-4), rng.uniform(1e-9, 1e-8)) for c in found}
  rates = {"gather": 3e8, "scatter": 2e8, "sort": 1e7}
  terms = program_calibration.Terms(
    per_kind, flops_per_s=1e9, bytes_per_s=1e8, op_bytes_per_s=rates, launch_s=2e-6, call_s=5e-5
  )
  priced = program_price.price_measured(compiled, mesh_2x4, terms)
  want = sum(c.count * (per_kind[(c.kind, c.axes)][0] + per_kind[(c.kind, c.axes)][1] * c.bytes) for c in found)
  assert priced.communication_s == pytest.approx(want, rel=1e-12)
  ops = program_ops.ops(compiled)
  # the layer gathers, sorts and multiplies (its scatters too, where XLA keeps them: not with the fast-compile flags)
  assert {"matmul", "gather", "sort", "elementwise"} <= {o.category for o in ops}
  work = [o.count * (o.flops / 1e9 if o.category == "matmul" else o.bytes / rates.get(o.category, 1e8)) for o in ops]
  assert priced.compute_s == pytest.approx(5e-5 + sum(o.count for o in ops) * 2e-6 + sum(work), rel=1e-12)
  dropped = dict(per_kind)
  missing = next(iter(dropped))
  del dropped[missing]
  with pytest.raises(ValueError, match="not measured"):
    program_price.price_measured(compiled, mesh_2x4, program_calibration.Terms(dropped, 1e9, 1e8))


@pytest.mark.slow
def test_the_validation_command_prices_each_case_beside_its_time(tmp_path):
  """experiments.validate_program_price on one tiny case: terms measured, the layer timed and priced forward and
  forward+backward, each row's error its priced / measured - 1, its collectives timed alone; a malformed case is one
  error line."""
  import json
  import subprocess
  import sys

  from tests.helpers import ENV, ROOT

  cmd = [sys.executable, "-m", "experiments.validate_program_price", f"--workdir={tmp_path}", "--config.repeats=1"]
  run = subprocess.run(
    [*cmd, "--config.cases=32:64:256:flat:padded"], cwd=ROOT, env=ENV, capture_output=True, text=True
  )
  assert run.returncode == 0, run.stderr[-2000:]
  record = json.loads((tmp_path / "program_price.json").read_text())
  assert [r["passes"] for r in record["rows"]] == ["fwd", "fwd_bwd"]
  for r in record["rows"]:
    assert r["measured_ms"] > 0 and r["error"] == pytest.approx(r["priced_ms"] / r["measured_ms"] - 1)
    assert r["priced_ms"] == pytest.approx(r["collectives_ms"] + r["compute_ms"])
    assert r["alone_ms"] > 0  # the layer's collectives, each timed as a program of its own
    # from the profile: a device's time in them (waits included) at least each at its fastest device's
    assert r["inside_ms"] >= r["fastest_ms"] > 0
    kinds = r["by_kind"].values()
    assert sum(k["priced_ms"] for k in kinds) == pytest.approx(r["collectives_ms"])
    assert sum(k["inside_ms"] for k in kinds) == pytest.approx(r["inside_ms"])
    call_ms = 1e3 * record["terms"]["call_s"]
    assert sum(r["compute_ms_by_category"].values()) + call_ms == pytest.approx(r["compute_ms"])
    # priced again with each op at its own time alone: another compute (and the waits after it)
    assert r["per_op_priced_ms"] == pytest.approx(r["per_op_collectives_ms"] + r["per_op_compute_ms"])
    assert r["per_op_error"] == pytest.approx(r["per_op_priced_ms"] / r["measured_ms"] - 1)
    timed, ops = map(int, r["ops_timed"].split("/"))
    assert 0 < timed <= ops and r["per_op_compute_ms"] != pytest.approx(r["compute_ms"], rel=1e-6)
    # the profile's compute: the matmuls take time, and a run's wall is at least the part no op computes in
    profiled = r["profiled_by_category"]
    assert profiled["matmul"] > 0 and set(r["compute_ms_by_category"]) <= set(profiled)
    assert r["profiled_wall_ms"] > r["profiled_no_compute_ms"] >= 0
  assert {(c["kind"], tuple(c["axes"])) for c in record["terms"]["collectives"]} >= {("all-reduce", ("node", "gpu"))}
  bad = subprocess.run([*cmd, "--config.cases=32:64"], cwd=ROOT, env=ENV, capture_output=True, text=True)
  assert bad.returncode != 0 and "cases" in bad.stderr.strip().splitlines()[-1]


def _sweep_layer(scheme: str, plant=None):
  """(compiled forward of sweep scheme `scheme`'s layer on the 2 x 2 mesh, its MoEConfig); plant(y): a collective
  added to the layer's output inside shard_map."""
  from configs import scaling_default
  from moejax.study import points

  config = scaling_default.get_config()
  mesh = mesh_lib.make_mesh(2, 2, devices=jax.devices()[:4])
  cfg = points.scheme_config(scheme, 2, 2, config.moe, 16, 32)
  params = random_params(cfg, 0)
  x = normal(1, (64, 16), jnp.float32)

  def fn(p, v):
    y, _ = moe_apply(p, v, cfg, mesh)
    if plant is not None:
      y = jax.shard_map(plant, mesh=mesh, in_specs=P(("node", "gpu")), out_specs=P(("node", "gpu")))(y)
    return y

  return jax.jit(fn).lower(params, x).compile(), cfg, mesh


@pytest.mark.parametrize("scheme", ["smile", "hierarchical", "switch"])
@pytest.mark.sampled(1)  # the first: a two-hop path, with the planted exchange
def test_every_exchange_of_a_sweep_layer_is_priced_by_a_hop_of_its_path(scheme):
  """The sweep's modelled row prices a layer as its path's hops (the traffic model) plus its other collectives
  (control): the compiled layer of the scheme has no exchange outside its hops, and every collective is one or the
  other; a planted all-to-all over both axes on a two-hop path is reported unpriced, and the sweep's small run refuses
  it."""
  from moejax.study import simulate

  compiled, cfg, mesh = _sweep_layer(scheme)
  assert program_price.unpriced_exchanges(compiled, mesh, cfg.path_kind.hops) == []
  found = program.collectives(compiled, mesh)
  control = program_price.control_collectives(compiled, mesh)["collectives"]
  exchanges = [c for c in found if c.kind in program_price.EXCHANGE]
  assert exchanges and len(exchanges) + len(control) == len(found)
  if not cfg.path_kind.crosses_axes_apart:
    return
  planted = lambda y: jax.lax.all_to_all(y, ("node", "gpu"), 0, 0, tiled=True)
  compiled, cfg, mesh = _sweep_layer(scheme, planted)
  missed = program_price.unpriced_exchanges(compiled, mesh, cfg.path_kind.hops)
  assert [(c.kind, c.axes) for c in missed] == [("all-to-all", ("node", "gpu"))]
  with pytest.raises(ValueError, match="do not price"):
    simulate.check_priced(compiled, mesh, cfg, scheme)


@pytest.mark.slow
def test_the_chains_command_times_each_kind_both_ways(tmp_path):
  """experiments.collective_chains: per chainable kind and axis set a short and a long program, interleaved and back
  to back, the cost per further link their difference over links - 1; links below 2 is one error line."""
  import json
  import subprocess
  import sys

  from moejax.study import program_calibration
  from tests.helpers import ENV, ROOT

  cmd = [sys.executable, "-m", "experiments.collective_chains", f"--workdir={tmp_path}", "--config.repeats=1"]
  run = subprocess.run([*cmd, "--config.links=3"], cwd=ROOT, env=ENV, capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-2000:]
  record = json.loads((tmp_path / "collective_chains.json").read_text())
  keys = [(r["kind"], tuple(r["axes"])) for r in record["rows"]]
  assert set(keys) == {(k, a) for k in program_calibration.CHAINABLE for a in [("node",), ("gpu",), ("node", "gpu")]}
  for r in record["rows"]:
    for way in ("interleaved", "back_to_back"):
      w = r[way]
      assert w["single_ms"] > 0 and w["chain_ms"] > 0
      assert w["per_link_ms"] == pytest.approx((w["chain_ms"] - w["single_ms"]) / 2)
  assert record["cores_busy_back_to_back"] > 0
  bad = subprocess.run([*cmd, "--config.links=1", f"--workdir={tmp_path}/bad"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True)  # fmt: skip
  assert bad.returncode != 0 and "links" in bad.stderr.strip().splitlines()[-1]
