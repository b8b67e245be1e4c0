"""The decoder families loaded from Hugging Face checkpoints (`moejax.models.from_hf`) against transformers.

The fixtures under tests/data/hf (tests/fixtures/make_hf_fixtures.py) hold tiny random checkpoints with
transformers' own outputs: logits of `tokens`, the greedy continuation of `prompt`, and every MoE layer's chosen
experts. The model runs on the simulated 2 x 4 mesh, whose batch is sharded over all 8 devices, so the fixtures'
2 rows are tiled 4 times and the first 2 rows of the result compared.

Checked here: logits per family (and under the MoE layer's paths, collectives, schedules, expert sharding, replicas and
expert data parallelism), the routers' choices, greedy and sampled generation (vanilla and ExFlow decoding), the
round trip through `to_hf` (one file and shards with an index), malformed checkpoints refused by name, and bf16.
"""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import moejax.infer as infer
import moejax.models as models
from moejax.models import layers
from moejax.validation import ConfigError
from tests.helpers import ROOT, relative_error

DATA = ROOT / "tests" / "data" / "hf"
MOE_FAMILIES = (
  "mixtral",
  "qwen2_moe",
  "qwen3_moe",
  "deepseek_v2",
  "deepseek_v3",
  "glm4_moe",
  "gpt_oss",
  "dots1",
  "glm4_moe_lite",
  "olmoe",
  "minimax_m2",
)
DENSE_FAMILIES = ("llama_dense", "qwen3_dense")
FAMILIES = MOE_FAMILIES + DENSE_FAMILIES
# Checkpoints as they are published (issue 52); the FP8 export: tests/test_hf_quantized.py.
PUBLISHED = ("deepseek_v3_fp8", "deepseek_v3_no_mtp", "gpt_oss_mxfp4")
# Fixtures whose tensors are all BF16, loaded into bf16 parameters (the same values; written back as BF16).
PARAM_DTYPES = {"gpt_oss": "bfloat16"}
TILE = 4  # the fixtures' 2 rows x 4 = 8, one row per device of the 2 x 4 mesh
TOL = 1e-4


def group(family: str):
  """One xdist worker per family, so its module-scoped model and compiled programs are made once."""
  return pytest.mark.xdist_group(f"hf_{family}")


def case(family: str, *values, slow: bool = True, id: str | None = None):
  marks = [group(family)] + ([pytest.mark.slow] if slow else [])
  return pytest.param(family, *values, marks=marks, id=id)


def reference(family: str) -> dict:
  with np.load(DATA / family / "reference.npz") as ref:
    return dict(ref)


def param_dtype(family: str) -> str:
  return PARAM_DTYPES.get(family, "float32")


def tiled(tokens_BxS: np.ndarray) -> np.ndarray:
  return np.concatenate([tokens_BxS] * TILE)


def fixture_copy(tmp_path, family: str) -> str:
  """A writable copy of a fixture checkpoint (config.json and model.safetensors)."""
  out = tmp_path / family
  out.mkdir()
  for name in ("config.json", "model.safetensors"):
    shutil.copy(DATA / family / name, out / name)
  return str(out)


def model_state(model) -> dict:
  """Every parameter and the loaded state (DeepSeek-V3's balancing bias) as host arrays."""
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
  host = lambda a: np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
  return {"params": jax.tree.map(host, params), "rest": jax.tree.map(host, rest)}


def assert_states_equal(a: dict, b: dict) -> None:
  leaves_a, leaves_b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
  for (path, x), (_, y) in zip(leaves_a, leaves_b):
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert np.array_equal(x, y), jax.tree_util.keystr(path)


class Loaded:
  """Each family's model (default MoE settings, float32) and its forward on the tiled fixture tokens with details,
  made on first use in this worker."""

  def __init__(self, mesh):
    self.mesh, self.models, self.forwards = mesh, {}, {}

  def model(self, family: str):
    if family not in self.models:
      self.models[family] = models.from_hf(str(DATA / family), self.mesh, param_dtype=param_dtype(family))
    return self.models[family]

  def forward(self, family: str):
    if family not in self.forwards:
      logits, aux = self.model(family)(tiled(reference(family)["tokens"]), details=True)
      self.forwards[family] = np.asarray(logits), jax.tree.map(np.asarray, aux)
    return self.forwards[family]


@pytest.fixture(scope="module")
def loaded(mesh_2x4):
  return Loaded(mesh_2x4)


# ---------------------------------------------------------------------------------------------------------------
# Logits and routing against transformers


@pytest.mark.parametrize(
  "family",
  [
    case(f, slow=f not in ("deepseek_v3", "llama_dense", "deepseek_v3_fp8", "gpt_oss_mxfp4"))
    for f in FAMILIES + PUBLISHED
  ],
)
@pytest.mark.sampled(1)
def test_logits_match_transformers(loaded, family):
  ref = reference(family)
  logits, aux = loaded.forward(family)
  assert logits.shape == (2 * TILE, *ref["logits"].shape[1:]) and logits.dtype == np.float32
  for copy in range(TILE):  # every copy of the batch, wherever its rows live on the mesh
    assert relative_error(logits[2 * copy : 2 * copy + 2], ref["logits"]) < TOL, copy
  assert np.all(aux["tokens_dropped"] == 0) and np.all(aux["tokens_overflowed"] == 0)


@pytest.mark.parametrize(
  "family", [case(f, slow=f not in ("deepseek_v3", "gpt_oss_mxfp4")) for f in MOE_FAMILIES + PUBLISHED]
)
def test_router_choices_match_transformers(loaded, family):
  ref = reference(family)
  meta = json.loads((DATA / family / "meta.json").read_text())
  _, aux = loaded.forward(family)
  layers, tokens, top_k = ref["router_ids"].shape
  assert layers == len(meta["moe_layers"]) and top_k == meta["top_k"]
  ids = aux["expert_ids"]  # [M, B * S, K], tokens batch-major: the first copy of the fixture's 2 rows comes first
  assert ids.shape == (layers, TILE * tokens, top_k)
  for copy in range(TILE):
    np.testing.assert_array_equal(np.sort(ids[:, copy * tokens : (copy + 1) * tokens], axis=-1), ref["router_ids"])
  # each layer's counts are the choices of all TILE copies
  counts = np.stack(
    [np.bincount(ref["router_ids"][m].ravel(), minlength=aux["expert_counts"].shape[1]) for m in range(layers)]
  )
  np.testing.assert_array_equal(aux["expert_counts"], TILE * counts)


# Each MoEConfig option on at least one family; DeepSeek-V3 (groups, sigmoid scores with the balancing bias, a
# shared expert) under most of them, Qwen2-MoE (the gated shared expert) and DeepSeek-V2 (group max) under several.
OPTIONS = [
  case("deepseek_v3", {"schedule": "comet", "num_chunks": 2}, slow=False, id="deepseek_v3-comet"),
  case("deepseek_v3", {"collective": "capacity", "capacity_factor": 8.0}, id="deepseek_v3-capacity"),
  case("deepseek_v3", {"esp_schedule": "s1"}, id="deepseek_v3-esp_s1"),
  case("deepseek_v3", {"slots_per_device": 4}, id="deepseek_v3-replicas"),
  case(
    "deepseek_v3",
    {"path": "node_first", "schedule": "chunked", "num_chunks": 2, "buffer_factor": 4.0},
    id="deepseek_v3-node_first_chunked_buffer",
  ),
  case("mixtral", {"expert_data_parallel": True}, id="mixtral-edp"),
  case("qwen2_moe", {"expert_backend": "dense"}, id="qwen2_moe-dense_backend"),
  case(
    "qwen3_moe",
    {"path": "gpu_first", "collective": "capacity", "capacity_factor": 8.0, "dedup": False},
    id="qwen3_moe-gpu_first_capacity_no_dedup",
  ),
  case("deepseek_v2", {"esp_schedule": "s1", "buffer_factor": 4.0}, id="deepseek_v2-esp_s1_buffer"),
  case("glm4_moe", {"path": "node_first", "buffer_factor": 4.0}, id="glm4_moe-node_first_buffer"),
  case("gpt_oss", {"path": "node_first"}, slow=False, id="gpt_oss-node_first"),
  case("gpt_oss_mxfp4", {"path": "gpu_first", "esp_schedule": "s1"}, id="gpt_oss_mxfp4-gpu_first_esp_s1"),
  case("gpt_oss", {"slots_per_device": 3, "schedule": "comet", "num_chunks": 2}, id="gpt_oss-replicas_comet"),
  case("dots1", {"path": "node_first", "dedup": True, "buffer_factor": 4.0}, slow=False, id="dots1-node_first_dedup"),
  case("glm4_moe_lite", {"path": "gpu_first", "esp_schedule": "s1"}, slow=False, id="glm4_moe_lite-gpu_first_esp_s1"),
  case("olmoe", {"path": "node_first", "schedule": "comet", "num_chunks": 2}, slow=False, id="olmoe-node_first_comet"),
  case(
    "minimax_m2",
    {"path": "gpu_first", "schedule": "chunked", "num_chunks": 2, "slots_per_device": 2},
    slow=False,
    id="minimax_m2-gpu_first_chunked_replicas",
  ),
]


@pytest.mark.parametrize("family, moe", OPTIONS)
@pytest.mark.sampled(1)
def test_moe_options_keep_logits_and_routing(mesh_2x4, family, moe):
  ref = reference(family)
  model = models.from_hf(str(DATA / family), mesh_2x4, moe=moe)
  for name, value in moe.items():
    assert getattr(model.moe_cfg, name) == value
  logits, aux = model(tiled(ref["tokens"]), details=True)
  assert relative_error(np.asarray(logits)[:2], ref["logits"]) < TOL
  assert np.all(np.asarray(aux["tokens_dropped"]) == 0) and np.all(np.asarray(aux["tokens_overflowed"]) == 0)
  tokens = ref["router_ids"].shape[1]
  np.testing.assert_array_equal(np.sort(np.asarray(aux["expert_ids"])[:, :tokens], axis=-1), ref["router_ids"])
  if "slots_per_device" in moe:  # the spare slots really hold replicas of other holders' experts
    rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
    table = np.asarray(layers.per_layer(rest, model.cfg)[1]["ffn"]["moe"]["slot_expert"])
    assert table.shape[1] == moe["slots_per_device"] and len(np.unique(table)) == model.moe_cfg.num_experts
    assert len(np.unique(table[:, -1])) == table.shape[0]


@pytest.mark.slow
@group("deepseek_v3")
def test_small_capacity_drops_and_changes_logits(mesh_2x4):
  """The control of the capacity case: with too little capacity choices are dropped, counted, and the logits move
  away from transformers' (so the comparison above can tell)."""
  ref = reference("deepseek_v3")
  model = models.from_hf(str(DATA / "deepseek_v3"), mesh_2x4, moe={"collective": "capacity", "capacity_factor": 0.5})
  logits, aux = model(tiled(ref["tokens"]))
  assert np.all(np.asarray(aux["tokens_dropped"]) > 0)
  assert relative_error(np.asarray(logits)[:2], ref["logits"]) > 1e-2


@pytest.mark.slow
@group("mixtral")
def test_bf16_close_to_transformers(mesh_2x4):
  ref = reference("mixtral")
  model = models.from_hf(str(DATA / "mixtral"), mesh_2x4, dtype="bfloat16", param_dtype="bfloat16")
  assert model.embed.embedding[...].dtype == jax.numpy.bfloat16
  logits, _ = model(tiled(ref["tokens"]))
  logits = np.asarray(logits)
  assert logits.dtype == np.float32
  error = relative_error(logits[:2], ref["logits"])
  assert 0 < error < 3e-2  # bf16 rounding shows, but small
  np.testing.assert_array_equal(logits[:2].argmax(-1), ref["logits"].argmax(-1))


@group("qwen3_moe")
def test_bf16_parameters_round_trip(mesh_2x4, tmp_path):
  """bf16 parameters are the checkpoint's float32 tensors rounded to bf16, written as BF16 and read back unchanged."""
  model = models.from_hf(str(DATA / "qwen3_moe"), mesh_2x4, dtype="bfloat16", param_dtype="bfloat16")
  out = str(tmp_path / "export")
  models.to_hf(model, out)
  assert json.loads(open(os.path.join(out, "config.json")).read())["dtype"] == "bfloat16"
  fixture, written = (
    load_file(DATA / "qwen3_moe" / "model.safetensors"),
    load_file(os.path.join(out, "model.safetensors")),
  )
  assert sorted(written) == sorted(fixture)
  for name, tensor in fixture.items():
    assert written[name].dtype == jax.numpy.bfloat16, name
    np.testing.assert_array_equal(written[name], tensor.astype(jax.numpy.bfloat16), err_msg=name)
  back = models.from_hf(out, mesh_2x4, dtype="bfloat16", param_dtype="bfloat16")
  assert_states_equal(model_state(back), model_state(model))


# ---------------------------------------------------------------------------------------------------------------
# Generation


@pytest.mark.parametrize(
  "family, mode",
  [
    *(case(f, "vanilla") for f in FAMILIES + PUBLISHED if f != "qwen3_dense"),
    case("mixtral", "exflow"),
    case("deepseek_v3", "exflow"),
  ],
)
def test_greedy_generation_matches_transformers(loaded, family, mode):
  ref = reference(family)
  prompt, greedy = ref["prompt"], ref["greedy"]
  tokens = infer.generate_tokens(loaded.model(family), prompt, greedy.shape[1] - prompt.shape[1], mode=mode)
  np.testing.assert_array_equal(tokens, greedy)


@pytest.mark.slow
@pytest.mark.parametrize("family", [case("qwen2_moe")])
def test_generation_of_any_batch(loaded, family):
  """One request alone and three (padded up to the mesh's devices inside) give the fixture's continuations."""
  ref = reference(family)
  prompt, greedy = ref["prompt"], ref["greedy"]
  steps = greedy.shape[1] - prompt.shape[1]
  np.testing.assert_array_equal(infer.generate_tokens(loaded.model(family), prompt[1:], steps), greedy[1:])
  np.testing.assert_array_equal(
    infer.generate_tokens(loaded.model(family), prompt[[0, 1, 0]], steps), greedy[[0, 1, 0]]
  )


@pytest.mark.slow
@group("mixtral")
def test_sampled_generation(loaded):
  ref = reference("mixtral")
  model, prompt, greedy = loaded.model("mixtral"), ref["prompt"], ref["greedy"]
  steps, vocab = greedy.shape[1] - prompt.shape[1], ref["logits"].shape[-1]
  draws = {seed: infer.generate_tokens(model, prompt, steps, temperature=1.0, seed=seed) for seed in (0, 1, 2)}
  for tokens in draws.values():
    assert tokens.shape == greedy.shape and tokens.dtype.kind == "i"
    np.testing.assert_array_equal(tokens[:, : prompt.shape[1]], prompt)
    assert np.all((tokens >= 0) & (tokens < vocab))
  np.testing.assert_array_equal(infer.generate_tokens(model, prompt, steps, temperature=1.0, seed=0), draws[0])
  # the draw of request r at step t is keyed by (seed, t, r): ExFlow's decode draws the same tokens
  np.testing.assert_array_equal(
    infer.generate_tokens(model, prompt, steps, temperature=1.0, seed=0, mode="exflow"), draws[0]
  )
  assert any(not np.array_equal(tokens, greedy) for tokens in draws.values())
  assert not np.array_equal(draws[0], draws[1]) or not np.array_equal(draws[1], draws[2])
  # a low temperature is greedy again (the reference's top logits are apart by far more than 1e-3)
  np.testing.assert_array_equal(infer.generate_tokens(model, prompt, steps, temperature=1e-3, seed=0), greedy)


# ---------------------------------------------------------------------------------------------------------------
# Round trip through to_hf

# config.json fields each family's transformers code reads, with the value transformers takes when one is absent.
COMMON_FIELDS = (
  "model_type",
  "architectures",
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
  "num_key_value_heads",
  "max_position_embeddings",
  "rms_norm_eps",
  "hidden_act",
  "tie_word_embeddings",
  "rope_parameters",
)
ROUTED = ("num_experts_per_tok",)
LATENT = (
  "n_routed_experts",
  "first_k_dense_replace",
  "moe_intermediate_size",
  "n_shared_experts",
  "routed_scaling_factor",
  "norm_topk_prob",
  "n_group",
  "topk_group",
  "q_lora_rank",
  "kv_lora_rank",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
)
FAMILY_FIELDS = {
  "mixtral": ROUTED + ("num_local_experts", "sliding_window", "router_jitter_noise"),
  "qwen2_moe": ROUTED
  + (
    "num_experts",
    "moe_intermediate_size",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
    "qkv_bias",
    "mlp_only_layers",
    "decoder_sparse_step",
  ),
  "qwen3_moe": ROUTED
  + (
    "num_local_experts",
    "moe_intermediate_size",
    "norm_topk_prob",
    "mlp_only_layers",
    "decoder_sparse_step",
    "attention_bias",
  ),
  "deepseek_v2": ROUTED + LATENT + ("topk_method", "attention_bias"),
  "deepseek_v3": ROUTED + LATENT + ("rope_interleave", "num_nextn_predict_layers", "attention_bias"),
  # (its num_nextn_predict_layers 1 names no tensors: written back as 0, tests/test_hf_published.py)
  "glm4_moe": ROUTED + LATENT[:8] + ("attention_bias", "use_qk_norm", "head_dim", "num_key_value_heads"),
  "gpt_oss": ROUTED
  + (
    "num_local_experts",
    "attention_bias",
    "swiglu_alpha",
    "swiglu_limit",
    "sliding_window",
    "layer_types",
    "head_dim",
    "router_aux_loss_coef",
  ),
  "dots1": ROUTED + LATENT[:8] + ("attention_bias", "head_dim", "num_key_value_heads", "layer_types"),
  "glm4_moe_lite": ROUTED
  + tuple(f for f in LATENT if f != "first_k_dense_replace")
  + ("mlp_layer_types", "rope_interleave", "attention_bias"),
  "olmoe": ROUTED + ("num_experts", "norm_topk_prob", "attention_bias", "clip_qkv", "router_aux_loss_coef"),
  "minimax_m2": ROUTED + ("num_local_experts", "head_dim", "router_aux_loss_coef", "router_jitter_noise"),
  "llama_dense": ("attention_bias", "mlp_bias"),
  "qwen3_dense": ("attention_bias",),
}
DEFAULTS = {
  "attention_bias": False,
  "mlp_bias": False,
  "decoder_sparse_step": 1,
  "mlp_only_layers": [],
  "rope_interleave": True,
  "num_nextn_predict_layers": 0,
  "sliding_window": None,
}
ALIASES = {
  "num_local_experts": ("num_local_experts", "num_experts"),
  "num_experts": ("num_experts", "num_local_experts"),
}


def config_field(config: dict, name: str):
  if name == "head_dim":  # Mixtral's null: hidden / heads; GLM-4.7-Flash's none: qk_rope_head_dim (attribute_map)
    return (
      config.get("head_dim") or config.get("qk_rope_head_dim") or config["hidden_size"] // config["num_attention_heads"]
    )
  for alias in ALIASES.get(name, (name,)):
    if alias in config:
      return config[alias]
  return DEFAULTS[name]


def assert_checkpoint_equals_fixture(out_dir: str, family: str) -> None:
  """The tensors written equal the fixture's bit for bit, with the same (hub) names, and the config.json fields the
  family reads are the fixture's."""
  fixture = load_file(DATA / family / "model.safetensors")
  written = {}
  for file in sorted(os.listdir(out_dir)):
    if file.endswith(".safetensors"):
      tensors = load_file(os.path.join(out_dir, file))
      assert not set(tensors) & set(written), file
      written.update(tensors)
  assert sorted(written) == sorted(fixture)
  for name, tensor in fixture.items():
    assert written[name].dtype == tensor.dtype and np.array_equal(written[name], tensor), name
  want = json.loads((DATA / family / "config.json").read_text())
  got = json.loads(open(os.path.join(out_dir, "config.json")).read())
  for name in COMMON_FIELDS + FAMILY_FIELDS[family] + ("head_dim",):
    assert config_field(got, name) == config_field(want, name), name


@pytest.mark.parametrize("family", [case(f, slow=False) for f in FAMILIES])
@pytest.mark.sampled(1)
def test_round_trip_one_file(loaded, tmp_path, family):
  model = loaded.model(family)
  out = str(tmp_path / "export")
  umask = os.umask(0o022)
  try:
    models.to_hf(model, out)
  finally:
    os.umask(umask)
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  assert {os.stat(os.path.join(out, f)).st_mode & 0o777 for f in os.listdir(out)} == {0o644}  # not safetensors' 0600
  assert_checkpoint_equals_fixture(out, family)
  assert_states_equal(
    model_state(models.from_hf(out, loaded.mesh, param_dtype=param_dtype(family))), model_state(model)
  )


@pytest.mark.parametrize("family", [case(f, slow=f not in ("deepseek_v3", "mixtral")) for f in FAMILIES])
def test_round_trip_shards_with_index(loaded, tmp_path, family):
  model = loaded.model(family)
  out = str(tmp_path / "export")
  models.to_hf(model, out, shard_bytes=20_000)
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    index = json.load(f)
  files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
  assert len(files) > 1 and "model.safetensors" not in files
  assert sorted(set(index["weight_map"].values())) == files
  sizes = {f: load_file(os.path.join(out, f)) for f in files}
  for file, tensors in sizes.items():
    assert sorted(tensors) == sorted(n for n, where in index["weight_map"].items() if where == file)
    assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 20_000, file
  assert index["metadata"]["total_size"] == sum(t.nbytes for ts in sizes.values() for t in ts.values())
  assert_checkpoint_equals_fixture(out, family)
  assert_states_equal(
    model_state(models.from_hf(out, loaded.mesh, param_dtype=param_dtype(family))), model_state(model)
  )


@pytest.mark.parametrize("family", [case(f, slow=f != "deepseek_v3") for f in MOE_FAMILIES])
@pytest.mark.slow
def test_unrolled_layers_match_transformers_and_round_trip(mesh_2x4, tmp_path, family):
  """model.scan_layers=False (one module per layer, `blocks/i/...`: the layout before scanned layers): transformers'
  logits, the checkpoint written back bit for bit, and the same parameters as the scanned model's, layer by layer."""
  ref = reference(family)
  model = unrolled(family, mesh_2x4)
  assert not model.cfg.scan_layers and len(model.blocks) == model.cfg.num_layers
  assert relative_error(np.asarray(model(tiled(ref["tokens"]))[0])[:2], ref["logits"]) < TOL
  out = str(tmp_path / "export")
  models.to_hf(model, out)
  assert_checkpoint_equals_fixture(out, family)
  scanned = models.from_hf(str(DATA / family), mesh_2x4, param_dtype=param_dtype(family))
  per_layer = lambda m: layers.per_layer(model_state(m)["params"], m.cfg)
  assert_states_equal({"layers": per_layer(scanned)}, {"layers": per_layer(model)})


@pytest.mark.parametrize("family", [case(f, slow=f != "deepseek_v3") for f in MOE_FAMILIES])
@pytest.mark.slow
def test_unrolled_layers_generate_transformers_tokens(mesh_2x4, family):
  """model.scan_layers=False: transformers' greedy tokens, vanilla and ExFlow (the decode cache per block)."""
  ref = reference(family)
  model = unrolled(family, mesh_2x4)
  steps = ref["greedy"].shape[1] - ref["prompt"].shape[1]
  for mode in ("vanilla", "exflow"):
    np.testing.assert_array_equal(infer.generate_tokens(model, ref["prompt"], steps, mode=mode), ref["greedy"])


def unrolled(family: str, mesh):
  """The family's fixture loaded with one module per layer (model.scan_layers=False)."""
  return models.from_hf(str(DATA / family), mesh, model={"scan_layers": False}, param_dtype=param_dtype(family))


@group("deepseek_v3")
def test_deepseek_v3_balancing_bias_survives(loaded, tmp_path):
  fixture = load_file(DATA / "deepseek_v3" / "model.safetensors")
  model = loaded.model("deepseek_v3")
  rest = layers.per_layer(nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))), model.cfg)
  out = str(tmp_path / "export")
  models.to_hf(model, out)
  back = layers.per_layer(nnx.to_pure_dict(nnx.state(models.from_hf(out, loaded.mesh), nnx.Not(nnx.Param))), model.cfg)
  written = load_file(os.path.join(out, "model.safetensors"))
  for layer in (1, 2):  # the MoE layers (layer 0 is dense)
    name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    assert np.any(fixture[name] != 0)
    for bias in (rest[layer]["ffn"]["moe"]["expert_bias"], back[layer]["ffn"]["moe"]["expert_bias"], written[name]):
      np.testing.assert_array_equal(np.asarray(bias), fixture[name])


# ---------------------------------------------------------------------------------------------------------------
# Malformed checkpoints, refused by name before anything is compiled

EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


def rewrite(directory: str, change) -> None:
  """model.safetensors replaced by change(tensors)."""
  path = os.path.join(directory, "model.safetensors")
  save_file(change(load_file(path)), path, metadata={"format": "pt"})


def edit_config(directory: str, **fields) -> None:
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    config = json.load(f)
  with open(path, "w") as f:
    json.dump({**config, **fields}, f)


def refused(directory: str, mesh, **kwargs) -> str:
  with pytest.raises(ConfigError) as error:
    models.from_hf(directory, mesh, **kwargs)
  return str(error.value)


def test_unknown_model_type_refused(tmp_path, mesh_2x4):
  directory = fixture_copy(tmp_path, "mixtral")
  edit_config(directory, model_type="jetmoe")  # a MoE model_type of transformers that moejax does not know
  message = refused(directory, mesh_2x4)
  assert "model_type" in message and "jetmoe" in message


def test_missing_config_refused(tmp_path, mesh_2x4):
  directory = fixture_copy(tmp_path, "llama_dense")
  os.remove(os.path.join(directory, "config.json"))
  assert "config.json" in refused(directory, mesh_2x4)


def test_missing_weights_file_refused(tmp_path, mesh_2x4):
  directory = fixture_copy(tmp_path, "llama_dense")
  os.remove(os.path.join(directory, "model.safetensors"))
  assert "model.safetensors" in refused(directory, mesh_2x4)


@pytest.mark.parametrize(
  "family, name",
  [
    ("deepseek_v3", EXPERT),
    ("deepseek_v3", "model.layers.2.mlp.gate.e_score_correction_bias"),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight"),
    ("mixtral", "model.layers.2.block_sparse_moe.experts.7.w2.weight"),
    ("llama_dense", "lm_head.weight"),
  ],
)
def test_missing_tensor_refused(tmp_path, mesh_2x4, family, name):
  directory = fixture_copy(tmp_path, family)
  rewrite(directory, lambda t: {k: v for k, v in t.items() if k != name})
  message = refused(directory, mesh_2x4)
  assert name in message and "missing" in message


def test_extra_tensor_refused(tmp_path, mesh_2x4):
  directory = fixture_copy(tmp_path, "deepseek_v3")
  extra = "model.layers.1.mlp.experts.16.up_proj.weight"  # a 17th expert of 16
  rewrite(directory, lambda t: {**t, extra: t[EXPERT]})
  message = refused(directory, mesh_2x4)
  assert extra in message and "unexpected" in message


def test_wrong_shape_refused(tmp_path, mesh_2x4):
  directory = fixture_copy(tmp_path, "deepseek_v3")
  rewrite(directory, lambda t: {**t, EXPERT: np.ascontiguousarray(t[EXPERT][:, :-1])})
  message = refused(directory, mesh_2x4)
  assert EXPERT in message and "shape" in message


def test_wrong_dtype_refused(tmp_path, mesh_2x4):
  directory = fixture_copy(tmp_path, "deepseek_v3")
  rewrite(directory, lambda t: {**t, EXPERT: t[EXPERT].astype(np.int32)})
  message = refused(directory, mesh_2x4)
  assert EXPERT in message and "dtype" in message


@pytest.mark.parametrize("keep", [100, -16], ids=["header", "data"])
def test_truncated_file_refused(tmp_path, mesh_2x4, keep):
  directory = fixture_copy(tmp_path, "qwen3_moe")
  path = os.path.join(directory, "model.safetensors")
  data = open(path, "rb").read()
  with open(path, "wb") as f:
    f.write(data[:keep])
  assert "model.safetensors" in refused(directory, mesh_2x4)


def test_missing_shard_refused(tmp_path, mesh_2x4):
  directory = str(tmp_path / "sharded")
  models.to_hf(models.from_hf(str(DATA / "llama_dense"), mesh_2x4), directory, shard_bytes=20_000)
  with open(os.path.join(directory, "model.safetensors.index.json")) as f:
    shard = sorted(set(json.load(f)["weight_map"].values()))[1]
  os.remove(os.path.join(directory, shard))
  assert shard in refused(directory, mesh_2x4)


@pytest.mark.parametrize(
  "moe, field",
  [
    ({"top_k": 0}, "moe.top_k"),
    ({"transprt": "padded"}, "moe.transprt"),
    ({"collective": "capacity"}, "moe.capacity_factor"),
  ],
)
def test_invalid_moe_override_refused(mesh_2x4, moe, field):
  assert field in refused(str(DATA / "qwen3_moe"), mesh_2x4, moe=moe)


@pytest.mark.slow
@pytest.mark.parametrize("family", [case("qwen3_moe"), case("qwen3_dense")])
def test_qwen3_attention_bias_checkpoint(loaded, tmp_path, family):
  """Qwen3's attention_bias puts biases on q_proj, k_proj, v_proj and o_proj (transformers' Qwen3Attention). Zero
  biases leave transformers' logits as the fixture's, so the checkpoint with them loads, matches, and round-trips."""
  directory = fixture_copy(tmp_path, family)
  edit_config(directory, attention_bias=True)
  biases = lambda t: {
    name.replace(".weight", ".bias"): np.zeros(t[name].shape[0], np.float32)
    for name in t
    if re.search(r"self_attn\.[qkvo]_proj\.weight$", name)
  }
  rewrite(directory, lambda t: {**t, **biases(t)})
  model = models.from_hf(directory, loaded.mesh)
  ref = reference(family)
  assert relative_error(np.asarray(model(tiled(ref["tokens"]))[0])[:2], ref["logits"]) < TOL
  out = str(tmp_path / "export")
  models.to_hf(model, out)
  assert json.loads(open(os.path.join(out, "config.json")).read()).get("attention_bias") is True
  assert sorted(load_file(os.path.join(out, "model.safetensors"))) == sorted(
    load_file(os.path.join(directory, "model.safetensors"))
  )
  assert_states_equal(
    model_state(models.from_hf(out, loaded.mesh, param_dtype=param_dtype(family))), model_state(model)
  )


def test_unsupported_activation_refused(tmp_path, mesh_2x4):
  directory = fixture_copy(tmp_path, "qwen3_moe")
  edit_config(directory, hidden_act="gelu")
  assert "hidden_act" in refused(directory, mesh_2x4)
