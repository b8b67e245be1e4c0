"""Hash routing (`routing='hash'`) in the models: every MoE layer of a decoder or a `LanguageModel` routes by the
token ids of its input (the MTP modules' by the ids they embed), on every runner: the forward on the 2 x 4 mesh equals
the one-device model and each layer's experts are the plain hash of the ids (Python integers, not the code's
function); decoding through the cache, vanilla and ExFlow's, equals the full forward; a placed model keeps its logits
and ExFlow's decode; a training step through a 1F1B pipeline and the two-batch step equal the plain step. The layer itself: tests/test_hash_routing.py."""

import jax
import numpy as np
import pytest
from flax import nnx

import moejax.models as models
from configs import decoder
from moejax.infer import decode
from moejax.models.config import ModelConfig, moe_block_indices
from moejax.models.language_model import LanguageModel
from moejax.moe.config import MoEConfig
from moejax.pipeline import section as pipeline_section
from moejax.runtime import mesh as mesh_lib
from tests import step_checks
from tests.helpers import relative_error
from tests.test_hash_routing import _plain_hash
from tests.test_hf_models import DATA

FAMILY = "qwen3_moe"  # every layer MoE, softmax top-k: the router hash replaces
HASH = {"routing": "hash"}


def _tokens(seed: int, skew: bool, vocab: int, shape=(8, 12)) -> np.ndarray:
  """Fresh random ids, or one id everywhere (every token of every layer to the same experts)."""
  return np.full(shape, 17, np.int32) if skew else np.random.default_rng(seed).integers(0, vocab, shape, np.int32)


@pytest.mark.parametrize("skew", [False, True], ids=["random", "one_id"])
@pytest.mark.sampled(1)
def test_decoder_routes_by_token_ids_and_equals_one_device(devices, skew):
  model = models.from_hf(str(DATA / FAMILY), mesh_lib.make_mesh(2, 4), moe=HASH)
  one = models.from_hf(str(DATA / FAMILY), mesh_lib.make_mesh(1, 1), moe=HASH)
  cfg = model.moe_cfg
  tokens = _tokens(3, skew, model.cfg.vocab_size)
  logits, aux = model(tokens, details=True)
  want = [_plain_hash(int(t), cfg.top_k, cfg.num_experts) for t in tokens.reshape(-1)]
  for layer in np.asarray(aux["expert_ids"]):
    np.testing.assert_array_equal(layer, want)
  assert np.all(np.asarray(aux["tokens_dropped"]) == 0)
  assert relative_error(np.asarray(logits), np.asarray(one(tokens)[0])) < 1e-5
  topk_logits = models.from_hf(str(DATA / FAMILY), mesh_lib.make_mesh(2, 4))(tokens)[0]
  assert relative_error(np.asarray(logits), np.asarray(topk_logits)) > 1e-2  # the hash chose other experts


@pytest.mark.parametrize("kind", ["bert", "gpt"])
@pytest.mark.sampled(1)
def test_language_model_routes_by_token_ids_and_equals_one_device(devices, kind):
  """The paper-scale language models (`LanguageModel`: BERT's post-LN blocks, GPT's pre-LN ones) on the 2 x 4 mesh:
  every MoE layer's experts are the plain hash of the ids, the logits the one-device model's (the same weights)."""
  cfg = ModelConfig(kind=kind, vocab_size=96, num_layers=2, d_model=32, num_heads=4, d_ff=64, max_len=16)
  moe_cfg = MoEConfig(num_experts=8, top_k=2, d_model=32, d_ff=64, capacity_factor=4.0, routing="hash")
  model = LanguageModel(cfg, moe_cfg, mesh_lib.make_mesh(2, 4), rngs=nnx.Rngs(0))
  one = LanguageModel(cfg, moe_cfg, mesh_lib.make_mesh(1, 1), rngs=nnx.Rngs(0))
  tokens = _tokens(6, False, 96, (8, 16))
  logits, aux = jax.jit(lambda t: model(t, details=True))(tokens)
  want = [_plain_hash(int(t), 2, 8) for t in tokens.reshape(-1)]
  for layer in np.asarray(aux["expert_ids"]):
    np.testing.assert_array_equal(layer, want)
  assert relative_error(np.asarray(logits), np.asarray(jax.jit(lambda t: one(t)[0])(tokens))) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["vanilla", "exflow"])
def test_decode_through_the_cache_equals_the_full_forward(devices, mode):
  """Greedy decode (ExFlow's: each moved row's token id read by its request) gives at every step the logits the full
  forward gives over the prompt and the tokens generated before."""
  model = models.from_hf(str(DATA / FAMILY), mesh_lib.make_mesh(2, 4), moe=HASH)
  prompt, steps = _tokens(4, False, model.cfg.vocab_size, (8, 5)), 4
  out = decode.generate(model, prompt, steps, mode=mode)
  tokens = np.concatenate([prompt, out.tokens], axis=1)
  full = np.asarray(model(tokens[:, :-1])[0])[:, prompt.shape[1] - 1 :]
  assert relative_error(out.logits, full) < 1e-5


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_a_placed_decoder_routes_each_id_to_the_moved_experts_and_decodes_alike(devices, scan):
  """Every MoE layer's experts placed at random over the 8 devices (`with_placement`), the layers unrolled or scanned
  (each layer's index a slice of the stacked state): the forward gives the same logits, each layer's choices are the
  same experts at their new indices, and ExFlow's greedy decode (the rows move to where the experts now sit) gives the
  unplaced model's tokens and logits."""
  model = models.from_hf(str(DATA / FAMILY), mesh_lib.make_mesh(2, 4), moe=HASH, model={"scan_layers": scan})
  layers, experts = len(moe_block_indices(model.cfg)), model.moe_cfg.num_experts
  rng = np.random.default_rng(8)
  placement = np.stack([rng.permutation(np.repeat(np.arange(8), experts // 8)) for _ in range(layers)])
  placed = decode.with_placement(model, placement)
  tokens = _tokens(9, False, model.cfg.vocab_size)
  (logits, aux), (placed_logits, placed_aux) = model(tokens, details=True), placed(tokens, details=True)
  assert relative_error(np.asarray(placed_logits), np.asarray(logits)) < 1e-5
  order = np.asarray(placed.expert_order)  # [M, E]: the expert at each index
  for j, (before, after) in enumerate(zip(np.asarray(aux["expert_ids"]), np.asarray(placed_aux["expert_ids"]))):
    np.testing.assert_array_equal(order[j][after], before)
    np.testing.assert_array_equal(after // (experts // 8), placement[j][before])
  prompt = _tokens(10, False, model.cfg.vocab_size, (8, 5))
  want, got = decode.generate(model, prompt, 3), decode.generate(placed, prompt, 3, mode="exflow")
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert relative_error(got.logits, want.logits) < 1e-5


def _training_config(micro: int, pipeline: dict):
  """The qwen3_moe fixture's config (random init) with hash routing on 1 x 4 devices, 4 MoE layers, 16 rows in
  `micro` micro-batches, all-to-all exchanges with nothing dropped."""
  config = decoder.get_config(f"hf={DATA / FAMILY}")
  config.init_from = ""
  config.model.update(num_layers=4, moe_layers=(True,) * 4, vocab_size=256)
  config.update(batch_size=16, micro_batches=micro, seq_len=16)
  config.mesh.update(nodes=1, gpus_per_node=4)
  config.moe.update(num_nodes=1, collective="capacity", capacity_factor=4.0, routing="hash")
  config.data.shards = 4
  config.optim.warmup_steps = 1
  config.pipeline = {**pipeline_section.defaults(), **pipeline}
  return config


@pytest.mark.slow
@pytest.mark.parametrize("schedule, stages, micro", [("1f1b", 2, 4), ("two_batch", 1, 2)])
def test_hash_routed_training_pipelined_as_unpipelined(devices, schedule, stages, micro):
  """Each stage routes its layers by its micro-batch's ids, each half of the two-batch step by its own: the step's
  metrics and every gradient (AdamW's first moment) equal the plain step's."""
  step_checks.check_equals_the_plain_step(_training_config, schedule, stages, micro)
