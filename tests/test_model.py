"""The SMILE language models: shapes, tied head, causal masking, sharding layout and paper sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from moejax.models import layers
from moejax.models import state as state_lib
from moejax.models.config import ModelConfig
from moejax.models.language_model import LanguageModel
from moejax.models.sharding import param_specs
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.runtime.mesh import AXES
from moejax.validation import ConfigError

V, D, F = 96, 32, 64


def _configs(kind, layers=2, experts=8):
  cfg = ModelConfig(kind=kind, vocab_size=V, num_layers=layers, d_model=D, num_heads=4, d_ff=F, max_len=16)
  moe = MoEConfig(num_experts=experts, top_k=1, d_model=D, d_ff=F, capacity_factor=2.0)
  return cfg, moe


class Built:
  """A model initialised by one compiled program, with its forward pass as one jitted function."""

  def __init__(self, kind, mesh):
    self.cfg, self.moe_cfg = _configs(kind)
    self.graphdef, _, _ = state_lib.abstract_state(self.cfg, self.moe_cfg, mesh)
    self.params, self.rest = state_lib.init_state(self.cfg, self.moe_cfg, mesh)
    self.model = nnx.merge(self.graphdef, self.params, self.rest)
    self._apply = jax.jit(lambda params, t, p: nnx.merge(self.graphdef, params, self.rest)(t, positions_BxP=p))

  def __call__(self, tokens, positions=None, params=None):
    return self._apply(self.params if params is None else params, tokens, positions)


@pytest.fixture(scope="module")
def model(mesh_2x4):
  return Built("bert", mesh_2x4)


@pytest.fixture(scope="module")
def decoder(mesh_2x4):
  return Built("gpt", mesh_2x4)


@pytest.mark.slow
def test_overflow_is_counted_per_moe_layer(mesh_2x4):
  """Receive buffers of a quarter of the local rows: rows overflow, and every token-choice is
  either processed, dropped by capacity or overflowed."""
  cfg, moe = _configs("bert")
  moe = MoEConfig(**{**moe.__dict__, "capacity_factor": None, "buffer_factor": 0.25})
  graphdef, _, _ = state_lib.abstract_state(cfg, moe, mesh_2x4)
  params, rest = state_lib.init_state(cfg, moe, mesh_2x4)
  tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, V)
  _, aux = jax.jit(lambda p, t: nnx.merge(graphdef, p, rest)(t))(params, tokens)
  assert aux["tokens_overflowed"].shape == (1,) and int(aux["tokens_overflowed"][0]) > 0
  assert int(aux["tokens_dropped"][0]) == 0
  assert int(aux["expert_counts"].sum() + aux["tokens_overflowed"].sum()) == 8 * 16


def test_shapes_aux_and_moe_every_other_layer(model):
  tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, V)
  logits, aux = model(tokens)
  assert logits.shape == (8, 16, V) and logits.dtype == jnp.float32
  assert aux["expert_counts"].shape == (1, 8) and aux["tokens_dropped"].shape == (1,)
  assert int(aux["expert_counts"].sum() + aux["tokens_dropped"].sum()) == 8 * 16
  assert int(aux["tokens_overflowed"].sum()) == 0  # worst-case buffers
  assert float(aux["aux_loss"]) > 0
  # Freshly initialised logits are small: the loss starts near log V.
  assert abs(float(jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])) - np.log(V)) < 0.5
  positions = jnp.tile(jnp.array([[3, 0, 7]]), (8, 1))
  picked, _ = model(tokens, positions)
  np.testing.assert_allclose(picked, logits[:, [3, 0, 7]], rtol=1e-5, atol=1e-5)
  kinds = [type(layers.layer_module(model.model, i).ffn).__name__ for i in range(2)]
  assert kinds == ["DenseFFN", "MoEFFN"]


def test_head_is_tied_to_the_embeddings(model):
  shapes = [x.shape for x in jax.tree.leaves(model.params)]
  assert shapes.count((V, D)) == 1  # no separate output matrix
  tokens = jax.random.randint(jax.random.key(2), (8, 16), 0, V - 1)  # token V - 1 is never an input
  logits, _ = model(tokens)
  params = jax.tree.map(lambda x: x, model.params)
  params["embed"]["embedding"] = params["embed"]["embedding"].at[V - 1].add(1.0)
  moved, _ = model(tokens, params=params)
  changed = np.abs(np.asarray(moved - logits)).max(axis=(0, 1)) > 1e-6
  assert changed[V - 1] and not changed[: V - 1].any()


def test_decoder_is_causal_and_encoder_is_not(model, decoder):
  tokens = jax.random.randint(jax.random.key(3), (8, 16), 0, V)
  for built, causal in ((model, False), (decoder, True)):
    logits, aux = built(tokens)
    assert logits.shape == (8, 16, V) and aux["expert_counts"].shape == (1, 8)
    edited, _ = built(tokens.at[:, 10].set((tokens[:, 10] + 1) % V))
    change = np.abs(np.asarray(edited - logits))
    assert (change[:, :10].max() == 0) == causal
    assert change[:, 10:].max() > 1e-4


def test_experts_sharded_dense_parameters_replicated(model):
  specs = param_specs(model.params, model.moe_cfg)
  path, r = layers.where(model.cfg)[1]  # scanned: a segment's leaves [R, ...], the layer axis never sharded
  stacked = () if r is None else (None,)
  moe_specs = layers.subtree(specs, path, None)["ffn"]["moe"]
  assert moe_specs["w_in"] == P(*stacked, AXES) and moe_specs["w_out"] == P(*stacked, AXES)
  for path_, spec in jax.tree_util.tree_flatten_with_path(specs)[0]:
    name = jax.tree_util.keystr(path_)
    if "'w_in'" in name and "moe" in name or "'w_out'" in name and "moe" in name:
      continue
    assert all(entry is None for entry in spec), name
  w_in = layers.subtree(model.params, path, None)["ffn"]["moe"]["w_in"]
  assert w_in.sharding.spec == P(*stacked, AXES) and w_in.addressable_shards[0].data.shape == (
    *(1,) * len(stacked),
    1,
    D,
    F,
  )


def test_invalid_model_configs_name_the_field(mesh_2x4):
  with pytest.raises(ConfigError, match="num_heads"):
    ModelConfig(kind="bert", vocab_size=V, num_layers=1, d_model=30, num_heads=4, d_ff=F, max_len=8)
  with pytest.raises(ConfigError, match="kind"):
    ModelConfig(kind="t5", vocab_size=V, num_layers=1, d_model=D, num_heads=4, d_ff=F, max_len=8)
  cfg, _ = _configs("bert")
  with pytest.raises(ConfigError, match="d_ff"):
    LanguageModel(cfg, MoEConfig(num_experts=8, top_k=1, d_model=D, d_ff=2 * F), mesh_2x4, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("size,billions", [("3.7b", 3.7), ("13b", 13), ("48b", 48)])
@pytest.mark.sampled(1)
def test_paper_sizes(devices, size, billions):
  from configs import mlm
  from moejax.train import config as config_lib

  config = mlm.get_config(size)
  model_cfg, moe_cfg = config_lib.validate(config)
  assert (config.batch_size, config.seq_len, moe_cfg.num_experts) == (16384, 128, 128)
  assert config.batch_size // config.micro_batches // 128 == mlm.SIZES[size][-1]  # micro-batch per GPU
  mesh = mesh_lib.make_mesh(1, 1)  # the shapes do not depend on the mesh; 128 experts on one device
  abstract = nnx.eval_shape(lambda: LanguageModel(model_cfg, moe_cfg, mesh, rngs=nnx.Rngs(0)))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert abs(count / 1e9 - billions) / billions < 0.03, count


@pytest.mark.parametrize("kind,esp_schedule", [("gpt", None), ("bert", "s2")])
@pytest.mark.slow
def test_tensor_parallel_gives_the_data_parallel_losses_and_gradients(mesh_2x4, kind, esp_schedule):
  """Megatron tensor parallelism over 'gpu' (heads and the dense FFN split, activations replicated
  over 'gpu'; with an expert-sharded MoE layer, Parm's setting): same loss and gradients as data
  parallelism, and the dense kernels really are split over 'gpu'."""
  cfg, moe = _configs(kind)
  cfg = ModelConfig(**{**cfg.__dict__, "dropout": 0.0})
  moe = MoEConfig(**{**moe.__dict__, "capacity_factor": 8.0, "esp_schedule": esp_schedule})
  tokens = jax.random.randint(jax.random.key(3), (8, 16), 0, V)
  results = []
  for tensor_parallel in (False, True):
    model_cfg = ModelConfig(**{**cfg.__dict__, "tensor_parallel": tensor_parallel})
    graphdef, _, _ = state_lib.abstract_state(model_cfg, moe, mesh_2x4)
    params, rest = state_lib.init_state(model_cfg, moe, mesh_2x4)

    def loss(params):
      logits, aux = nnx.merge(graphdef, params, rest)(tokens)
      logp = jax.nn.log_softmax(logits)
      return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1)) + aux["aux_loss"]

    results.append(jax.jit(jax.value_and_grad(loss))(params))
    path, r = layers.where(model_cfg)[0]
    kernel = layers.subtree(params, path, None)["attn"]["qkv"]["kernel"]
    stacked = () if r is None else (None,)
    assert kernel.sharding.spec == (P(*stacked, None, None, "gpu", None) if tensor_parallel else P(*stacked))
  (loss_dp, grads_dp), (loss_tp, grads_tp) = results
  np.testing.assert_allclose(float(loss_tp), float(loss_dp), rtol=1e-5)
  for g_tp, g_dp in zip(jax.tree.leaves(grads_tp), jax.tree.leaves(grads_dp)):
    np.testing.assert_allclose(np.asarray(g_tp), np.asarray(g_dp), rtol=1e-4, atol=1e-6)


def test_tensor_parallel_needs_heads_divisible_by_the_gpus(mesh_2x4):
  cfg, moe = _configs("gpt")
  cfg = ModelConfig(**{**cfg.__dict__, "num_heads": 2, "tensor_parallel": True})
  with pytest.raises(ConfigError, match="num_heads=2.*4 GPUs per node"):
    state_lib.abstract_state(cfg, moe, mesh_2x4)
