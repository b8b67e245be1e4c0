"""The loss computed a chunk of vocabulary columns at a time (`lm_loss.head_cross_entropy_sums`, the run config's
`loss_chunk`): its sums and gradients against float64 NumPy, the models' training loss (MTP included) against the
unchunked path under FSDP and tensor parallelism, and per-device temporaries that no longer hold the logits."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.models import lm_loss
from moejax.models import state as state_lib
from moejax.models.config import from_sections
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.validation import ConfigError
from tests.helpers import ROOT, relative_error

sys.path.insert(0, str(ROOT))
from configs import decoder, mlm  # noqa: E402


def _numpy_sums_and_grads(h, kernel, bias, targets, weights, d_correct):
  """float64: (loss sum, correct count) and the gradients of loss sum + d_correct x correct count with respect to
  h, kernel, bias and weights, by the chain rule of softmax cross-entropy."""
  h, kernel, bias, weights = (np.asarray(x, np.float64) for x in (h, kernel, bias, weights))
  logits = h @ kernel + bias
  top = logits.max(-1, keepdims=True)
  log_z = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
  token_loss = log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  correct = (logits.argmax(-1) == targets).astype(np.float64)
  one_hot = np.eye(kernel.shape[1])[targets]
  d_logits = (np.exp(logits - log_z[..., None]) - one_hot) * weights[..., None]
  grads = (
    d_logits @ kernel.T,
    np.einsum("bpd,bpv->dv", h, d_logits),
    d_logits.sum((0, 1)),
    token_loss + d_correct * correct,
  )
  return ((token_loss * weights).sum(), (correct * weights).sum()), grads


@pytest.mark.parametrize("chunk", [0, 16, 37, 100, 101, 500])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.sampled(1)
def test_chunked_sums_and_gradients_equal_float64_numpy(chunk, bias):
  """Chunks that divide V = 101 or not (the last one shifted back and its seen columns masked), none (0) and wider
  than V: the sums and every gradient equal float64 NumPy's at fp32 rounding; a third of the targets are the
  argmax, so the correct count is neither 0 nor all."""
  rng = np.random.default_rng(chunk + 1000 * bias)
  b, p, d, v = 3, 11, 24, 101
  h = rng.normal(size=(b, p, d)).astype(np.float32)
  kernel = (rng.normal(size=(d, v)) / np.sqrt(d)).astype(np.float32)
  bias_v = rng.normal(size=(v,)).astype(np.float32) if bias else np.zeros(v, np.float32)
  targets = rng.integers(0, v, (b, p))
  argmax = (h @ kernel + bias_v).argmax(-1)
  targets = np.where(rng.uniform(size=(b, p)) < 1 / 3, argmax, targets)
  weights = rng.uniform(0.2, 1.0, (b, p)).astype(np.float32)
  (want_loss, want_correct), want_grads = _numpy_sums_and_grads(h, kernel, bias_v, targets, weights, 0.3)
  assert 0 < want_correct < weights.sum()

  def total(h, kernel, bias_v, weights):
    loss, correct = lm_loss.head_cross_entropy_sums(
      h, kernel, bias_v if bias else None, jnp.asarray(targets), weights, chunk
    )
    return loss + 0.3 * correct, (loss, correct)

  (_, (loss, correct)), grads = jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2, 3), has_aux=True))(
    h, kernel, bias_v, weights
  )
  assert float(loss) == pytest.approx(want_loss, rel=1e-6)
  assert float(correct) == pytest.approx(want_correct, rel=1e-6)
  for name, got, want in zip(("h", "kernel", "bias", "weights"), grads, want_grads):
    if name == "bias" and not bias:
      continue
    assert relative_error(np.asarray(got), want) < 1e-5, name


@pytest.mark.parametrize("chunk", [-1, 2.5, True])
def test_a_bad_chunk_is_refused_by_name(chunk):
  with pytest.raises(ConfigError, match="loss_chunk"):
    lm_loss.head_cross_entropy_sums(
      jnp.ones((1, 2, 4)), jnp.ones((4, 8)), None, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)), chunk
    )


def test_a_bad_loss_chunk_field_is_refused_before_compiling():
  config = mlm.get_config()
  config.loss_chunk = -1
  with pytest.raises(ConfigError, match="loss_chunk"):
    config_lib.checked(config)


CASES = {  # name: (config, model fields, chunk)
  # MTP's module and the main head, FSDP (the tied-off lm_head [d, V] sharded), V = 256 in 6 chunks of 48
  "deepseek_v3_fsdp": pytest.param(
    (lambda: decoder.get_config("deepseek_v3"), dict(num_layers=2, moe_layers=(False, True), fsdp=True), 48),
    marks=pytest.mark.slow,
  ),  # about 20 s
  # BERT's MLM head (its transform and bias) at the masked positions, tied embeddings, tensor parallel and FSDP
  "bert_tp_fsdp": (mlm.get_config, dict(num_layers=2, tensor_parallel=True, fsdp=True), 100),  # about 12 s
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
@pytest.mark.slow
def test_model_loss_equals_the_unchunked_path(mesh_2x4, case):
  """The training loss through `model_loss_sums` with chunks that do not divide V, against the logits the model
  returns and `cross_entropy_sums` (+ `multi_token_loss`): the sums, the MTP loss and every parameter's gradient,
  in fp32 on the 2 x 4 mesh."""
  make, fields, chunk = case
  config = make()
  config.model.update(fields)
  cfg, moe_cfg = from_sections(config)
  assert cfg.vocab_size % chunk
  graphdef, _, _ = state_lib.abstract_state(cfg, moe_cfg, mesh_2x4)
  params, rest = state_lib.init_state(cfg, moe_cfg, mesh_2x4)
  rng = np.random.default_rng(7)
  tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (8, 24)), jnp.int32)
  if cfg.causal:
    inputs, positions, targets, weights = objective.next_token(tokens, pad_id=0)
  else:
    inputs, positions, targets, weights = objective.bert_mask(
      jax.random.key(3), tokens, mask_id=1, first_ordinary=4, num_ordinary=cfg.vocab_size - 4
    )

  def unchunked(params):
    model = nnx.merge(graphdef, params, rest)
    logits, aux = model(inputs, positions_BxP=positions, train=True, rngs=nnx.Rngs(dropout=1, jitter=2))
    loss, correct = lm_loss.cross_entropy_sums(logits, targets, weights)
    mtp = lm_loss.multi_token_loss(aux["mtp_logits"], targets, weights) if "mtp_logits" in aux else 0.0
    return loss + 0.3 * mtp, (loss, correct, mtp)

  def chunked(params):
    model = nnx.merge(graphdef, params, rest)
    loss, correct, aux = objective.model_loss_sums(
      model, inputs, positions, targets, weights, chunk=chunk, rngs=nnx.Rngs(dropout=1, jitter=2)
    )
    mtp = aux.get("mtp_loss", 0.0)
    return loss + 0.3 * mtp, (loss, correct, mtp)

  runs = [jax.jit(jax.value_and_grad(f, has_aux=True))(params) for f in (unchunked, chunked)]
  ((_, want), want_grads), ((_, got), got_grads) = runs
  assert (float(want[2]) > 0) == (getattr(cfg, "num_mtp_layers", 0) > 0)
  for name, a, b in zip(("loss", "correct", "mtp_loss"), got, want):
    assert float(a) == pytest.approx(float(b), rel=1e-5), name
  leaves = list(zip(*(jax.tree_util.tree_leaves_with_path(g) for g in (want_grads, got_grads))))
  for (path, a), (_, b) in leaves:
    a, b = np.asarray(a), np.asarray(b)
    assert relative_error(b, a) < 1e-5 or np.linalg.norm(a) == np.linalg.norm(b) == 0, jax.tree_util.keystr(path)


@pytest.mark.parametrize(
  "kernel_spec", [P(), P(None, mesh_lib.AXES), P(mesh_lib.AXES, None)], ids=["replicated", "vocab_sharded", "d_sharded"]
)
def test_chunked_temporaries_do_not_hold_the_logits(mesh_2x4, kernel_spec):
  """The compiled forward and backward of the loss on the 2 x 4 mesh (tokens sharded over both axes, the kernel
  replicated, split over the vocabulary or over d as FSDP splits it): unchunked, the per-device temporaries exceed
  the device's logits (1024 tokens x 16384 columns in fp32, 67 MB); in chunks of 1000 columns they stay under a
  quarter of them."""
  b, s, d, v = 8, 1024, 16, 16384
  logits_bytes = b * s * v * 4 // mesh_2x4.size
  spec = lambda shape, dtype, p: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh_2x4, p))
  args = (
    spec((b, s, d), jnp.float32, P(mesh_lib.AXES)),
    spec((d, v), jnp.float32, kernel_spec),
    spec((v,), jnp.float32, P()),
    spec((b, s), jnp.int32, P(mesh_lib.AXES)),
    spec((b, s), jnp.float32, P(mesh_lib.AXES)),
  )

  def temp_bytes(chunk: int) -> int:
    loss = lambda h, k, bias, t, w: lm_loss.head_cross_entropy_sums(h, k, bias, t, w, chunk)[0]
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes(0) > logits_bytes
  assert temp_bytes(1000) < logits_bytes / 4
