"""The decoder families laid out over the mesh as their users would: Megatron-style tensor parallelism of the
attention heads and the dense FFN over 'gpu', FSDP of the dense parameters, and both, each giving transformers'
logits (the fixtures of tests/data/hf), with the parameters really split."""

import jax
import numpy as np
import pytest
from flax import nnx

import moejax.models
from moejax.models import layers
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError
from tests.helpers import ROOT

DATA = ROOT / "tests" / "data" / "hf"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("layout", [dict(tensor_parallel=True), dict(fsdp=True), dict(tensor_parallel=True, fsdp=True)])
def test_tensor_parallel_and_fsdp_give_transformers_logits(devices, family, layout):
  """On 4 nodes x 2 GPUs (GQA's 2 key/value heads split over 2 GPUs): logits within 1e-4 of transformers'; a query
  projection split over 'gpu' by heads with tensor parallelism, the embedding sharded over the data-parallel
  devices with FSDP (both axes, or 'node' alone beside tensor parallelism)."""
  mesh = mesh_lib.make_mesh(4, 2)
  model = moejax.models.from_hf(str(DATA / family), mesh, model=layout)
  ref = np.load(DATA / family / "reference.npz")
  logits = np.asarray(jax.jit(lambda t: model(t)[0])(np.tile(ref["tokens"], (4, 1))))
  for copy in range(4):
    got = logits[2 * copy : 2 * copy + 2]
    assert np.linalg.norm(got - ref["logits"]) / np.linalg.norm(ref["logits"]) < 1e-4
  path, r = layers.where(model.cfg)[0]  # scanned: the segment's stacked kernel [R, d, heads], R never sharded
  attn = layers.subtree(nnx.to_pure_dict(nnx.state(model, nnx.Param)), path, None)["attn"]
  spec = attn["q_proj" if family == "qwen2_moe" else "q_b_proj"]["kernel"].sharding.spec
  lead = 0 if r is None else 1
  assert tuple(spec)[:lead] == (None,) * lead, spec
  assert (tuple(spec)[lead + 1 : lead + 2] == (mesh_lib.GPU,)) == layout.get("tensor_parallel", False), spec
  embed = model.embed.embedding[...].sharding.spec
  want = (mesh_lib.NODE if layout.get("tensor_parallel") else mesh_lib.AXES) if layout.get("fsdp") else None
  assert (tuple(embed) + (None,))[0] == want, embed


def test_tensor_parallel_needs_key_value_heads_divisible_by_the_gpus(devices):
  with pytest.raises(ConfigError, match="num_kv_heads=2"):
    moejax.models.from_hf(str(DATA / "qwen3_moe"), mesh_lib.make_mesh(2, 4), model=dict(tensor_parallel=True))


def test_unknown_model_field_is_named(devices):
  with pytest.raises(ConfigError, match="tensor_paralel"):
    moejax.models.from_hf(str(DATA / "qwen3_moe"), mesh_lib.make_mesh(2, 4), model=dict(tensor_paralel=True))
