"""`hf_parts.experts`: stacked experts' output blocks read from either layout a checkpoint holds (the hub's [E, in,
n x out] or transformers 5's modules' [E, n x out, in]), against NumPy slicing of fresh random tensors; where both
layouts fit, the modules' (transformers' loader transposes only a tensor that is not its module's shape)."""

import numpy as np
import pytest

from moejax.models import hf_parts
from moejax.validation import ConfigError


class Stored:
  """A stored tensor as safetensors' lazy slices give it."""

  def __init__(self, array):
    self.array = array

  def get_shape(self):
    return list(self.array.shape)

  def get_dtype(self):
    return "F32"

  def __getitem__(self, index):
    return self.array[index]


def _read(array, name):
  stored, part = hf_parts.split_part(name)
  return hf_parts.view(stored, Stored(array), part)


@pytest.mark.parametrize("d,f", [(6, 5), (8, 4)])  # (8, 4): d == 2f, both layouts fit the gate_up tensor
def test_expert_blocks_from_either_layout(d, f):
  rng = np.random.default_rng(d * 10 + f)
  gate_up_hub, down_hub = rng.normal(size=(3, d, 2 * f)), rng.normal(size=(3, f, d))
  modules = {"gate_up": gate_up_hub.transpose(0, 2, 1), "down": down_hub.transpose(0, 2, 1)}
  for layout, gate_up, down in (("modules", modules["gate_up"], modules["down"]), ("hub", gate_up_hub, down_hub)):
    if layout == "hub" and d == 2 * f:
      continue  # read as the modules' layout, as transformers does: the next test
    gate = _read(gate_up, hf_parts.experts("t", 0, 2, "in", d))
    up = _read(gate_up, hf_parts.experts("t", 1, 2, "in", d))
    out = _read(down, hf_parts.experts("t", 0, 1, "out", d))
    np.testing.assert_array_equal(gate[:, :, :], gate_up_hub[:, :, :f])
    np.testing.assert_array_equal(up[1:3, 2:, 1:], gate_up_hub[1:3, 2:, f + 1 :])  # a device's block
    np.testing.assert_array_equal(out[:, :, :], down_hub)
    assert gate.get_shape() == [3, d, f] and out.get_shape() == [3, f, d]
  joined = dict(
    hf_parts.join_parts([(hf_parts.experts("t", i, 2, "in", d), gate_up_hub[..., i * f : (i + 1) * f]) for i in (1, 0)])
  )
  np.testing.assert_array_equal(joined["t"], gate_up_hub.transpose(0, 2, 1))  # written as transformers' modules


def test_both_layouts_fitting_read_as_the_modules():
  square = np.random.default_rng(0).normal(size=(2, 8, 8))  # d = 8, f = 4: [E, 2f, d] and [E, d, 2f] alike
  gate = _read(square, hf_parts.experts("t", 0, 2, "in", 8))
  np.testing.assert_array_equal(gate[:, :, :], square[:, :4, :].transpose(0, 2, 1))


def test_a_tensor_fitting_neither_layout_is_refused_naming_it():
  with pytest.raises(ConfigError, match=r"model\.w .*\(2, 5, 7\)"):
    _read(np.zeros((2, 5, 7)), hf_parts.experts("model.w", 0, 2, "in", 6))


@pytest.mark.parametrize("axis", [0, -1])
def test_blocks_of_either_axis_read_and_join(axis):
  """`#<i>/n` (the last axis: Llama 4's experts) and `#^<i>/n` (the first: Granite's shared gate and up rows)."""
  stored = np.random.default_rng(3).normal(size=(6, 4))
  halves = np.split(stored, 2, axis=axis)
  names = [hf_parts.block("t", i, 2, axis=axis) for i in range(2)]
  for name, half in zip(names, halves):
    view = _read(stored, name)
    assert view.get_shape() == list(half.shape)
    np.testing.assert_array_equal(view[1:3, 1:], half[1:3, 1:])
  np.testing.assert_array_equal(dict(hf_parts.join_parts(zip(names[::-1], halves[::-1])))["t"], stored)
