"""Autoregressive decoding with the KV cache: vanilla and context-coherent (ExFlow) modes against a
no-cache forward of the whole sequence and a 1 x 1 mesh; exchange rows against a NumPy count from
the routing traces."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from moejax.infer import decode, exflow, load
from moejax.models import state as state_lib
from moejax.models.config import ModelConfig
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError

# slow: decoding end to end; one xdist worker runs the module, so its module fixtures are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("infer")]

V, D, F, E = 64, 16, 32, 8
BATCH, PROMPT, STEPS = 8, 5, 5
LOGIT_TOL = 2e-5  # fp32: the same per-token math, summed in other orders on other meshes


def _model(mesh, seed=3, top_k=1, **moe_fields):
  cfg = ModelConfig(
    kind="gpt", vocab_size=V, num_layers=4, d_model=D, num_heads=2, d_ff=F, max_len=16, dropout=0.0, embed_init_std=0.5
  )  # large embeddings: far from ties, varied routes
  moe = MoEConfig(num_experts=E, top_k=top_k, d_model=D, d_ff=F, **moe_fields)
  graphdef, _, _ = state_lib.abstract_state(cfg, moe, mesh, seed)
  return nnx.merge(graphdef, *state_lib.init_state(cfg, moe, mesh, seed))


@pytest.fixture(scope="module")
def prompts():
  return np.random.default_rng(7).integers(0, V, (BATCH, PROMPT))


@pytest.fixture(scope="module")
def model(mesh_2x4):
  return _model(mesh_2x4)


@pytest.fixture(scope="module")
def single(model, prompts):
  """Greedy decode on a 1 x 1 mesh: the reference of every mesh and mode."""
  return decode.generate(decode.on_mesh(model, mesh_lib.make_mesh(1, 1)), prompts, STEPS)


@pytest.fixture(scope="module")
def vanilla(model, prompts):
  return decode.generate(model, prompts, STEPS)


@pytest.fixture(scope="module")
def coherent(model, prompts):
  return decode.generate(model, prompts, STEPS, mode="exflow")


@pytest.fixture(scope="module")
def forced(model, prompts, vanilla):
  """A no-cache forward of prompt + generated tokens (teacher forcing): logits at every position
  and the routing traces expert_ids [M, B * S, 1]."""
  sequence = np.concatenate([prompts, vanilla.tokens[:, :-1]], axis=1)
  logits, aux = jax.jit(lambda t: model(t, details=True))(sequence)
  return np.asarray(logits), np.asarray(aux["expert_ids"])


def test_cached_decode_equals_recomputing_the_sequence(vanilla, forced):
  logits, _ = forced
  recomputed = logits[:, PROMPT - 1 :]  # position p's logits choose the token at p + 1
  np.testing.assert_allclose(vanilla.logits, recomputed, atol=LOGIT_TOL, rtol=0)
  np.testing.assert_array_equal(vanilla.tokens, recomputed.argmax(-1))
  assert len(np.unique(vanilla.tokens)) > 4  # not a degenerate repetition


def test_vanilla_on_2x4_equals_single_device(vanilla, single):
  np.testing.assert_array_equal(vanilla.tokens, single.tokens)
  np.testing.assert_allclose(vanilla.logits, single.logits, atol=LOGIT_TOL, rtol=0)


def test_exflow_equals_vanilla_and_single_device(model, prompts, single, vanilla, coherent):
  on_1x4 = decode.generate(decode.on_mesh(model, mesh_lib.make_mesh(1, 4)), prompts, STEPS, mode="exflow")
  for got in (coherent, on_1x4):
    np.testing.assert_array_equal(got.tokens, single.tokens)
    np.testing.assert_allclose(got.logits, single.logits, atol=LOGIT_TOL, rtol=0)
  np.testing.assert_allclose(coherent.logits, vanilla.logits, atol=LOGIT_TOL, rtol=0)


def test_sampling_is_the_same_in_both_modes_and_follows_the_seed(model, prompts):
  draws = {
    mode: decode.generate(model, prompts, STEPS, mode=mode, temperature=1.0, seed=11).tokens for mode in decode.MODES
  }
  np.testing.assert_array_equal(draws["vanilla"], draws["exflow"])
  other = decode.generate(model, prompts, STEPS, temperature=1.0, seed=12).tokens
  assert np.mean(other != draws["vanilla"]) > 0.3


def _numpy_rows(expert_ids, gpus_per_node, devices, mode, placement=None, dedup=True):
  """Exchange rows per generated token of the decode steps, counted from the traces: vanilla sends a
  token's copy to each of its experts' devices and back home at every MoE layer; exflow moves the
  token from where it is through its experts' devices in choice order and leaves it at the last. With dedup
  a token goes once to each device: vanilla's copy to each distinct device, exflow through its devices in
  ascending order (a device's choices together). placement [M, E]: device of each expert (default e // (E / D))."""
  k = expert_ids.shape[-1]
  per_token = expert_ids.reshape(expert_ids.shape[0], BATCH, -1, k)[:, :, PROMPT:]  # decode-step tokens
  if placement is None:
    placement = np.tile(np.arange(E) // (E // devices), (per_token.shape[0], 1))
  device_of = np.stack([p[t] for p, t in zip(placement, per_token)])  # [M, B, N - 1, K]
  if dedup and mode == "exflow":
    device_of = np.sort(device_of, axis=-1, kind="stable")
  home = np.broadcast_to(np.arange(BATCH)[:, None] // (BATCH // devices), device_of.shape[1:3])
  node = lambda d: d // gpus_per_node
  inside = cross = 0
  where = home
  for layer_devices in device_of:
    for choice in range(k):
      src = home if mode == "vanilla" else where
      dest = layer_devices[..., choice]
      moved = src != dest
      if dedup and mode == "vanilla":  # a device already sent to this layer gets no second copy
        moved &= ~(layer_devices[..., :choice] == dest[..., None]).any(axis=-1)
      crossed = moved & (node(src) != node(dest))
      copies = 2 if mode == "vanilla" else 1
      inside, cross = inside + copies * np.sum(moved & ~crossed), cross + copies * np.sum(crossed)
      where = dest
  tokens = per_token[0, ..., 0].size
  return {"intra_node": inside / tokens, "inter_node": cross / tokens}


def test_exchange_rows_match_a_count_from_the_routing_traces(vanilla, coherent, forced):
  _, expert_ids = forced
  for mode, got in (("vanilla", vanilla), ("exflow", coherent)):
    want = _numpy_rows(expert_ids, 4, 8, mode)
    assert got.exchange_rows == pytest.approx(want), mode
  assert sum(coherent.exchange_rows.values()) < sum(vanilla.exchange_rows.values())
  assert vanilla.lost_choices == coherent.lost_choices == 0  # dropless layers
  assert vanilla.allgather_rows == {"intra_node": 0.0, "inter_node": 0.0}
  assert coherent.allgather_rows == {"intra_node": 3.0, "inter_node": 4.0}


def test_a_placement_moves_the_experts_not_the_outputs(model, prompts, single, forced):
  """A random balanced placement (expert e of MoE layer j on device placement[j, e]): same tokens and
  logits; the exchange rows are those of the traces under that placement."""
  rng = np.random.default_rng(0)
  placement = np.stack([rng.permutation(np.arange(E) // (E // 8)) for _ in range(2)])
  got = decode.generate(decode.with_placement(model, placement), prompts, STEPS, mode="exflow")
  np.testing.assert_array_equal(got.tokens, single.tokens)
  np.testing.assert_allclose(got.logits, single.logits, atol=LOGIT_TOL, rtol=0)
  assert got.exchange_rows == pytest.approx(_numpy_rows(forced[1], 4, 8, "exflow", placement))
  assert got.exchange_rows != pytest.approx(_numpy_rows(forced[1], 4, 8, "exflow"))


def _with_moe(model, **changes):
  """The same parameters under an MoE config with `changes` (path, collective, buffers, schedule)."""
  moe = dataclasses.replace(model.moe_cfg, **changes)
  graphdef, _, _ = state_lib.abstract_state(model.cfg, moe, model.mesh)
  _, params, rest = nnx.split(model, nnx.Param, ...)
  return nnx.merge(graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest))


@pytest.mark.parametrize("path", ["gpu_first", "node_first"])
def test_exflow_takes_the_two_hop_paths(model, prompts, single, forced, path):
  got = decode.generate(_with_moe(model, path=path), prompts, STEPS, mode="exflow")
  np.testing.assert_array_equal(got.tokens, single.tokens)
  np.testing.assert_allclose(got.logits, single.logits, atol=LOGIT_TOL, rtol=0)
  # A row crossing nodes off its GPU index moves twice (inside the node, and across).
  flat = _numpy_rows(forced[1], 4, 8, "exflow")
  assert got.exchange_rows["inter_node"] == pytest.approx(flat["inter_node"])
  assert got.exchange_rows["intra_node"] > flat["intra_node"]


def test_exflow_bounded_buffers_repeat_overflowing_steps(model, prompts, single):
  """One row per device (B / D = 1, factor 0.5): tokens meeting at an expert's device overflow, and
  those steps (and the prefill's, step 0) run again with the buffer doubled until nothing is lost; from
  the start at the largest factor it reached, nothing overflows."""
  got = decode.generate(_with_moe(model, buffer_factor=0.5), prompts, STEPS, mode="exflow")
  decode_retries = [r for r in got.overflow_retries if r[0] >= 1]
  assert decode_retries and decode_retries[0][1] == 1.0
  assert got.lost_choices == 0
  np.testing.assert_array_equal(got.tokens, single.tokens)
  np.testing.assert_allclose(got.logits, single.logits, atol=LOGIT_TOL, rtol=0)
  largest = max(factor for _, factor in got.overflow_retries)
  again = decode.generate(_with_moe(model, buffer_factor=largest), prompts, STEPS, mode="exflow")
  assert again.overflow_retries == () and again.lost_choices == 0
  np.testing.assert_array_equal(again.tokens, single.tokens)


def test_exflow_top2_chains_through_both_experts(mesh_2x4, prompts):
  """Top-2: the token visits its first expert's device, then its second's, carrying the weighted
  output, and stays there: the tokens of vanilla decoding, two moves per token and MoE layer at most
  (Table I's 2 rows for top-2)."""
  top2 = _model(mesh_2x4, top_k=2)
  want = decode.generate(top2, prompts, STEPS)
  got = decode.generate(top2, prompts, STEPS, mode="exflow")
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logits, want.logits, atol=LOGIT_TOL, rtol=0)
  sequence = np.concatenate([prompts, want.tokens[:, :-1]], axis=1)
  _, aux = jax.jit(lambda t: top2(t, details=True))(sequence)
  assert got.exchange_rows == pytest.approx(_numpy_rows(np.asarray(aux["expert_ids"]), 4, 8, "exflow"))
  assert want.exchange_rows == pytest.approx(_numpy_rows(np.asarray(aux["expert_ids"]), 4, 8, "vanilla"))


def test_exflow_takes_deepseek_routing_shared_experts_and_replicas(mesh_2x4, prompts):
  """Sigmoid scores, group-limited top-2, a nonzero balancing bias, a gated shared expert, and two slots per
  device holding a table with replicas of the hot experts 0 and 1 (expert 7 only once): exflow decoding gives
  vanilla's tokens (the shared output is added where the token is, the bias only chooses, a replica computes
  as its expert)."""
  ds = _model(
    mesh_2x4,
    top_k=2,
    score="sigmoid",
    renormalize=True,
    routed_scaling=2.5,
    num_groups=4,
    topk_groups=2,
    bias_update_rate=1e-3,
    num_shared_experts=1,
    shared_gate=True,
    slots_per_device=2,
  )
  table = np.array([[d, d % 2] for d in range(8)], np.int32)
  table[7, 1] = 7
  graphdef, params, rest = nnx.split(ds, nnx.Param, ...)
  layers = ds.cfg.num_moe_layers
  biases = np.stack([np.random.default_rng(i).normal(0, 0.3, E).astype(np.float32) for i in range(layers)])
  rest = state_lib.with_expert_biases(ds.cfg, nnx.to_pure_dict(rest), biases)
  rest = state_lib.with_slot_tables(ds.cfg, rest, np.stack([table] * layers))
  ds = nnx.merge(graphdef, nnx.to_pure_dict(params), rest)
  want = decode.generate(ds, prompts, STEPS)
  got = decode.generate(ds, prompts, STEPS, mode="exflow")
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logits, want.logits, atol=LOGIT_TOL, rtol=0)


def test_bad_requests_name_the_value(model, prompts):
  with pytest.raises(ConfigError, match="collective.*no combine brings it home"):
    exflow.check_moe(MoEConfig(num_experts=E, top_k=1, d_model=D, d_ff=F, collective="capacity", capacity_factor=2.0))
  for schedule in ("chunked", "comet"):  # refused before anything compiles
    with pytest.raises(ConfigError, match="schedule.*no combine"):
      decode.generate(_with_moe(model, schedule=schedule), prompts, 2, mode="exflow")
  if jax.default_backend() == "cpu":  # XLA:CPU has no ragged all-to-all
    with pytest.raises(ConfigError, match="collective='ragged'"):
      decode.generate(_with_moe(model, collective="ragged"), prompts, 2, mode="exflow")
  with pytest.raises(ConfigError, match="capacity_factor"):
    exflow.check_moe(MoEConfig(num_experts=E, top_k=1, d_model=D, d_ff=F, capacity_factor=2.0))
  with pytest.raises(ConfigError, match="esp_schedule"):
    exflow.check_moe(MoEConfig(num_experts=E, top_k=1, d_model=D, d_ff=F, esp_schedule="baseline"))
  with pytest.raises(ConfigError, match="batch"):
    decode.generate(model, prompts[:6], 2)
  with pytest.raises(ConfigError, match="steps"):
    decode.generate(model, prompts, 16 - PROMPT + 2)
  with pytest.raises(ConfigError, match="mode"):
    decode.generate(model, prompts, 2, mode="greedy")


def test_prompts_are_the_first_tokens_of_long_enough_texts():
  class Chars:  # a tokenizer with one id per character
    encode = staticmethod(lambda text: [ord(c) for c in text])

  texts = ["abcdef", "xy", "ghijk", "lmnopq"]
  np.testing.assert_array_equal(load.prompts_from(texts, Chars, 2, 4), [[97, 98, 99, 100], [103, 104, 105, 106]])
  with pytest.raises(ConfigError, match="batch"):
    load.prompts_from(texts, Chars, 4, 4)
