"""The published-format fixtures of tests/data/hf (issue 52), checked with NumPy alone, before any loader reads them.

tests/fixtures/make_hf_fixtures.py wrote them with transformers: DeepSeek-V3 in FP8 as DeepSeek publishes it
(float8_e4m3fn weights with float32 `weight_scale_inv` per 128 x 128 block), gpt-oss in bf16 and with MXFP4
experts as OpenAI publishes it (`*_blocks` of e2m1 pairs, `*_scales` of E8M0 exponents), DeepSeek-V3 and GLM-4.5
whose config names an MTP layer that save_pretrained did not write. Checked here: each checkpoint's tensors are
in those formats (names, dtypes, shapes, the ceil of partial FP8 blocks, what stays unquantised), and decoding
them with this file's own decoders (written from the format specs: the bit layouts of e4m3fn and e2m1, E8M0's
bias) reproduces the dequantised weights the script saved beside them (dequantized.npz). The safetensors files
are read by a small reader here, so nothing but NumPy is needed.
"""

import json
import pathlib
import struct

import numpy as np
import pytest

DATA = pathlib.Path(__file__).resolve().parent / "data" / "hf"
NEW_FIXTURES = ("deepseek_v3_fp8", "deepseek_v3_no_mtp", "gpt_oss", "gpt_oss_mxfp4", "glm4_moe")
BLOCK = 128


# ----------------------------------------------------------------------------- readers and decoders


def read_safetensors(path: pathlib.Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
  """{name: (dtype, shape, raw little-endian bytes)}, from the format: an 8-byte header length, a JSON header of
  dtypes, shapes and data offsets, then the data."""
  raw = path.read_bytes()
  (n,) = struct.unpack("<Q", raw[:8])
  header = json.loads(raw[8 : 8 + n])
  header.pop("__metadata__", None)
  data = raw[8 + n :]
  return {
    name: (info["dtype"], tuple(info["shape"]), data[info["data_offsets"][0] : info["data_offsets"][1]])
    for name, info in header.items()
  }


def e4m3fn_table() -> np.ndarray:
  """float32 value of each float8_e4m3fn byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
  subnormal (m/8 * 2^-6); S.1111.111 is NaN and there is no infinity (max 448)."""
  table = np.empty(256, np.float32)
  for b in range(256):
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 0x7
    if e == 0xF and m == 0x7:
      table[b] = np.nan
    elif e == 0:
      table[b] = sign * m / 8 * 2.0**-6
    else:
      table[b] = sign * (1 + m / 8) * 2.0 ** (e - 7)
  return table


def e2m1_table() -> np.ndarray:
  """float32 value of each e2m1 nibble: sign bit 3, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is
  subnormal (m * 0.5)."""
  table = np.empty(16, np.float32)
  for n in range(16):
    sign = -1.0 if n & 0x8 else 1.0
    e, m = (n >> 1) & 0x3, n & 0x1
    table[n] = sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))
  return table


E4M3FN = e4m3fn_table()
E2M1 = e2m1_table()


def to_numpy(entry) -> np.ndarray:
  dtype, shape, raw = entry
  if dtype == "F32":
    return np.frombuffer(raw, "<f4").reshape(shape)
  if dtype == "BF16":
    return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
  if dtype in ("U8", "F8_E4M3"):
    return np.frombuffer(raw, np.uint8).reshape(shape)
  raise AssertionError(f"unexpected dtype {dtype}")


def fp8_dequantize(fp8_bytes: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
  """W = W_fp8 x scale_inv of its 128 x 128 block (the last blocks partial), in float32."""
  rows, cols = fp8_bytes.shape
  scale = np.repeat(np.repeat(scale_inv, BLOCK, axis=0), BLOCK, axis=1)[:rows, :cols]
  return E4M3FN[fp8_bytes] * scale


def mxfp4_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """[..., G, 16] bytes and [..., G] E8M0 exponents -> [..., G * 32] float32: byte j holds element 2j in its low
  nibble and 2j + 1 in its high nibble; each value times 2^(scale - 127)."""
  values = np.stack([E2M1[blocks & 0x0F], E2M1[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
  values = values * np.exp2(scales.astype(np.float32) - 127)[..., None]
  return values.reshape(*blocks.shape[:-2], -1)


def load(name: str):
  d = DATA / name
  config = json.loads((d / "config.json").read_text())
  meta = json.loads((d / "meta.json").read_text())
  return config, meta, read_safetensors(d / "model.safetensors")


# ----------------------------------------------------------------------------- tests


def test_the_decoders_follow_the_specs():
  assert E4M3FN[0x7E] == 448 and np.isnan(E4M3FN[0x7F]) and np.isnan(E4M3FN[0xFF])
  assert E4M3FN[0x01] == 2.0**-9 and E4M3FN[0x38] == 1.0 and E4M3FN[0xB8] == -1.0
  assert np.nanmax(E4M3FN) == 448 and np.isnan(E4M3FN).sum() == 2
  assert list(E2M1[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
  np.testing.assert_array_equal(E2M1[8:], -E2M1[:8])
  # two values a byte, the first in the low nibble; E8M0 127 is 2^0
  assert list(mxfp4_decode(np.array([[0x21] + [0] * 15], np.uint8), np.array([127], np.uint8))[:2]) == [0.5, 1.0]


@pytest.mark.parametrize("name", NEW_FIXTURES)
def test_each_fixture_has_its_files_and_references(name):
  d = DATA / name
  config, meta, tensors = load(name)
  assert sorted(p.name for p in d.iterdir()) == meta["files"]
  assert {k: {"shape": list(s), "dtype": t} for k, (t, s, _) in tensors.items()} == meta["safetensors_keys"]
  assert meta["versions"]["transformers"] == "5.24.0" and meta["versions"]["torch"] == "2.13.0+cpu"
  with np.load(d / "reference.npz") as ref:
    tokens, logits, prompt, greedy = ref["tokens"], ref["logits"], ref["prompt"], ref["greedy"]
    ids, weights = ref["router_ids"], ref["router_weights"]
  vocab = config["vocab_size"]
  assert tokens.shape == (2, 12) and logits.shape == (2, 12, vocab) and np.isfinite(logits).all()
  assert greedy.shape == (2, 13) and (greedy[:, :5] == prompt).all() and greedy.max() < vocab
  k = config["num_experts_per_tok"]
  assert ids.shape == (len(meta["moe_layers"]), 24, k) and weights.shape == ids.shape
  assert (np.diff(ids, axis=-1) > 0).all() and (weights > 0).all()


def test_deepseek_v3_fp8_is_in_deepseeks_published_format():
  config, meta, tensors = load("deepseek_v3_fp8")
  assert config["quantization_config"] == {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
  }
  fp8 = sorted(k for k, (t, _, _) in tensors.items() if t == "F8_E4M3")
  # every 2-D Linear weight of the blocks, and only those: not the router, norms, embeddings or the head
  linear = sorted(
    k
    for k, (_, s, _) in tensors.items()
    if k.startswith("model.layers.") and k.endswith(".weight") and len(s) == 2 and not k.endswith("mlp.gate.weight")
  )
  assert fp8 == linear and len(fp8) == 72
  assert sorted(k for k in tensors if k.endswith("_scale_inv")) == sorted(k + "_scale_inv" for k in fp8)
  for name, (dtype, shape, _) in tensors.items():
    if name.endswith("e_score_correction_bias") or name.endswith("_scale_inv"):
      assert dtype == "F32", name
    elif name not in fp8:
      assert dtype == "BF16", name
  assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"} <= set(tensors)

  partial = whole = 0
  for name in fp8:
    q = to_numpy(tensors[name])
    s = to_numpy(tensors[name + "_scale_inv"])
    rows, cols = q.shape
    assert s.shape == (-(-rows // BLOCK), -(-cols // BLOCK)), name
    assert np.isfinite(s).all() and (s > 0).all(), name
    values = E4M3FN[q]
    assert not np.isnan(values).any(), name
    # per block, |W_fp8 x s| <= 448 x s, and the block's largest |W| maps to 448 exactly (s = amax / 448)
    for i in range(s.shape[0]):
      for j in range(s.shape[1]):
        block = np.abs(values[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK])
        assert block.max() == 448, (name, i, j)
        assert (block * s[i, j] <= 448 * s[i, j]).all()
    partial += rows % BLOCK != 0 or cols % BLOCK != 0
    whole += rows % BLOCK == 0 and cols % BLOCK == 0
  assert partial == len(meta["quantization"]["partial_block_tensors"]) > 0 and whole > 0

  with np.load(DATA / "deepseek_v3_fp8" / "dequantized.npz") as side:
    for name in side.files:
      got = fp8_dequantize(to_numpy(tensors[name]), to_numpy(tensors[name + "_scale_inv"]))
      np.testing.assert_array_equal(got, side[name], err_msg=name)
  assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][1] == (144, 192)  # partial rows and columns


def test_gpt_oss_mxfp4_is_in_openais_published_format():
  config, meta, tensors = load("gpt_oss_mxfp4")
  _, _, bf16 = load("gpt_oss")
  assert config["quantization_config"]["quant_method"] == "mxfp4"
  E, H, I = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
  for layer in range(config["num_hidden_layers"]):
    p = f"model.layers.{layer}.mlp.experts."
    expected = {
      "gate_up_proj_blocks": ("U8", (E, 2 * I, H // 32, 16)),
      "gate_up_proj_scales": ("U8", (E, 2 * I, H // 32)),
      "down_proj_blocks": ("U8", (E, H, I // 32, 16)),
      "down_proj_scales": ("U8", (E, H, I // 32)),
      "gate_up_proj_bias": ("BF16", (E, 2 * I)),
      "down_proj_bias": ("BF16", (E, H)),
    }
    assert {k[len(p) :]: tensors[k][:2] for k in tensors if k.startswith(p)} == expected
  # everything but the experts' weights is the bf16 fixture's tensors, byte for byte
  quantized = {k for k in tensors if k.endswith(("_blocks", "_scales"))}
  experts = {k for k in bf16 if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
  assert set(tensors) - quantized == set(bf16) - experts
  for k in set(tensors) - quantized:
    assert tensors[k] == bf16[k], k

  for layer in range(config["num_hidden_layers"]):
    for proj in ("gate_up_proj", "down_proj"):
      name = f"model.layers.{layer}.mlp.experts.{proj}"
      scales = to_numpy(tensors[name + "_scales"])
      assert scales.max() < 255  # 255 is E8M0's NaN
      decoded = mxfp4_decode(to_numpy(tensors[name + "_blocks"]), scales)  # [E, out, in]
      original = to_numpy(bf16[name]).transpose(0, 2, 1)  # the bf16 fixture's [E, in, out], transposed
      # within MXFP4's rounding: at most one e2m1 step at the top of the range (2 x scale) / 2
      step = np.repeat(np.exp2(scales.astype(np.float32) - 127), 32, axis=-1)
      assert (np.abs(decoded - original) <= step).all(), name
      # the amax of each block of 32 uses the top of e2m1's range: scale = smallest power of two >= amax / 6
      amax = np.abs(original).reshape(*scales.shape, 32).max(axis=-1)
      np.testing.assert_array_equal(scales.astype(int) - 127, np.ceil(np.log2(amax / 6)).astype(int))
  with np.load(DATA / "gpt_oss_mxfp4" / "dequantized.npz") as side:
    assert sorted(side.files) == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]
    for name in side.files:
      decoded = mxfp4_decode(to_numpy(tensors[name + "_blocks"]), to_numpy(tensors[name + "_scales"]))
      np.testing.assert_array_equal(decoded.transpose(0, 2, 1)[:2], side[name], err_msg=name)


def test_gpt_oss_bf16_has_the_published_layout():
  config, meta, tensors = load("gpt_oss")
  assert {t for t, _, _ in tensors.values()} == {"BF16"}
  assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
  assert config["swiglu_limit"] == 7.0 and config["swiglu_alpha"] == 1.702 and config["attention_bias"]
  assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["truncate"] is False
  E, H, I = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
  heads = config["num_attention_heads"]
  assert tensors["model.layers.0.mlp.experts.gate_up_proj"][1] == (E, H, 2 * I)
  assert tensors["model.layers.0.mlp.experts.down_proj"][1] == (E, I, H)
  assert tensors["model.layers.0.self_attn.sinks"][1] == (heads,)
  assert tensors["model.layers.0.mlp.router.bias"][1] == (E,)
  assert meta["clamp_active"]["gate_above_limit"] > 0 and meta["clamp_active"]["up_outside_limit"] > 0


@pytest.mark.parametrize("name", ["deepseek_v3_no_mtp", "glm4_moe"])
def test_a_config_naming_mtp_layers_without_mtp_tensors(name):
  config, _, tensors = load(name)
  n = config["num_hidden_layers"]
  assert config["num_nextn_predict_layers"] == 1
  layers = {int(k.split(".")[2]) for k in tensors if k.startswith("model.layers.")}
  assert layers == set(range(n))
  assert not any(part in k for k in tensors for part in ("eh_proj", "enorm", "hnorm", "shared_head"))


def test_deepseek_v3_no_mtp_is_deepseek_v3_with_the_mtp_field():
  a, b = json.loads((DATA / "deepseek_v3" / "config.json").read_text()), load("deepseek_v3_no_mtp")[0]
  assert {k: (a[k], b[k]) for k in a if a[k] != b[k]} == {"num_nextn_predict_layers": (0, 1)}
  weights = [(DATA / d / "model.safetensors").read_bytes() for d in ("deepseek_v3", "deepseek_v3_no_mtp")]
  assert weights[0] == weights[1]


def test_glm4_moe_has_partial_rope_qk_norm_and_the_shared_expert():
  config, _, tensors = load("glm4_moe")
  assert config["rope_parameters"]["partial_rotary_factor"] == 0.5 and config["use_qk_norm"]
  assert config["attention_bias"] and config["first_k_dense_replace"] == 1 and config["n_group"] > 1
  assert tensors["model.layers.0.self_attn.q_norm.weight"][1] == (config["head_dim"],)
  assert "model.layers.0.mlp.gate_proj.weight" in tensors and "model.layers.0.mlp.gate.weight" not in tensors
  assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"][1] == (config["n_routed_experts"],)
  assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in tensors
  assert "model.layers.1.self_attn.q_proj.bias" in tensors and "model.layers.1.self_attn.o_proj.bias" not in tensors
