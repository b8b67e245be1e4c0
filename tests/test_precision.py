"""Mixed precision in training (moejax.train.precision, moejax.train.optim): AdamW on an fp32 master copy against a
float64 NumPy AdamW, moments in bf16, gradients accumulated in fp32, Muon's per-expert matrices, the master copy
through a checkpoint, the config's errors, and a tiny decoder whose bf16 training keeps up with fp32 only with the
master copy."""

import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from moejax import checkpoint
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import objective, optim, precision
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import ROOT, normal

sys.path.insert(0, str(ROOT))
from configs import decoder, mlm  # noqa: E402

TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
LR, B1, B2, EPS, WD, CLIP = 1e-2, 0.9, 0.95, 1e-8, 0.1, 6.0


def _section(**fields) -> ml_collections.ConfigDict:
  o = mlm.get_config().optim
  o.update(dict(name="adamw", b1=B1, b2=B2, eps=EPS, weight_decay=WD, clip_norm=CLIP), **fields)
  return o


def _params(dtype) -> dict:
  """Fresh normal draws: a matrix (decayed), a vector (not decayed)."""
  return {"w": jnp.asarray(normal(0, (6, 5)), dtype), "b": jnp.asarray(normal(1, (5,)), dtype)}


def _grads(step: int) -> dict:
  """Fresh float32 gradients (the trainer hands the optimizer its fp32 accumulation); global norm about 6 x 1.5,
  so clipping at CLIP = 6 acts."""
  return {"w": jnp.asarray(1.5 * normal(10 + step, (6, 5))), "b": jnp.asarray(1.5 * normal(20 + step, (5,)))}


def numpy_adamw(
  params: dict, grads: list[dict], decayed: set, clip: float = CLIP, nesterov: bool = False
) -> tuple[dict, dict, dict]:
  """float64 AdamW after clipping by global norm at `clip`: (params, m, v) after len(grads) steps; weight decay on
  the names in `decayed`; with `nesterov`, Dozat's (NAdam's) first moment, as optax.contrib.muon's AdamW has it."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t, g in enumerate(grads, start=1):
    g = {k: np.asarray(x, np.float64) for k, x in g.items()}
    norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
    g = {k: x * min(1.0, clip / norm) for k, x in g.items()}
    for k in p:
      m[k] = B1 * m[k] + (1 - B1) * g[k]
      v[k] = B2 * v[k] + (1 - B2) * g[k] ** 2
      m_hat = m[k] / (1 - B1**t)
      if nesterov:
        m_hat = B1 * m[k] / (1 - B1 ** (t + 1)) + (1 - B1) * g[k] / (1 - B1**t)
      update = m_hat / (np.sqrt(v[k] / (1 - B2**t)) + EPS)
      p[k] = p[k] - LR * (update + (WD * p[k] if k in decayed else 0.0))
  return p, m, v


def _adam_state(opt_state):
  """The ScaleByAdamState inside the optimizer's state (under the master copy and the clipping)."""
  inner = opt_state.inner if isinstance(opt_state, precision.MasterState) else opt_state
  return inner[1][0]


@pytest.mark.parametrize(
  "param_dtype,master,moments",
  [("float32", None, None), ("bfloat16", "float32", None), ("bfloat16", "float32", "bfloat16")],
)
def test_adamw_matches_numpy(param_dtype, master, moments):
  """Three steps of AdamW on fresh params and gradients against float64 NumPy. fp32 parameters, or bf16 ones with
  the fp32 master copy: to fp32 rounding, the bf16 parameters the master rounded; with bf16 moments, the moments
  within bf16 rounding of each step's and the master within that share of the three updates."""
  params = _params(param_dtype)
  tx = optim.optimizer(_section(master_dtype=master, moment_dtype=moments), LR, params)
  state = tx.init(params)
  grads = [_grads(t) for t in range(3)]
  for g in grads:
    params, state = jax.jit(precision.apply, static_argnums=0)(tx, g, state, params)
  want, want_m, want_v = numpy_adamw(_params(param_dtype), grads, decayed={"w"})
  adam = _adam_state(state)
  assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(moments or "float32")}
  updated = state.master if master else params
  assert {x.dtype for x in jax.tree.leaves(updated)} == {jnp.dtype("float32")}
  rtol = 2**-7 if moments else 1e-5  # each moment rounded to bf16 (8 significant bits) at each of 3 steps
  atol = 3 * LR * 2 * rtol + 1e-6  # three updates of at most about 1 (Adam's), each off by m's and v's errors
  for k in params:
    for got_moment, want_moment in ((adam.mu[k], want_m[k]), (adam.nu[k], want_v[k])):  # relative to their scale
      np.testing.assert_allclose(
        np.asarray(got_moment, np.float64), want_moment, rtol=0, atol=rtol * np.abs(want_moment).max()
      )
    np.testing.assert_allclose(np.asarray(updated[k]), want[k], rtol=0, atol=atol)
    if master:  # the model's parameters are the master rounded to their dtype
      np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(state.master[k].astype(params[k].dtype)))
  moved = np.abs(want["w"] - np.asarray(_params(param_dtype)["w"], np.float64)).max()
  assert moved > 10 * atol  # the tolerance is far below what the steps moved


def test_gradients_accumulate_in_float32():
  """1024 bf16 micro-batch gradients of 2^-7 add up to exactly 8 in the fp32 accumulator; a bf16 sum stalls at 2,
  where an addend is half of bf16's spacing and rounds away."""
  params = {"w": jnp.zeros((3,), jnp.bfloat16)}
  g = {"w": jnp.full((3,), 2**-7, jnp.bfloat16)}
  add = jax.jit(lambda total, plain: (precision.accumulate(total, g), jax.tree.map(jnp.add, plain, g)))
  total, plain = precision.zeros_for_accumulation(params), params
  for _ in range(1024):
    total, plain = add(total, plain)
  assert total["w"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(total["w"]), 8.0)
  assert float(plain["w"][0]) == 2.0


@pytest.mark.skipif(not optim.has_muon(), reason=f"optim.name='muon' needs optax >= {optim.MUON_OPTAX}")
def test_muon_orthogonalises_each_expert_and_adamw_the_rest():
  """Two Muon steps: a stacked expert tensor [E, d, f] moves as E separate [d, f] matrices would (each expert its
  own orthogonalisation), and the embedding table and a norm take float64 NumPy AdamW's steps (optax's Muon gives
  them Nesterov's first moment and decays them too)."""
  rng = np.random.default_rng(3)
  w_in = rng.standard_normal((4, 8, 6)).astype(np.float32)
  table, norm = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((8,)).astype(np.float32)
  kernel = rng.standard_normal((8, 8)).astype(np.float32)

  def tree(experts, t, k, n):
    return {
      "embed": {"embedding": t},
      "blocks": {0: {"attn": {"q": {"kernel": k}}, "ln": {"weight": n}, "ffn": {"moe": experts}}},
    }

  stacked = tree({"w_in": w_in}, table, kernel, norm)
  split = tree({f"e{e}": w_in[e] for e in range(4)}, table, kernel, norm)
  grads = [jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32) * 0.5, stacked) for _ in range(2)]
  split_grads = [
    tree(
      {f"e{e}": g["blocks"][0]["ffn"]["moe"]["w_in"][e] for e in range(4)},
      g["embed"]["embedding"],
      g["blocks"][0]["attn"]["q"]["kernel"],
      g["blocks"][0]["ln"]["weight"],
    )
    for g in grads
  ]
  runs = []
  for params, gs in ((stacked, grads), (split, split_grads)):
    params = jax.tree.map(jnp.asarray, params)
    tx = optim.optimizer(_section(name="muon", clip_norm=1e3), LR, params)
    state = tx.init(params)
    for g in gs:
      params, state = jax.jit(precision.apply, static_argnums=0)(tx, g, state, params)
    runs.append(params)
  got, want = runs
  for e in range(4):
    np.testing.assert_allclose(
      got["blocks"][0]["ffn"]["moe"]["w_in"][e], want["blocks"][0]["ffn"]["moe"][f"e{e}"], rtol=1e-5, atol=1e-6
    )
  assert np.abs(np.asarray(got["blocks"][0]["ffn"]["moe"]["w_in"]) - w_in).max() > 1e-3
  flat = [{"t": g["embed"]["embedding"], "n": g["blocks"][0]["ln"]["weight"]} for g in grads]
  adam, _, _ = numpy_adamw({"t": table, "n": norm}, flat, decayed={"t", "n"}, clip=1e3, nesterov=True)
  np.testing.assert_allclose(got["embed"]["embedding"], adam["t"], rtol=0, atol=1e-6)
  np.testing.assert_allclose(got["blocks"][0]["ln"]["weight"], adam["n"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("field,value", [("name", "sgd"), ("master_dtype", "bfloat16"), ("moment_dtype", "float16")])
def test_config_errors_name_the_field(field, value):
  config = mlm.get_config()
  config.optim[field] = value
  with pytest.raises(ConfigError, match=f"optim.{field}="):
    config_lib.validate(config)


def test_muon_without_its_optax_is_refused(monkeypatch):
  monkeypatch.setattr(optim, "has_muon", lambda: False)
  config = mlm.get_config()
  config.optim.name = "muon"
  with pytest.raises(ConfigError, match=rf"optim.name='muon'.*optax >= {optim.MUON_OPTAX}"):
    config_lib.validate(config)


def _decoder(param_dtype: str, master, batch_size: int = 8, experts: int = 4):
  """Tiny Qwen3-MoE: one MoE block of `experts` experts (top-2), `batch_size` sequences of 32 tokens in 2
  micro-batches."""
  config = decoder.get_config("qwen3_moe")
  config.update(batch_size=batch_size, micro_batches=2, seq_len=32)
  config.model.update(dtype=param_dtype, param_dtype=param_dtype, num_layers=1, moe_layers=(True,))
  config.moe.update(num_experts=experts, top_k=2)
  config.optim.update(master_dtype=master)
  return config


@pytest.mark.slow  # builds the 2 x 4 FSDP state (about 10 s)
def test_master_copy_is_sharded_and_checkpointed_like_the_params(mesh_2x4, tmp_path):
  """With FSDP on the 2 x 4 mesh, each master tensor has its parameter's sharding; a state whose master has moved
  away from the parameters restores bit for bit."""
  config = _decoder("bfloat16", "float32", batch_size=16, experts=8)
  config.model.fsdp = True
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_2x4, TOK, donate=False)
  state, _ = trainer.init()
  master = state["opt_state"].master
  for p, m in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(master)):
    assert m.dtype == jnp.float32 and m.sharding.is_equivalent_to(p.sharding, p.ndim)
  assert any(len(p.sharding.spec) and p.sharding.spec[0] for p in jax.tree.leaves(state["params"]))  # FSDP-sharded
  nudged = jax.tree.map(lambda m: m + jnp.float32(1e-5), master)  # below bf16's resolution of the parameters
  state["opt_state"] = state["opt_state"]._replace(master=nudged)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), keep=1, use_async=False)
  ckpt.save(1, state, [])
  ckpt.close()
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), keep=1, use_async=False)
  _, restored, _ = ckpt.restore_latest(trainer.abstract_state)
  ckpt.close()
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, state)
  for want, got in zip(jax.tree.leaves(nudged), jax.tree.leaves(restored["opt_state"].master)):
    assert got.sharding.is_equivalent_to(want.sharding, want.ndim)


STEPS = 200


def _losses(config) -> np.ndarray:
  """Task losses of STEPS steps on one fixed batch on one device."""
  config.update(steps=STEPS)
  config.mesh.update(nodes=1, gpus_per_node=1)
  config.moe.num_nodes, config.data.shards = 1, 1
  # A constant learning rate of 1e-4: AdamW moves each parameter by about 1e-4 a step, below half the spacing of
  # bf16 values around most of the kernels (|w| of 0.05 to 0.2: 1e-4 to 8e-4), so without a master copy those
  # updates round away.
  config.optim.update(learning_rate=1e-4, warmup_steps=0, end_fraction=1.0)
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(1, 1), TOK)
  state, rest = trainer.init()
  tokens = np.random.default_rng(1).integers(TOK.first_ordinary, TOK.num_ids, (2, 4, 32), np.int32)
  batch = jax.device_put(tokens, trainer.batch_sharding)
  losses = []
  for _ in range(STEPS):
    state, metrics = trainer.step(state, rest, batch)
    losses.append(metrics["task_loss"])
  return np.asarray(jax.device_get(losses))


@pytest.mark.slow  # three 200-step runs (about 45 s on 2 loaded cores)
def test_bf16_training_keeps_up_with_fp32_only_with_the_master_copy(devices):
  """A tiny decoder memorising one batch for 200 steps at a learning rate whose updates fall below bf16's
  resolution: bf16 parameters and compute with the fp32 master copy end within 5% of the fp32 run's loss drop
  (the noise of bf16 compute: 0.003 nats of a 1.74-nat drop when measured), pure bf16 updates more than 15% short
  of it (0.39 nats when measured). Removing the master copy makes the first run the second."""
  fp32 = _losses(_decoder("float32", None))
  master = _losses(_decoder("bfloat16", "float32"))
  pure = _losses(_decoder("bfloat16", None))
  final = lambda losses: losses[-20:].mean()
  drop = fp32[0] - final(fp32)
  print(
    f"drop {drop:.3f}; last-20 means fp32 {final(fp32):.4f}, bf16 + master {final(master):.4f}, bf16 {final(pure):.4f}"
  )
  assert drop > 1.0
  assert abs(final(master) - final(fp32)) < 0.05 * drop
  assert final(pure) - final(fp32) > 0.15 * drop
