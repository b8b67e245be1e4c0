"""ExFlow's decode with zero-computation experts (LongCat-Flash's `zero_experts`): a zero expert's choice is the token
itself, added where the token is, and the row stays there for that choice. Against the vanilla decode (the training
layer's exchange) on every path, with and without dedup, and the rows moved against a count from the routed ids."""

import numpy as np
import pytest
from flax import nnx

from moejax.infer import decode
from moejax.models.config import ModelConfig
from moejax.models.language_model import LanguageModel
from moejax.moe import path as path_lib
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib

E, Z, V = 8, 3, 96


def _model(top_k: int, **moe_fields) -> LanguageModel:
  """A GPT of 2 blocks (the second's FFN the MoE layer) on 2 x 4 devices, E real experts (one a device) and Z zero."""
  cfg = ModelConfig(kind="gpt", vocab_size=V, num_layers=2, d_model=32, num_heads=4, d_ff=64, max_len=16)
  moe_cfg = MoEConfig(num_experts=E, top_k=top_k, d_model=32, d_ff=64, zero_experts=Z, **moe_fields)
  return LanguageModel(cfg, moe_cfg, mesh_lib.make_mesh(2, 4), rngs=nnx.Rngs(1))


def _prompts(seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, V, (8, 5)).astype(np.int32)


@pytest.mark.parametrize("path", path_lib.PATHS)
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.sampled(1)
def test_exflow_equals_vanilla_with_zero_experts(devices, path, dedup):
  model = _model(2, path=path, dedup=dedup)
  prompts = _prompts(2)
  _, aux = model(prompts, details=True)
  chosen = np.asarray(aux["expert_ids"])
  assert 0 < np.mean(chosen >= E) < 1  # zero and real experts both chosen
  vanilla = decode.generate(model, prompts, 4, mode="vanilla")
  exflow = decode.generate(model, prompts, 4, mode="exflow")
  np.testing.assert_allclose(exflow.logits, vanilla.logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(exflow.tokens, vanilla.tokens)


def test_a_zero_experts_choice_moves_no_row(devices):
  """Top-1, flat path, one MoE layer: each decode step's row starts on its request's device and moves only where its
  choice is a real expert on another device; the rows ExFlow reports moving are exactly those, counted from the
  choices the full forward makes at the decoded positions."""
  model, prompts, steps = _model(1, path="flat"), _prompts(3), 4
  out = decode.generate(model, prompts, steps, mode="exflow")
  tokens = np.concatenate([prompts, out.tokens], axis=1)
  _, aux = model(tokens[:, :-1], details=True)
  batch, length = tokens[:, :-1].shape
  ids_BxS = np.asarray(aux["expert_ids"])[0, :, 0].reshape(batch, length)
  decoded = ids_BxS[:, prompts.shape[1] : prompts.shape[1] + steps - 1]  # the positions the decode steps ran
  home = np.arange(batch)[:, None] // (batch // 8)  # request r on flat device r // (B / D); expert e on device e
  want = int(np.sum((decoded < E) & (decoded != home)))
  assert 0 < np.sum(decoded >= E) and 0 < want  # both kinds of choice among the decoded tokens
  moved = sum(out.exchange_rows.values()) * batch * (steps - 1)
  assert round(moved) == want
