"""Quantised checkpoints as they are published (`moejax.models.hf_files`): DeepSeek-V3's block FP8 and gpt-oss's
MXFP4 experts, read slice by slice against float64 NumPy decoders of the formats; the FP8 export (DeepSeek's
format, bit for bit the fixture's) read back; quantization_config refused by name. The loaded models' logits,
routing and greedy tokens against transformers are in tests/test_hf_models.py."""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import moejax.models as models
from moejax.models import hf_files
from moejax.validation import ConfigError
from tests.helpers import ROOT, relative_error

DATA = ROOT / "tests" / "data" / "hf"
FP8 = DATA / "deepseek_v3_fp8"


def e4m3_float64(byte: np.ndarray) -> np.ndarray:
  """float64 value of float8_e4m3fn bytes from the bit layout (sign, 4 exponent bits bias 7, 3 mantissa bits)."""
  byte = byte.astype(np.int64)
  sign = np.where(byte & 0x80, -1.0, 1.0)
  e, m = (byte >> 3) & 0xF, (byte & 0x7).astype(np.float64)
  return sign * np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7.0))


def test_fp8_slices_dequantise_per_block(tmp_path):
  """Any slice of a weight whose last blocks are partial: W_fp8 x scale_inv[i // b0, j // b1] (float64 NumPy)."""
  rng = np.random.default_rng(5)
  w = rng.normal(size=(45, 70)).astype(np.float32)
  block = (16, 32)
  q, scale_inv = hf_files.fp8_quantize(w, block)
  assert scale_inv.shape == (3, 3) and q.dtype == ml_dtypes.float8_e4m3fn
  save_file({"w.weight": q, "w.weight_scale_inv": scale_inv}, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(
    json.dumps({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}})
  )
  rows, cols = np.arange(45), np.arange(70)
  want = e4m3_float64(q.view(np.uint8)) * scale_inv.astype(np.float64)[rows[:, None] // 16, cols[None, :] // 32]
  assert np.abs(want - w).max() <= np.abs(w).max() / 8  # e4m3 keeps 3 mantissa bits
  shards = hf_files.Shards(str(tmp_path))
  try:
    assert shards.names == {"w.weight"}
    tensor = shards.tensor("w.weight")
    for r0, r1, c0, c1 in ((0, 45, 0, 70), (5, 40, 31, 33), (17, 45, 64, 70), (0, 1, 0, 1)):
      got = tensor[slice(r0, r1), slice(c0, c1)]
      assert got.dtype == np.float32
      np.testing.assert_array_equal(got, want[r0:r1, c0:c1].astype(np.float32))
  finally:
    shards.close()


@pytest.mark.slow
def test_fp8_checkpoint_exports_deepseeks_format_bit_for_bit(mesh_2x4, tmp_path):
  """The FP8 fixture loaded and written back with fp8_blocks=(128, 128): the same FP8 bytes and scales as the
  fixture (DeepSeek's amax / 448 is idempotent on dequantised weights), its config's quantization_config, and read
  back to the same logits."""
  model = models.from_hf(str(FP8), mesh_2x4)
  out = str(tmp_path / "fp8")
  models.to_hf(model, out, fp8_blocks=(128, 128))
  config = json.loads(open(os.path.join(out, "config.json")).read())
  assert config["quantization_config"] == json.loads((FP8 / "config.json").read_text())["quantization_config"]
  fixture, written = hf_files.Shards(str(FP8)), hf_files.Shards(out)
  try:
    assert written.where.keys() == fixture.where.keys()
    for name in fixture.where:
      a, b = written.tensor(name), fixture.tensor(name)
      if isinstance(b, hf_files.Fp8Blocks):
        np.testing.assert_array_equal(a.weight[:, :], b.weight[:, :], err_msg=name)
        np.testing.assert_array_equal(np.asarray(a.scale_inv[:, :]), np.asarray(b.scale_inv[:, :]), err_msg=name)
  finally:
    fixture.close()
    written.close()
  ref = np.load(FP8 / "reference.npz")
  tokens = np.concatenate([ref["tokens"]] * 4)
  assert relative_error(np.asarray(models.from_hf(out, mesh_2x4)(tokens)[0])[:2], ref["logits"]) < 1e-4


def fp8_copy(tmp_path, **quantization) -> str:
  out = tmp_path / "fp8"
  shutil.copytree(FP8, out)
  config = json.loads((out / "config.json").read_text())
  config["quantization_config"].update(quantization)
  (out / "config.json").write_text(json.dumps(config))
  return str(out)


@pytest.mark.parametrize(
  "field, value", [("quant_method", "awq"), ("fmt", "e5m2"), ("weight_block_size", None), ("weight_block_size", [128])]
)
def test_unreadable_quantization_config_refused(mesh_2x4, tmp_path, field, value):
  with pytest.raises(ConfigError) as error:
    models.from_hf(fp8_copy(tmp_path, **{field: value}), mesh_2x4)
  assert f"quantization_config.{field}" in str(error.value) and repr(value) in str(error.value)


def test_scales_of_another_block_size_refused(mesh_2x4, tmp_path):
  """weight_block_size [64, 64] does not fit the fixture's [ceil(out / 128), ceil(in / 128)] scales."""
  with pytest.raises(ConfigError) as error:
    models.from_hf(fp8_copy(tmp_path, weight_block_size=[64, 64]), mesh_2x4)
  assert "weight_scale_inv" in str(error.value) and "[64, 64]" in str(error.value)


def test_fp8_weight_without_its_scales_refused(mesh_2x4, tmp_path):
  directory = fp8_copy(tmp_path)
  path = os.path.join(directory, "model.safetensors")
  name = "model.layers.1.mlp.experts.3.up_proj.weight"
  shards = hf_files.Shards(directory)
  tensors = {n: (np.asarray(shards._slice(n)[...]) if n != name + "_scale_inv" else None) for n in shards.where}
  shards.close()
  tensors = {
    n: (t.view(ml_dtypes.float8_e4m3fn) if n.endswith(".weight") and t.dtype == np.uint8 else t)
    for n, t in tensors.items()
    if t is not None
  }
  save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(ConfigError) as error:
    models.from_hf(directory, mesh_2x4)
  assert name in str(error.value) and "F8_E4M3" in str(error.value)


def test_mxfp4_slices_match_the_format(tmp_path):
  """Slices of an MXFP4 tensor read as [E, in, out]: e2m1 nibbles (low first) x 2^(scale - 127), float64 NumPy from
  the bit layout, transposed."""
  rng = np.random.default_rng(7)
  blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
  scales = rng.integers(120, 130, (3, 5, 4), dtype=np.uint8)
  save_file({"x_blocks": blocks, "x_scales": scales}, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))

  def e2m1(nibble):
    sign = np.where(nibble & 8, -1.0, 1.0)
    e, m = (nibble >> 1) & 3, (nibble & 1).astype(np.float64)
    return sign * np.where(e == 0, m / 2, (1 + m / 2) * 2.0 ** (e - 1.0))

  values = np.stack([e2m1(blocks & 0xF), e2m1(blocks >> 4)], -1).reshape(3, 5, 4, 32)
  want = (values * 2.0 ** (scales.astype(np.float64) - 127)[..., None]).reshape(3, 5, 128).transpose(0, 2, 1)
  shards = hf_files.Shards(str(tmp_path))
  try:
    assert shards.names == {"x"}
    tensor = shards.tensor("x")
    assert tensor.get_shape() == [3, 128, 5]
    for index in ((slice(0, 3), slice(0, 128), slice(0, 5)), (slice(1, 2), slice(40, 97), slice(2, 4))):
      np.testing.assert_array_equal(tensor[index], want[index].astype(np.float32))
  finally:
    shards.close()


def test_gpt_oss_mxfp4_experts_read_as_transformers_dequantises_them():
  """The MXFP4 fixture's experts read as [E, in, out] equal transformers' own dequantisation (Mxfp4Config(dequantize=
  True), dequantized.npz: experts 0 and 1 of layer 0), and each whole tensor is within MXFP4's rounding of the bf16
  fixture's weights."""
  shards, bf16 = hf_files.Shards(str(DATA / "gpt_oss_mxfp4")), hf_files.Shards(str(DATA / "gpt_oss"))
  try:
    with np.load(DATA / "gpt_oss_mxfp4" / "dequantized.npz") as side:
      for name in side.files:
        np.testing.assert_array_equal(shards.tensor(name)[0:2], side[name], err_msg=name)
    for name in sorted(n for n in shards.names if n.endswith(("gate_up_proj", "down_proj"))):
      assert isinstance(shards.tensor(name), hf_files.Mxfp4Blocks) and name in bf16.names
      got, want = shards.tensor(name)[...], np.asarray(bf16.tensor(name)[...], np.float32)
      assert got.shape == want.shape and 0 < np.abs(got - want).max() <= np.abs(want).max() / 4, name
  finally:
    shards.close()
    bf16.close()
