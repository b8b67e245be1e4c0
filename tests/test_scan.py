"""Scanned layers (`moejax.models.layers`, model.scan_layers): the segments of a model's layers against a brute-force
reading of the kinds; a scanned decoder against the unrolled one built from the same seed (the same values): logits,
aux and every gradient in fp32 for a tiny DeepSeek-V3 (a dense first layer, MoE layers, an MTP module) under FSDP
with full remat and prioritised gradient sync, a tiny Qwen2-MoE with a dense layer among its MoE layers under tensor
parallelism with remat that keeps the exchanged rows, and a Qwen3-MoE whose layers alternate sliding and full
attention; the lowered train step's size flat in depth; a checkpoint of unrolled layers refused by a scanned config,
naming the fix."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import decoder
from moejax import checkpoint as checkpoint_lib
from moejax.models import layers, lm_loss
from moejax.models import state as state_lib
from moejax.models.config import from_sections
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import relative_error

TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)


@pytest.mark.parametrize(
  "kinds, want",
  [
    ("DMMM", [(0, 1, 1), (1, 1, 3)]),  # DeepSeek: dense first layers, then MoE
    ("DMDMDM", [(0, 2, 3)]),  # SMILE: every other FFN an MoE layer
    ("MDMM", [(0, 1, 1), (1, 1, 1), (2, 1, 2)]),  # Qwen2-MoE's mlp_only_layers=[1]
    ("DDMDDMDDMD", [(0, 3, 3), (9, 1, 1)]),
    ("DMDMMM", [(0, 2, 2), (4, 1, 2)]),
  ],
)
def test_segments_of_known_layouts(kinds, want):
  assert layers.find_segments(tuple(kinds)) == tuple(layers.Segment(*w) for w in want)


def test_segments_cover_the_layers_with_their_kinds():
  """Random layouts: the segments cover every layer once, in order; each sub-layer's repeats are one kind; a
  segment of period 1 is a whole run; no segment could take one more repeat of its unit."""
  rng = np.random.default_rng(0)
  for _ in range(300):
    kinds = tuple(rng.choice(list("ABC"[: rng.integers(1, 4)]), rng.integers(1, 13)))
    segments = layers.find_segments(kinds)
    covered = [seg.layer(r, j) for seg in segments for r in range(seg.repeats) for j in range(seg.period)]
    assert covered == list(range(len(kinds))), (kinds, segments)
    for seg in segments:
      assert all(
        kinds[seg.layer(r, j)] == kinds[seg.layer(0, j)] for r in range(seg.repeats) for j in range(seg.period)
      ), (kinds, seg)
      assert seg.period == 1 or seg.repeats >= 2
      unit = kinds[seg.start : seg.start + seg.period]
      assert kinds[seg.stop : seg.stop + seg.period] != unit, (kinds, seg)


def _family(spec: str, layers_: int, **model):
  """(DecoderConfig, MoEConfig) of configs/decoder.py's tiny `spec` with `layers_` layers and `model` fields."""
  config = decoder.get_config(spec)
  dense = decoder.TINY[spec].get("dense", 0)
  config.model.update({"num_layers": layers_, "moe_layers": tuple(i >= dense for i in range(layers_)), **model})
  return from_sections(config)


CASES = {  # name: (family, layers, model fields, what is compared)
  "deepseek_v3_fsdp_full_remat_prioritized": (
    "deepseek_v3",
    3,
    dict(fsdp=True, remat="full", grad_sync="prioritized"),
    "grads",
  ),
  "qwen2_moe_dense_inside_tp_save_exchanged": (
    "qwen2_moe",
    4,
    dict(moe_layers=(True, False, True, True), tensor_parallel=True, remat="save_exchanged"),
    "grads",
  ),
  "qwen3_moe_alternating_windows": ("qwen3_moe", 4, dict(sliding_window=3, sliding_layers=(True, False) * 2), "logits"),
}


def _run(cfg, moe_cfg, mesh, tokens_BxS, grads: bool):
  """(logits, aux, per-layer gradients or None, the model's per-layer parameters) of a training forward (jitter
  and the MTP modules on) with the loss next-token cross-entropy + aux losses + the MTP loss."""
  graphdef, _, _ = state_lib.abstract_state(cfg, moe_cfg, mesh)
  params, rest = state_lib.init_state(cfg, moe_cfg, mesh)
  _, _, targets_BxS, weights_BxS = objective.next_token(tokens_BxS, pad_id=0)

  def loss(params):
    model = nnx.merge(graphdef, params, rest)
    logits, aux = model(tokens_BxS, train=True, rngs=nnx.Rngs(dropout=1, jitter=2))
    total = lm_loss.cross_entropy_sums(logits, targets_BxS, weights_BxS)[0] / jnp.sum(weights_BxS)
    total += aux["aux_loss"]
    if "mtp_logits" in aux:
      total += 0.3 * lm_loss.multi_token_loss(aux["mtp_logits"], targets_BxS, weights_BxS) + aux["mtp_aux_loss"]
    return total, (logits, aux)

  if grads:
    (_, (logits, aux)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  else:
    (_, (logits, aux)), g = jax.jit(loss)(params), None
  per_layer = lambda tree: (
    None
    if tree is None
    else (layers.per_layer(tree, cfg), {k: v for k, v in tree.items() if k not in ("blocks", "segments")})
  )
  return logits, aux, per_layer(g), per_layer(params)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_scanned_equals_unrolled(mesh_2x4, case):
  family, num_layers, fields, compare = CASES[case]
  cfg, moe_cfg = _family(family, num_layers, **fields)
  assert layers.segments(dataclasses.replace(cfg, scan_layers=True)) != ()
  tokens = jnp.asarray(np.random.default_rng(5).integers(TOK.first_ordinary, TOK.num_ids, (8, 16)), jnp.int32)
  runs = {
    scan: _run(dataclasses.replace(cfg, scan_layers=scan), moe_cfg, mesh_2x4, tokens, compare == "grads")
    for scan in (False, True)
  }
  (logits, aux, grads, params), (s_logits, s_aux, s_grads, s_params) = runs[False], runs[True]
  for (path, a), (_, b) in zip(*(jax.tree_util.tree_leaves_with_path(p) for p in (params, s_params))):
    assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)  # the same model, stacked
  assert relative_error(s_logits, logits) < 1e-5
  assert set(s_aux) == set(aux)
  for name in ("expert_counts", "tokens_dropped", "tokens_overflowed"):
    np.testing.assert_array_equal(np.asarray(s_aux[name]), np.asarray(aux[name]), err_msg=name)
  for name in ("aux_loss", "mtp_aux_loss", "mtp_logits"):
    if name in aux:
      np.testing.assert_allclose(np.asarray(s_aux[name]), np.asarray(aux[name]), rtol=1e-5, atol=1e-7, err_msg=name)
  if compare == "grads":
    leaves = list(zip(*(jax.tree_util.tree_leaves_with_path(g) for g in (grads, s_grads))))
    assert len(leaves) == len(jax.tree.leaves(params))
    for (path, want), (_, got) in leaves:
      want, got = np.asarray(want), np.asarray(got)
      assert np.linalg.norm(want) > 0, jax.tree_util.keystr(path)  # every parameter has a gradient here
      assert relative_error(got, want) < 1e-5, jax.tree_util.keystr(path)


def _lowered_lines(spec: str, num_layers: int, scan: bool) -> int:
  config = decoder.get_config(spec)
  dense = decoder.TINY[spec].get("dense", 0)
  config.model.update(num_layers=num_layers, moe_layers=tuple(i >= dense for i in range(num_layers)), scan_layers=scan)
  config.update(batch_size=8, micro_batches=1, seq_len=16)
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(2, 4), TOK, donate=False)
  _, _, rest = state_lib.abstract_state(trainer.model_cfg, trainer.moe_cfg, trainer.mesh, config.seed)
  batch = jax.ShapeDtypeStruct((1, 8, 16), jnp.int32, sharding=trainer.batch_sharding)
  return len(trainer.step.lower(trainer.abstract_state, rest, batch).as_text().splitlines())


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["qwen3_moe", "deepseek_v3"])
def test_lowered_train_step_is_flat_in_depth(devices, spec):
  """The train step's program (StableHLO lines) at 16 layers is the 4 layers' within 10% with scanned layers; the
  unrolled program grows with its layers (the control)."""
  scanned = [_lowered_lines(spec, n, True) for n in (4, 16)]
  assert abs(scanned[1] - scanned[0]) <= 0.1 * scanned[0], scanned
  unrolled = [_lowered_lines(spec, n, False) for n in (4, 8)]
  assert unrolled[1] > 1.4 * unrolled[0], unrolled


@pytest.mark.slow
def test_unrolled_checkpoint_refused_by_a_scanned_config_naming_the_fix(mesh_2x4, tmp_path):
  """A run from before scanned layers (unrolled, params/blocks/i) resumed with scan_layers=True (the default) is
  refused before anything is read, naming model.scan_layers and the value that resumes it; and the reverse."""
  cfg, moe_cfg = _family("qwen3_moe", 2)
  states = {}
  for scan in (False, True):
    c = dataclasses.replace(cfg, scan_layers=scan)
    states[scan] = (
      {"params": state_lib.abstract_state(c, moe_cfg, mesh_2x4)[1]},
      {"params": state_lib.init_state(c, moe_cfg, mesh_2x4)[0]},
    )
  for saved, wanted in itertools.permutations((False, True)):
    ckpt = checkpoint_lib.Checkpointer(str(tmp_path / f"saved_{saved}"), keep=1, use_async=False)
    try:
      ckpt.save(1, states[saved][1], {})
      ckpt.wait()
      with pytest.raises(ConfigError, match=f"set model.scan_layers={saved} .*to resume it") as error:
        ckpt.restore_latest(states[wanted][0])
      assert error.value.field == "model.scan_layers"
      assert ckpt.restore_latest(states[saved][0])[0] == 1  # its own layout restores
    finally:
      ckpt.close()
