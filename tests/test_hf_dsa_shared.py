"""GLM-5's shared DSA layers (indexer_types 'shared': the 'dsa_shared' mixer reusing the last full layer's top-k, which
the layers pass on beside the activations, `sparse_attention.Stream`) beyond tests/test_hf_dsa.py's family checks of
the glm_moe_dsa_shared fixture (transformers' GlmMoeDsaForCausalLM, [full, shared] x 2): greedy tokens unrolled,
indexer_types read as GlmMoeDsaConfig derives them and written back, what stays refused by name (a first 'shared'
layer), ExFlow's decode, and training through a 1F1B pipeline (its stages beginning at a full or a shared layer) and
the two-batch step as the plain step.
"""

import dataclasses
import sys

import pytest

from moejax.models import hf_config
from moejax.pipeline import section as pipeline_section
from moejax.pipeline import staging
from moejax.validation import ConfigError
from tests import step_checks
from tests.helpers import ROOT
from tests.hf_family_checks import check_greedy_generation, config, from_hf_under
from tests.test_hf_models import DATA, Loaded, edit_config, fixture_copy, refused

sys.path.insert(0, str(ROOT))
from configs import decoder  # noqa: E402

SHARED = "glm_moe_dsa_shared"  # GLM-5's indexer_types [full, shared, full, shared]


@pytest.fixture(scope="module")
def loaded(mesh_2x4):
  return Loaded(mesh_2x4)


@pytest.mark.slow
def test_shared_layers_unrolled_decode_and_exflow(loaded, mesh_2x4):
  """GLM-5's shared layers unrolled: greedy tokens through the cache (each shared layer's cache MLA's pair, without
  indexer keys) are transformers', and so are ExFlow's, scanned and unrolled (each row's choice of keys travels in
  its hops beside it, to the device where its shared layer runs)."""
  model = from_hf_under(SHARED, mesh_2x4, {}, model={"scan_layers": False})
  assert model.cfg.mixers == ("dsa", "dsa_shared") * 2 and model.blocks[1].attn.indexer is None
  check_greedy_generation(model, SHARED)
  check_greedy_generation(model, SHARED, mode="exflow")
  check_greedy_generation(loaded.model(SHARED), SHARED, mode="exflow")


@pytest.mark.slow
@pytest.mark.parametrize(
  "fields, mixers",
  [
    ({"indexer_types": ["full", "shared", "shared"]}, ("dsa", "dsa_shared", "dsa_shared")),
    ({"indexer_types": None, "index_topk_freq": 2}, ("dsa", "dsa", "dsa_shared")),  # offset 2: layers 0, 1 full
    ({"indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 1}, ("dsa", "dsa_shared", "dsa")),
    ({"indexer_types": None, "index_topk_pattern": "FSF"}, ("dsa", "dsa_shared", "dsa")),
  ],
)
def test_glm_indexer_types_read_as_glm_moe_dsa_config_derives_them(fields, mixers):
  """indexer_types, else index_topk_pattern, else index_topk_freq / index_skip_topk_offset: 'shared' layers are
  'dsa_shared' mixers; the export writes them back as indexer_types."""
  cfg, moe_cfg = hf_config.from_hf_config({**config("glm_moe_dsa"), **fields})
  assert cfg.mixers == mixers
  kinds = {"dsa": "full", "dsa_shared": "shared"}
  assert hf_config.to_hf_config(cfg, moe_cfg)["indexer_types"] == [kinds[m] for m in mixers]


@pytest.mark.slow
@pytest.mark.parametrize(
  "fields",
  [
    {"indexer_types": ["shared", "full", "full"]},  # transformers fails at run time: no earlier full layer
    {"indexer_types": None, "index_topk_pattern": "SFF"},
    {"indexer_types": ["full", "sparse", "full"]},
    {"indexer_types": ["full", "shared"]},
  ],
)
def test_glm_indexer_types_refused(tmp_path, mesh_2x4, fields):
  """A first layer 'shared' (nothing to reuse), an unknown kind or a list of another length: refused by name."""
  directory = fixture_copy(tmp_path, "glm_moe_dsa")
  edit_config(directory, **fields)
  assert "indexer_types" in refused(directory, mesh_2x4)


@pytest.mark.slow
def test_pipeline_splits_at_shared_layers():
  """A stage passes the choice on beside the activations: published GLM-5's unit [shared, full] may begin the stages,
  as [full, shared] may; a split that does not divide the repeats is still refused naming the stages."""
  cfg, _ = hf_config.from_hf_config(config(SHARED))
  layers = lambda mixers: dataclasses.replace(
    cfg, num_layers=len(mixers), mixers=mixers, moe_layers=(False,) + (True,) * (len(mixers) - 1)
  )
  assert staging.staged_segment(layers(("dsa",) + ("dsa", "dsa_shared") * 4), 2, "1f1b") == 1
  assert staging.staged_segment(layers(("dsa",) + ("dsa_shared", "dsa") * 4), 2, "1f1b") == 1
  with pytest.raises(ConfigError, match="pipeline.stages"):
    staging.staged_segment(layers(("dsa",) + ("dsa_shared", "dsa") * 3), 2, "1f1b")


# ---------------------------------------------------------------------------------------------------------------
# Training with shared layers: the pipeline's stages and the two-batch step


# The units the stages begin with: [full, shared] x 4 (the fixture's), or published GLM-5's [shared, full] x 4 after a
# dense full layer (on the first stage: each stage begins at a shared layer, reading the choice the stage before sent).
FULL_FIRST = (("dsa", "dsa_shared") * 4, (True,) * 8)
SHARED_FIRST = (("dsa",) + ("dsa_shared", "dsa") * 4, (False,) + (True,) * 8)


def _shared_training_config(micro: int, pipeline: dict, layers=FULL_FIRST):
  """GLM-5's shared fixture's config (random init) with `layers` (mixers, moe_layers) on 1 x 4 devices, 16 rows in
  `micro` micro-batches, all-to-all exchanges with nothing dropped (`tests/test_pipeline_decoder.py`'s)."""
  config = decoder.get_config(f"hf={DATA / SHARED}")
  config.init_from = ""
  mixers, moe_layers = layers
  config.model.update(num_layers=len(mixers), mixers=mixers, moe_layers=moe_layers, vocab_size=256)
  config.update(batch_size=16, micro_batches=micro, seq_len=16)
  config.mesh.update(nodes=1, gpus_per_node=4)
  config.moe.update(num_nodes=1, collective="capacity", capacity_factor=4.0)
  config.data.shards = 4
  config.optim.warmup_steps = 1
  config.pipeline = {**pipeline_section.defaults(), **pipeline}
  return config


@pytest.mark.slow
@pytest.mark.parametrize(
  "schedule, stages, micro, layers",
  [("1f1b", 2, 4, FULL_FIRST), ("1f1b", 2, 4, SHARED_FIRST), ("two_batch", 1, 2, FULL_FIRST)],
)
def test_shared_layers_train_pipelined_as_unpipelined(devices, schedule, stages, micro, layers):
  """The step's metrics and every gradient (AdamW's first moment) through a 1F1B pipeline of 2 stages equal the plain
  step's, the stages beginning at a full layer, or at a shared layer (the choice sent beside the activations, its
  gradient none; every schedule's transfers of such a pair: tests/test_pipeline_step.py); the two-batch step's (each
  half's choice beside its activations) equal the plain step's over the halves as micro-batches."""
  config_of = lambda micro, pipeline: _shared_training_config(micro, pipeline, layers)
  step_checks.check_equals_the_plain_step(config_of, schedule, stages, micro)
