"""DeepSeek-V4 against transformers: mHC layers (`moejax.models.hyper_block`: 4 residual streams, each sublayer behind
a hyper-connection, the hyper head before the final norm) around sliding, CSA and HCA attention ('deepseek_v4' mixer,
`moejax.models.deepseek_v4_mixer`), hash-routed MoE layers (`DecoderConfig.hash_layers`: the checkpoint's tid2eid)
then sqrtsoftplus top-k ones with the gate's bias, a shared expert, the clamped SwiGLU. The fixture
(tests/data/hf/deepseek_v4, transformers' DeepseekV4ForCausalLM under the published names) gives its logits and
routers' choices (the hash layers' included) on the 2 x 4 mesh, unrolled and scanned; greedy decoding through the cache
(the window's keys, the compressors' state) gives transformers' tokens and the full forward's logits; the export is
the fixture bit for bit."""

import numpy as np
import pytest

from moejax.infer import decode
from tests.helpers import relative_error
from tests.hf_family_checks import (
  check_against_reference,
  check_export_refuses,
  check_round_trip,
  config,
  from_hf_under,
)
from tests.test_hf_models import group, reference, tiled

FAMILY = "deepseek_v4"
pytestmark = group(FAMILY)


@pytest.fixture(scope="module")
def unrolled(mesh_2x4):
  return from_hf_under(FAMILY, mesh_2x4, {}, model={"scan_layers": False})


def test_logits_and_routing_equal_transformers_unrolled(unrolled):
  """Logits at 1e-4 relative (fp32), every layer's experts (the hash layers' by tid2eid) the fixture's."""
  check_against_reference(unrolled, reference(FAMILY))


OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}


@pytest.fixture(scope="module")
def scanned(mesh_2x4):
  return from_hf_under(FAMILY, mesh_2x4, OTHER_PATH, model={"scan_layers": True})


def test_logits_and_routing_equal_transformers_scanned_under_another_path(scanned):
  """Scanned, each layer its own segment (the layer types, hash and top-k layers differ in their arrays' shapes), the
  exchange node first then GPU with each token's rows deduplicated."""
  check_against_reference(scanned, reference(FAMILY))


def test_the_config_and_the_hash_tables_read(unrolled):
  cfg, moe_cfg = unrolled.cfg, unrolled.moe_cfg
  assert cfg.mixers == ("deepseek_v4",) * 4 and cfg.hash_layers == (True, True, False, False)
  assert (moe_cfg.score, moe_cfg.activation, moe_cfg.swiglu_limit) == ("sqrtsoftplus", "swiglu_clamped_v4", 0.5)
  kinds = [block.attn.config.layer_type for block in unrolled.blocks]
  assert kinds == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] + kinds[1:2]
  table = unrolled.blocks[0].ffn.moe.hash_table[...]
  assert table.shape == (96, 2) and int(table.min()) >= 0 and int(table.max()) < 8
  assert unrolled.blocks[2].ffn.moe.hash_table is None


@pytest.mark.parametrize(
  "mode, scan", [("vanilla", False), ("exflow", True)], ids=["vanilla-unrolled", "exflow-scanned"]
)
def test_greedy_generation_matches_transformers_and_the_full_forward(unrolled, scanned, mode, scan):
  """12 greedy steps after a 5-token prompt: past the window (4), through CSA's entries (rate 4, more than its index_topk
  of 2: the indexer chooses) and HCA's (rate 8). Each step's logits are the full forward's over the tokens so far; the
  tokens are transformers' generate's. ExFlow's rows carry their 4 streams through the hops (the experts see one)."""
  model = scanned if scan else unrolled
  ref = reference(FAMILY)
  prompt = tiled(ref["prompt"])
  out = decode.generate(model, prompt, ref["greedy"].shape[1] - prompt.shape[1], mode=mode)
  tokens = np.concatenate([prompt, out.tokens], axis=1)
  np.testing.assert_array_equal(tokens[: len(ref["greedy"])], ref["greedy"])
  full = np.asarray(model(tokens[:, :-1])[0])[:, prompt.shape[1] - 1 :]
  assert relative_error(out.logits, full) < 1e-5


def test_export_is_the_fixture_bit_for_bit_and_loads_back(scanned, mesh_2x4, tmp_path):
  """Scanned (each layer's tensors sliced from its segment's), to_hf writes transformers' names and tensors bit for bit (the hash layers' tid2eid as int64 from the table's
  state) and config.json's fields as transformers wrote them; loaded again, the same parameters and state."""
  fields = ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "hc_mult", "index_topk")
  fields += ("sliding_window", "swiglu_limit", "scoring_func", "n_routed_experts", "num_experts_per_tok", "o_groups")
  fields += ("num_key_value_heads", "routed_scaling_factor", "n_shared_experts", "moe_intermediate_size")
  check_round_trip(scanned, tmp_path, FAMILY, mesh_2x4, fields)


@pytest.mark.parametrize(
  "field, value", [("moe.activation", "silu"), ("moe_layers", (False, True, True, True)), ("d_model", 48)]
)
def test_export_refuses_what_its_config_cannot_say(field, value):
  check_export_refuses(config(FAMILY), field, value)
