"""Parts of a stored checkpoint tensor that moejax holds as tensors of their own: a name `<tensor>#<part>` is read
as a lazily sliced view of the stored tensor (`view`) and written back joined with its other parts (`join_parts`).

  columns  `<tensor>#i/n`: the columns i::n of the last axis (gpt-oss's gate_up_proj holds the experts' gate and
           up projections interleaved: `#0/2` and `#1/2`)
  rows     `<tensor>#a:b/n`: the rows a .. b - 1 of the first axis of n (Sarvam's attention.query_key_value holds
           q, k and v one after another, each as many rows as its heads x head_dim, the bias likewise)
  item     `<tensor>#[i]/n`: the i-th of the n entries of the first axis, that axis dropped (ERNIE-4.5's
           moe_statics.e_score_correction_bias [1, E] holds the one balancing bias [E])
  block    `<tensor>#<i>/n`: the i-th of n equal blocks of the last axis, one after another (Llama 4's
           experts.gate_up_proj [E, d, 2f] holds the gate projections, then the up projections: `#<0>/2`, `#<1>/2`)
"""

from typing import NamedTuple

import numpy as np

from moejax.validation import ConfigError

PART = "#"


class ColumnsPart(NamedTuple):
  i: int
  n: int


class RowsPart(NamedTuple):
  start: int
  stop: int
  total: int


class ItemPart(NamedTuple):
  i: int
  n: int


class BlockPart(NamedTuple):
  i: int
  n: int
  axis: int = -1  # the last axis, or 0 (the first)


class ExpertsPart(NamedTuple):
  i: int
  n: int
  side: str  # which of the experts' axes the width is: "in" or "out"
  width: int


def block(name: str, i: int, n: int, axis: int = -1) -> str:
  """The name of the i-th of n equal blocks of the last (or, axis 0, the first) axis of the stored tensor `name`."""
  return f"{name}{PART}{'^' if axis == 0 else ''}<{i}>/{n}"


def experts(name: str, i: int, n: int, side: str, width: int | str) -> str:
  """The name of the i-th of n blocks of the outputs of the stacked experts `name`, whose `side` ('in' or 'out') is
  `width` wide (a family may give '{d}' for its `hf_name` to fill in)."""
  return f"{name}{PART}({i})/{n},{side}={width}"


def columns(name: str, i: int, n: int) -> str:
  """The name of the columns i::n of the last axis of the stored tensor `name`."""
  return f"{name}{PART}{i}/{n}"


def rows(name: str, start: int, stop: int, total: int) -> str:
  """The name of the rows start .. stop - 1 of the stored tensor `name`, `total` rows long."""
  return f"{name}{PART}{start}:{stop}/{total}"


def item(name: str, i: int, n: int) -> str:
  """The name of the entry i of the first axis of the stored tensor `name`, n entries long (that axis dropped)."""
  return f"{name}{PART}[{i}]/{n}"


def split_part(name: str) -> tuple[str, ColumnsPart | RowsPart | ItemPart | None]:
  """(stored tensor, its part) of a name; (name, None) for a whole tensor."""
  if PART not in name:
    return name, None
  stored, part = name.split(PART)
  span, total = part.split("/")
  if span.startswith("["):
    return stored, ItemPart(int(span[1:-1]), int(total))
  if span.lstrip("^").startswith("<"):
    return stored, BlockPart(int(span.lstrip("^")[1:-1]), int(total), 0 if span.startswith("^") else -1)
  if span.startswith("("):
    n, side_width = total.split(",")
    side, width = side_width.split("=")
    return stored, ExpertsPart(int(span[1:-1]), int(n), side, int(width))
  if ":" in span:
    start, stop = span.split(":")
    return stored, RowsPart(int(start), int(stop), int(total))
  return stored, ColumnsPart(int(span), int(total))


def _bounds(index, shape) -> list[tuple[int, int]]:
  """(start, stop) per dimension of `...`, a slice or a tuple of unit-step slices (missing trailing ones: whole)."""
  index = () if index is Ellipsis else index if isinstance(index, tuple) else (index,)
  index = index + (slice(None),) * (len(shape) - len(index))
  return [s.indices(n)[:2] for s, n in zip(index, shape)]


class Columns:
  """The columns i::n of a stored tensor's last axis as a tensor of its own, sliced lazily (the stored columns of
  the slice read in one range, then strided)."""

  def __init__(self, tensor, i: int, n: int):
    self.tensor, self.i, self.n = tensor, i, n
    self.shape = (*tensor.get_shape()[:-1], tensor.get_shape()[-1] // n)

  def get_shape(self):
    return list(self.shape)

  def get_dtype(self) -> str:
    return self.tensor.get_dtype()

  def __getitem__(self, index) -> np.ndarray:
    *lead, (c0, c1) = _bounds(index, self.shape)
    stored = tuple(slice(a, b) for a, b in lead) + (slice(c0 * self.n + self.i, c1 * self.n),)
    return np.asarray(self.tensor[stored])[..., :: self.n]


class Rows:
  """The rows start .. stop - 1 of a stored tensor's first axis as a tensor of its own, sliced lazily; the stored
  tensor refused, naming it, unless it is `total` rows long."""

  def __init__(self, name: str, tensor, part: RowsPart):
    self.tensor, self.start = tensor, part.start
    stored = tensor.get_shape()
    if stored[0] != part.total:
      raise ConfigError(f"checkpoint tensor {name} has {stored[0]} rows, expected {part.total} (its fused parts)")
    self.shape = (part.stop - part.start, *stored[1:])

  def get_shape(self):
    return list(self.shape)

  def get_dtype(self) -> str:
    return self.tensor.get_dtype()

  def __getitem__(self, index) -> np.ndarray:
    (r0, r1), *rest = _bounds(index, self.shape)
    return np.asarray(self.tensor[(slice(self.start + r0, self.start + r1), *(slice(a, b) for a, b in rest))])


class Item:
  """The entry i of a stored tensor's first axis as a tensor of its own (that axis dropped), sliced lazily; the
  stored tensor refused, naming it, unless its first axis is n long."""

  def __init__(self, name: str, tensor, part: ItemPart):
    self.tensor, self.i = tensor, part.i
    stored = tensor.get_shape()
    if not stored or stored[0] != part.n:
      raise ConfigError(f"checkpoint tensor {name} has shape {tuple(stored)}, expected ({part.n}, ...)")
    self.shape = tuple(stored[1:])

  def get_shape(self):
    return list(self.shape)

  def get_dtype(self) -> str:
    return self.tensor.get_dtype()

  def __getitem__(self, index) -> np.ndarray:
    rest = tuple(slice(a, b) for a, b in _bounds(index, self.shape))
    return np.asarray(self.tensor[(slice(self.i, self.i + 1), *rest)])[0]


class Block:
  """The i-th of n equal blocks of a stored tensor's last (or first) axis as a tensor of its own, sliced lazily."""

  def __init__(self, tensor, part: BlockPart):
    shape = list(tensor.get_shape())
    self.tensor, self.axis, self.width = tensor, part.axis % len(shape), shape[part.axis] // part.n
    self.start, self.shape = (
      part.i * self.width,
      tuple(self.width if a == self.axis else n for a, n in enumerate(shape)),
    )

  def get_shape(self):
    return list(self.shape)

  def get_dtype(self) -> str:
    return self.tensor.get_dtype()

  def __getitem__(self, index) -> np.ndarray:
    shift = lambda k: self.start if k == self.axis else 0
    return np.asarray(
      self.tensor[tuple(slice(a + shift(k), b + shift(k)) for k, (a, b) in enumerate(_bounds(index, self.shape)))]
    )


class Experts:
  """The i-th of n blocks of stacked experts' outputs [E, in, out], sliced lazily from the stored hub layout [E, in,
  n x out] or the modules' [E, n x out, in] (transformers' loader transposes the one that is not its module's shape);
  the stored tensor refused, naming it, where neither fits the part's width."""

  def __init__(self, name: str, tensor, part: ExpertsPart):
    experts, a, b = tensor.get_shape()
    # the modules' layout [E, n x out, in]: `in` last, `out` blocks in the middle axis
    modules_fit = (b == part.width and a % part.n == 0) if part.side == "in" else (a == part.width * part.n)
    hub_fit = (a == part.width and b % part.n == 0) if part.side == "in" else (b == part.width * part.n)
    if not (modules_fit or hub_fit):
      raise ConfigError(
        f"checkpoint tensor {name} has shape {(experts, a, b)}: neither [E, in, {part.n} x out] nor "
        f"[E, {part.n} x out, in] with {part.side} = {part.width}"
      )
    self.tensor, self.transposed = tensor, modules_fit
    width_in, out = (b, a // part.n) if modules_fit else (a, b // part.n)
    self.start, self.shape = part.i * out, (experts, width_in, out)

  def get_shape(self):
    return list(self.shape)

  def get_dtype(self) -> str:
    return self.tensor.get_dtype()

  def __getitem__(self, index) -> np.ndarray:
    (e0, e1), (r0, r1), (c0, c1) = _bounds(index, self.shape)
    outputs = slice(self.start + c0, self.start + c1)
    if self.transposed:
      return np.asarray(self.tensor[e0:e1, outputs, r0:r1]).transpose(0, 2, 1)
    return np.asarray(self.tensor[e0:e1, r0:r1, outputs])


VIEWS = (Columns, Rows, Item, Block, Experts)  # what `view` returns for a part; `.tensor` is the stored tensor


def view(name: str, tensor, part: ColumnsPart | RowsPart | ItemPart):
  """The part `part` of the stored tensor `tensor` (called `name`)."""
  if isinstance(part, RowsPart):
    return Rows(name, tensor, part)
  if isinstance(part, ItemPart):
    return Item(name, tensor, part)
  if isinstance(part, BlockPart):
    return Block(tensor, part)
  if isinstance(part, ExpertsPart):
    return Experts(name, tensor, part)
  return Columns(tensor, part.i, part.n)


def _join(parts: dict) -> np.ndarray | None:
  """The stored tensor of its parts {part: array} once they are all there (None before)."""
  first = next(iter(parts))
  if isinstance(first, ItemPart):
    return np.stack([parts[p] for p in sorted(parts)]) if len(parts) == first.n else None
  if isinstance(first, ExpertsPart):  # written as transformers' save_pretrained writes them, [E, n x out, in]
    joined = np.concatenate([parts[p] for p in sorted(parts)], axis=-1) if len(parts) == first.n else None
    return None if joined is None else np.ascontiguousarray(joined.transpose(0, 2, 1))
  if isinstance(first, BlockPart):
    return np.concatenate([parts[p] for p in sorted(parts)], axis=first.axis) if len(parts) == first.n else None
  if isinstance(first, RowsPart):
    if sum(p.stop - p.start for p in parts) != first.total:
      return None
    return np.concatenate([parts[p] for p in sorted(parts)], axis=0)
  if len(parts) != first.n:
    return None
  ordered = [parts[p] for p in sorted(parts)]
  return np.stack(ordered, axis=-1).reshape(*ordered[0].shape[:-1], -1)


def join_parts(tensors):
  """(name, array) pairs with the parts of a stored tensor joined into it (each yielded when its parts have all
  come: columns interleaved, rows and blocks one after another, items stacked, experts' blocks in transformers' modules'
  layout), the rest unchanged."""
  pending = {}
  for name, array in tensors:
    stored, part = split_part(name)
    if part is None:
      yield name, array
      continue
    pending.setdefault(stored, {})[part] = array
    joined = _join(pending[stored])
    if joined is not None:
      yield stored, joined
      del pending[stored]
