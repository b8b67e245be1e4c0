"""The safetensors files of a Hugging Face checkpoint directory, read lazily (`moejax.models.hf_load`), with
the published quantised formats read as the float tensors they encode, one slice at a time:

  fp8    DeepSeek-V3's (and R1's, V3.1's, Kimi K2's): a Linear weight W [out, in] stored as float8_e4m3fn with a
         float32 `<name>_scale_inv` [ceil(out / b0), ceil(in / b1)]; W[i, j] = W_fp8[i, j] x scale_inv[i // b0,
         j // b1] (the last blocks partial), (b0, b1) config.json's quantization_config.weight_block_size.
  mxfp4  gpt-oss's experts: `<name>_blocks` uint8 [E, out, in / 32, 16] (two e2m1 values a byte, the first in the
         low nibble) and `<name>_scales` uint8 [E, out, in / 32] (E8M0: 2^(s - 127) per block of 32); read as the
         unquantised tensor `<name>` [E, in, out] (the blocks hold its transpose).

A slice of a quantised tensor reads only the bytes and scales of that slice, so each device dequantises its own
block (an expert-sharded weight: its own experts) as it reads it, in float32.

A name `<tensor>#<part>` is a part of a stored tensor (columns or rows of it: `moejax.models.hf_parts`), read as a
tensor of its own.
"""

import json
import os
import struct

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from moejax.models import hf_parts
from moejax.validation import ConfigError, is_int, require

QUANT_METHODS = ("fp8", "mxfp4")
FP8_SUFFIX, MXFP4_SUFFIXES = "_scale_inv", ("_blocks", "_scales")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MXFP4_BLOCK = 32  # values per E8M0 scale
# e2m1's 16 codes: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6 (OCP microscaling formats, v1.0).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def quantization(hf: dict) -> tuple[str, tuple[int, int] | None] | None:
  """(method, FP8 block size or None) of a config.json's quantization_config, or None without one; anything else
  refused naming the field: FP8 of fmt e4m3 with a 2-D weight_block_size, or MXFP4."""
  q = hf.get("quantization_config")
  if not q:
    return None
  method = q.get("quant_method")
  require(method in QUANT_METHODS, "quantization_config.quant_method", method, f"one of {QUANT_METHODS}")
  if method == "mxfp4":
    return method, None
  require(q.get("fmt", "e4m3") == "e4m3", "quantization_config.fmt", q.get("fmt"), "'e4m3' (float8_e4m3fn weights)")
  block = q.get("weight_block_size")
  require(
    isinstance(block, (list, tuple)) and len(block) == 2 and all(is_int(b) for b in block),
    "quantization_config.weight_block_size",
    block,
    "[rows, columns] of positive ints (block-quantised weights, as DeepSeek publishes them)",
  )
  return method, tuple(block)


def fp8_quantize(w_OxI: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
  """(W_fp8 [out, in] float8_e4m3fn, scale_inv [ceil(out / b0), ceil(in / b1)] float32) of a weight, as DeepSeek's
  weight_quant: per block s = amax(|W|) / 448 (1 for a block of zeros), W_fp8 = W / s rounded to nearest even."""
  (rows, cols), (b0, b1) = w_OxI.shape, block
  padded = np.zeros((-(-rows // b0) * b0, -(-cols // b1) * b1), np.float32)
  padded[:rows, :cols] = w_OxI
  blocks = padded.reshape(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1)
  amax = np.abs(blocks).max(axis=(1, 3))
  scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
  q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
  return q.astype(ml_dtypes.float8_e4m3fn), scale


def _bounds(index, shape) -> list[tuple[int, int]]:
  """(start, stop) per dimension of `...`, a slice or a tuple of unit-step slices (missing trailing ones: whole)."""
  index = () if index is Ellipsis else index if isinstance(index, tuple) else (index,)
  index = index + (slice(None),) * (len(shape) - len(index))
  bounds = [s.indices(n) for s, n in zip(index, shape)]
  require(all(step == 1 for _, _, step in bounds), "index", index, "unit-step slices")
  return [(start, stop) for start, stop, _ in bounds]


class Fp8Blocks:
  """A block-quantised FP8 weight [out, in] read as float32 (W_fp8 x scale_inv per block), sliced lazily."""

  def __init__(self, name: str, weight, scale_inv, block: tuple[int, int]):
    self.weight, self.scale_inv, self.block = weight, scale_inv, block
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.get_shape()) != want:
      raise ConfigError(
        f"checkpoint tensor {name}{FP8_SUFFIX} has shape {tuple(scale_inv.get_shape())}, expected "
        f"{want} (blocks of {list(block)} over {name} {[rows, cols]})"
      )

  def get_shape(self):
    return list(self.weight.shape)

  def get_dtype(self) -> str:
    return "F8_E4M3"

  def __getitem__(self, index) -> np.ndarray:
    (r0, r1), (c0, c1) = _bounds(index, self.weight.shape)
    (b0, b1) = self.block
    scale = np.asarray(self.scale_inv[r0 // b0 : -(-r1 // b0), c0 // b1 : -(-c1 // b1)], np.float32)
    scale = np.repeat(np.repeat(scale, b0, axis=0), b1, axis=1)[
      r0 % b0 : r0 % b0 + r1 - r0, c0 % b1 : c0 % b1 + c1 - c0
    ]
    return np.asarray(self.weight[r0:r1, c0:c1]).view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale


class Mxfp4Blocks:
  """An MXFP4 tensor read as float32 [E, in, out]: blocks [E, out, in / 32, 16] and E8M0 scales [E, out, in / 32]
  of its transpose, sliced lazily (whole blocks of 32 read along `in`)."""

  def __init__(self, name: str, blocks, scales):
    self.blocks, self.scales = blocks, scales
    shape, scale_shape = tuple(blocks.get_shape()), tuple(scales.get_shape())
    if len(shape) != 4 or shape[-1] != MXFP4_BLOCK // 2 or scale_shape != shape[:3]:
      raise ConfigError(
        f"checkpoint tensors {name}_blocks {list(shape)} and {name}_scales {list(scale_shape)}: "
        f"expected [E, out, in / 32, 16] and [E, out, in / 32]"
      )
    self.shape = (shape[0], shape[2] * MXFP4_BLOCK, shape[1])

  def get_shape(self):
    return list(self.shape)

  def get_dtype(self) -> str:
    return "MXFP4"

  def __getitem__(self, index) -> np.ndarray:
    (e0, e1), (i0, i1), (o0, o1) = _bounds(index, self.shape)
    g0, g1 = i0 // MXFP4_BLOCK, -(-i1 // MXFP4_BLOCK)
    packed = np.asarray(self.blocks[e0:e1, o0:o1, g0:g1])  # [e, o, g, 16]
    exponents = np.asarray(self.scales[e0:e1, o0:o1, g0:g1]).astype(np.float32) - 127
    values = np.stack([E2M1[packed & 0x0F], E2M1[packed >> 4]], axis=-1).reshape(*packed.shape[:3], MXFP4_BLOCK)
    values = (values * np.exp2(exponents)[..., None]).reshape(*packed.shape[:2], -1)  # [e, o, 32 g]
    start = i0 - g0 * MXFP4_BLOCK
    return values[:, :, start : start + i1 - i0].transpose(0, 2, 1)


QUANTISED = (Fp8Blocks, Mxfp4Blocks)  # the tensors read dequantised


class Shards:
  """The safetensors files of a checkpoint directory: name -> lazily sliced tensor. Headers are read once; one file
  is mapped at a time (switching files closes the last), so a load maps about one shard, not the checkpoint.
  `names`: the tensors as the model sees them: a quantised weight under its own name (its scales and blocks are
  read with it, config.json's quantization_config saying how: `quantization`)."""

  def __init__(self, directory: str):
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
      files = ["model.safetensors"]
    else:
      raise ConfigError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    self.directory, self.where, self.open_file, self.handle, self.headers = directory, {}, None, None, {}
    for file in files:
      with self._open(file) as handle:
        self.where.update({name: file for name in handle.keys()})
    config = os.path.join(directory, "config.json")
    self.quantization = quantization(json.load(open(config))) if os.path.exists(config) else None
    self.names = set(self.where)
    method = self.quantization and self.quantization[0]
    if method == "fp8":
      self.names -= {n for n in self.where if n.endswith(FP8_SUFFIX) and n[: -len(FP8_SUFFIX)] in self.where}
    if method == "mxfp4":
      packed = {n[: -len("_blocks")] for n in self.where if n.endswith("_blocks") and n[:-7] + "_scales" in self.where}
      self.names = (self.names - {p + s for p in packed for s in MXFP4_SUFFIXES}) | packed

  def _open(self, file: str):
    path = os.path.join(self.directory, file)
    try:
      return safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as e:
      raise ConfigError(f"checkpoint file {path} cannot be read (truncated or not safetensors): {e}") from e

  def _slice(self, name: str):
    file = self.where[name]
    if file != self.open_file:
      self.close()
      self.handle = self._open(file)
      self.handle.__enter__()
      self.open_file = file
    tensor = self.handle.get_slice(name)
    return self._bytes(file, name) if tensor.get_dtype() == "F8_E4M3" else tensor

  def _bytes(self, file: str, name: str) -> "_Raw":
    """The one-byte tensor `name` of `file` as uint8 (its header, read once: 8 bytes of length, then JSON)."""
    path = os.path.join(self.directory, file)
    if file not in self.headers:
      with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        self.headers[file] = 8 + length, json.loads(f.read(length))
    start, header = self.headers[file]
    return _Raw(path, start + header[name]["data_offsets"][0], tuple(header[name]["shape"]))

  def tensor(self, name: str):
    """A name of `names` -> its tensor, sliced lazily (`t[index]` -> float32 or the stored dtype; `get_shape`,
    `get_dtype`: the stored dtype, 'F8_E4M3' or 'MXFP4' for the quantised)."""
    stored, part = hf_parts.split_part(name)
    if part is not None:
      return hf_parts.view(stored, self.tensor(stored), part)
    if name not in self.where:  # an MXFP4 tensor, under its own name
      return Mxfp4Blocks(name, self._slice(name + "_blocks"), self._slice(name + "_scales"))
    tensor = self._slice(name)
    if self.quantization and self.quantization[0] == "fp8" and name + FP8_SUFFIX in self.where:
      return Fp8Blocks(name, tensor, self._slice(name + FP8_SUFFIX), self.quantization[1])
    return tensor

  def close(self) -> None:
    if self.handle is not None:
      self.handle.__exit__(None, None, None)
      self.handle, self.open_file = None, None


class _Raw:
  """A tensor's bytes [..shape] as uint8 through a read-only memory map (the dtypes numpy cannot name)."""

  def __init__(self, path: str, offset: int, shape: tuple):
    self.shape = shape
    self.array = np.memmap(path, np.uint8, "r", offset=offset, shape=shape)

  def get_shape(self):
    return list(self.shape)

  def get_dtype(self) -> str:
    return "F8_E4M3"

  def __getitem__(self, index):
    return self.array[index]
