"""DeepSeek-V4 against transformers: mHC layers (`moejax.models.hyper_block`: 4 residual streams, each sublayer behind
a hyper-connection, the hyper head before the final norm) around sliding, CSA and HCA attention ('deepseek_v4' mixer,
`moejax.models.deepseek_v4_mixer`), hash-routed MoE layers (`DecoderConfig.hash_layers`: the checkpoint's tid2eid)
then sqrtsoftplus top-k ones with the gate's bias, a shared expert, the clamped SwiGLU. The fixture
(tests/data/hf/deepseek_v4, transformers' DeepseekV4ForCausalLM under the published names) gives its logits and
routers' choices (the hash layers' included) on the 2 x 4 mesh, unrolled and scanned. What is not wired yet is refused
by name: the decode cache (its state is not one (c1, c2) pair per layer) and the export (tid2eid is state)."""

import pytest

from moejax import infer
from moejax.models import hf_checkpoint
from moejax.validation import ConfigError
from tests.hf_family_checks import check_against_reference, from_hf_under
from tests.test_hf_models import group, reference

FAMILY = "deepseek_v4"
pytestmark = group(FAMILY)


@pytest.fixture(scope="module")
def unrolled(mesh_2x4):
  return from_hf_under(FAMILY, mesh_2x4, {}, model={"scan_layers": False})


def test_logits_and_routing_equal_transformers_unrolled(unrolled):
  """Logits at 1e-4 relative (fp32), every layer's experts (the hash layers' by tid2eid) the fixture's."""
  check_against_reference(unrolled, reference(FAMILY))


def test_logits_and_routing_equal_transformers_scanned(mesh_2x4):
  """Scanned: each layer its own segment (the layer types, hash and top-k layers differ in their arrays' shapes)."""
  model = from_hf_under(FAMILY, mesh_2x4, {}, model={"scan_layers": True})
  check_against_reference(model, reference(FAMILY))


def test_the_config_and_the_hash_tables_read(unrolled):
  cfg, moe_cfg = unrolled.cfg, unrolled.moe_cfg
  assert cfg.mixers == ("deepseek_v4",) * 4 and cfg.hash_layers == (True, True, False, False)
  assert (moe_cfg.score, moe_cfg.activation, moe_cfg.swiglu_limit) == ("sqrtsoftplus", "swiglu_clamped_v4", 0.5)
  kinds = [block.attn.config.layer_type for block in unrolled.blocks]
  assert kinds == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] + kinds[1:2]
  table = unrolled.blocks[0].ffn.moe.hash_table[...]
  assert table.shape == (96, 2) and int(table.min()) >= 0 and int(table.max()) < 8
  assert unrolled.blocks[2].ffn.moe.hash_table is None


def test_decoding_and_export_refused_by_name(unrolled, tmp_path):
  """The pieces exist (`deepseek_v4_attention.decode`), the wiring into moejax's cache does not: refused, not wrong."""
  prompt = reference(FAMILY)["prompt"]
  with pytest.raises(ConfigError, match="cache"):
    infer.generate_tokens(unrolled, prompt, 2)
  with pytest.raises(ConfigError, match="to_hf"):
    hf_checkpoint.to_hf(unrolled, str(tmp_path / "out"))
