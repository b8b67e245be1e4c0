"""Upcycling the dense Hugging Face decoders (Llama, Qwen3) into MoE models (`moejax.models.upcycle`).

At step 0 the upcycled model's output is the dense model's, whatever its random router picks: every expert is a
copy of the layer's FFN (granular: a slice of one, its down projection scaled up), and the combine weights of a
token's copies sum to one. The router still spreads the tokens over the experts, and the model exports as its MoE
family's checkpoint where that family's config.json can say it.
"""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

import moejax.models as models
from moejax.models import layers as layers_lib
from moejax.validation import ConfigError
from tests.helpers import ROOT, relative_error

DATA = ROOT / "tests" / "data" / "hf"
DENSE = ("llama_dense", "qwen3_dense")
MOE_FAMILY = {"llama_dense": "mixtral", "qwen3_dense": "qwen3_moe"}
TOL = 1e-5


def group(family: str):
  return pytest.mark.xdist_group(f"upcycle_{family}")


class Dense:
  """Each dense model, fresh random tokens (not the fixture's) and its logits of them, made on first use."""

  def __init__(self, mesh):
    self.mesh, self.cache = mesh, {}

  def __call__(self, family: str):
    if family not in self.cache:
      model = models.from_hf(str(DATA / family), self.mesh)
      vocab = model.cfg.vocab_size
      tokens = np.random.default_rng(7).integers(0, vocab, (self.mesh.size, 12)).astype(np.int32)
      logits, _ = model(tokens)
      self.cache[family] = model, tokens, np.asarray(logits)
    return self.cache[family]


@pytest.fixture(scope="module")
def dense(mesh_2x4):
  return Dense(mesh_2x4)


def params(model) -> dict:
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


# (num_experts, top_k, granularity): sparse (every expert a whole copy) and granular (copies split in g slices).
COMBOS = [(8, 2, 1), (8, 1, 2), (8, 2, 4), (16, 4, 1), (16, 1, 4)]
FAST = ("qwen3_dense", (8, 1, 2))
CASES = [
  pytest.param(
    f,
    *combo,
    marks=[group(f)] + ([] if (f, combo) == FAST else [pytest.mark.slow]),
    id=f"{f}-E{combo[0]}-k{combo[1]}-g{combo[2]}",
  )
  for f in DENSE
  for combo in COMBOS
]


@pytest.mark.parametrize("family, num_experts, top_k, g", CASES)
@pytest.mark.slow
def test_upcycled_output_equals_dense(dense, family, num_experts, top_k, g):
  model, tokens, want = dense(family)
  moe = models.upcycle(model, num_experts=num_experts, top_k=top_k, granularity=g)
  assert moe.cfg.family == MOE_FAMILY[family] and moe.cfg.num_moe_layers == model.cfg.num_layers
  assert (moe.moe_cfg.num_experts, moe.moe_cfg.top_k, moe.moe_cfg.d_ff) == (
    num_experts * g,
    top_k * g,
    model.cfg.d_ff // g,
  )
  logits, aux = moe(tokens, details=True)
  assert relative_error(np.asarray(logits), want) < TOL

  # the experts are the dense FFN's copies (slices), the rest of the model the dense model's
  source, upcycled = params(model), params(moe)
  for name in ("embed", "norm", "lm_head"):
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(source[name]), jax.tree.leaves(upcycled[name])))
  for block, moe_block in zip(layers_lib.per_layer(source, model.cfg), layers_lib.per_layer(upcycled, moe.cfg)):
    ffn, layer = block["ffn"], moe_block["ffn"]["moe"]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(block["attn"]), jax.tree.leaves(moe_block["attn"])))
    width = model.cfg.d_ff // g
    for e in range(num_experts * g):
      j = e % g  # expert c * g + j: slice j of copy c
      cols = slice(j * width, (j + 1) * width)
      np.testing.assert_array_equal(layer["w_gate"][e], ffn["gate_proj"]["kernel"][:, cols])
      np.testing.assert_array_equal(layer["w_in"][e], ffn["up_proj"]["kernel"][:, cols])
      np.testing.assert_allclose(layer["w_out"][e], g * ffn["down_proj"]["kernel"][cols], rtol=0, atol=0)

  # the experts are used, and not all alike
  counts, ids = np.asarray(aux["expert_counts"]), np.asarray(aux["expert_ids"])  # [M, E], [M, T, K]
  layers, num_tokens = model.cfg.num_layers, tokens.size
  assert counts.shape == (layers, num_experts * g) and ids.shape == (layers, num_tokens, top_k * g)
  np.testing.assert_array_equal(counts.sum(axis=1), num_tokens * top_k * g)
  for m in range(layers):
    copies = counts[m].reshape(num_experts, g)
    assert np.all(copies == copies[:, :1])  # a chosen copy brings all its slices
    assert np.count_nonzero(copies[:, 0]) >= min(num_experts, 4)  # spread over several copies
    assert copies[:, 0].max() < num_tokens  # no copy takes every token
    chosen = np.sort(ids[m], axis=-1).reshape(num_tokens, top_k, g)
    assert np.all(chosen // g == chosen[..., :1] // g) and np.all(chosen % g == np.arange(g))
    assert len({tuple(row.ravel()) for row in chosen}) > 1  # tokens choose differently


@pytest.mark.slow
@group("qwen3_dense")
def test_upcycling_some_layers_with_a_path(dense):
  model, tokens, want = dense("qwen3_dense")
  moe = models.upcycle(model, num_experts=8, top_k=2, layers=(1,), moe={"path": "gpu_first"})
  assert moe.cfg.moe_layers == (False, True) and moe.moe_cfg.path == "gpu_first"
  logits, aux = moe(tokens)
  assert relative_error(np.asarray(logits), want) < TOL
  assert np.asarray(aux["expert_counts"]).shape == (1, 8) and np.count_nonzero(np.asarray(aux["expert_counts"])) > 1
  source, upcycled = params(model), params(moe)
  assert all(
    np.array_equal(a, b)
    for a, b in zip(
      jax.tree.leaves(layers_lib.per_layer(source, model.cfg)[0]),
      jax.tree.leaves(layers_lib.per_layer(upcycled, moe.cfg)[0]),
    )
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "family",
  [pytest.param("llama_dense", marks=group("llama_dense")), pytest.param("qwen3_dense", marks=group("qwen3_dense"))],
)
def test_upcycled_export_round_trip(dense, tmp_path, family):
  model, tokens, want = dense(family)
  moe = models.upcycle(model, num_experts=8, top_k=2)
  out = str(tmp_path / "export")
  models.to_hf(moe, out)
  config = json.loads(open(os.path.join(out, "config.json")).read())
  assert config["model_type"] == MOE_FAMILY[family]
  assert config["num_experts_per_tok"] == 2
  assert config.get("num_local_experts", config.get("num_experts")) == 8
  back = models.from_hf(out, model.mesh)
  assert back.cfg.family == MOE_FAMILY[family]
  got, have = params(back), params(moe)
  paths = lambda tree: [p for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  assert paths(got) == paths(have)
  for path, a, b in zip(paths(got), jax.tree.leaves(got), jax.tree.leaves(have)):
    assert a.dtype == b.dtype and np.array_equal(a, b), jax.tree_util.keystr(path)
  logits, _ = back(tokens)
  assert relative_error(np.asarray(logits), want) < TOL


@pytest.mark.slow
@group("qwen3_dense")
def test_partly_upcycled_qwen3_exports_its_dense_layers(dense, tmp_path):
  model, tokens, want = dense("qwen3_dense")
  out = str(tmp_path / "export")
  models.to_hf(models.upcycle(model, num_experts=8, top_k=2, layers=(1,)), out)
  assert json.loads(open(os.path.join(out, "config.json")).read())["mlp_only_layers"] == [0]
  back = models.from_hf(out, model.mesh)
  assert back.cfg.moe_layers == (False, True)
  assert relative_error(np.asarray(back(tokens)[0]), want) < TOL


@pytest.mark.slow
@group("llama_dense")
def test_granular_export_refused(dense, tmp_path):
  model, _, _ = dense("llama_dense")
  with pytest.raises(ConfigError) as error:
    models.to_hf(models.upcycle(model, num_experts=8, top_k=1, granularity=2), str(tmp_path / "export"))
  assert "moe.num_groups" in str(error.value)


@group("llama_dense")
def test_refused_export_writes_nothing(dense, tmp_path):
  model, _, _ = dense("llama_dense")
  with pytest.raises(ConfigError):
    models.to_hf(models.upcycle(model, num_experts=8, top_k=1, granularity=2), str(tmp_path / "export"))
  assert not os.path.exists(tmp_path / "export") or os.listdir(tmp_path / "export") == []


@group("llama_dense")
def test_partly_upcycled_mixtral_export_refused(dense, tmp_path):
  model, _, _ = dense("llama_dense")
  with pytest.raises(ConfigError) as error:
    models.to_hf(models.upcycle(model, num_experts=8, top_k=2, layers=(1,)), str(tmp_path / "export"))
  assert "moe_layers" in str(error.value)


@pytest.mark.parametrize(
  "kwargs, field",
  [
    ({"granularity": 5}, "granularity"),
    ({"granularity": 0}, "granularity"),
    ({"granularity": 2.0}, "granularity"),
    ({"layers": (2,)}, "layers"),
    ({"num_experts": 6}, "num_experts"),
    ({"top_k": 9}, "moe.top_k"),
  ],
)
@group("llama_dense")
def test_bad_upcycling_refused(dense, kwargs, field):
  model, _, _ = dense("llama_dense")
  with pytest.raises(ConfigError) as error:
    models.upcycle(model, **{"num_experts": 8, "top_k": 2, **kwargs})
  assert field in str(error.value)


def test_moe_family_refused(mesh_2x4):
  with pytest.raises(ConfigError) as error:
    models.upcycle(models.from_hf(str(DATA / "mixtral"), mesh_2x4), num_experts=8, top_k=2)
  assert "family" in str(error.value) and "mixtral" in str(error.value)
