"""The rows' dtype on the wire (`MoEConfig.dispatch_dtype`, `combine_dtype`): a row encoded before an exchange,
decoded after it, and the bytes it costs.

FP8 rows (e4m3) carry a float32 scale per block of 128 elements, DeepSeek-V3's fine-grained quantisation:
scale = amax / 448 (e4m3's largest finite value), each element x / scale rounded to e4m3. The scales' bytes
ride in the same row as 4 more e4m3 columns per block (bit patterns, not values), so a row moves in one
exchange. Decoding multiplies back; encoding a decoded row again gives the same e4m3 values (its amax maps to
448), with a scale within float32 rounding of the first, so a row re-encoded at each hop of a two-hop path
changes by ~2e-7 relatively beyond its first encoding. A non-finite element makes its block non-finite after
decoding (never a finite wrong value); the layer counts such tokens (aux['nonfinite_tokens']).
"""

import dataclasses

import jax
import jax.numpy as jnp

FP8 = "float8_e4m3fn"
BLOCK = 128  # elements per scale
FP8_MAX = 448.0
SCALE_BYTES = 4
ID_BYTES = WEIGHT_BYTES = FLAG_BYTES = 4  # a slot's int32 expert id, float32 weight, int32 arrival flag


def _blocks(d: int) -> int:
  return -(-d // BLOCK)


def encode(x_RxD, dtype: str | None):
  """x [R, d] as it travels: unchanged (None), cast, or e4m3 with its scales [R, d + 4 * ceil(d / 128)]."""
  if dtype is None:
    return x_RxD
  if dtype != FP8:
    return x_RxD.astype(dtype)
  rows, d = x_RxD.shape
  blocks = _blocks(d)
  x_RxBxK = jnp.pad(x_RxD.astype(jnp.float32), ((0, 0), (0, blocks * BLOCK - d))).reshape(rows, blocks, BLOCK)
  amax_RxB = jnp.max(jnp.abs(x_RxBxK), axis=2)
  scale_RxB = jnp.where(amax_RxB > 0, amax_RxB / FP8_MAX, 1.0)
  q_RxD = (x_RxBxK / scale_RxB[..., None]).astype(jnp.float8_e4m3fn).reshape(rows, -1)[:, :d]
  scale_bits = jax.lax.bitcast_convert_type(scale_RxB, jnp.uint8).reshape(rows, blocks * SCALE_BYTES)
  return jnp.concatenate([q_RxD, jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn)], axis=1)


def decode(y, dtype: str | None, d: int, out_dtype):
  """The mirror of `encode`: rows of width d in `out_dtype`."""
  if dtype != FP8:
    return y.astype(out_dtype)
  rows, blocks = y.shape[0], _blocks(d)
  scale_bits = jax.lax.bitcast_convert_type(y[:, d:], jnp.uint8).reshape(rows, blocks, SCALE_BYTES)
  scale_RxB = jax.lax.bitcast_convert_type(scale_bits, jnp.float32)
  q_RxBxK = jnp.pad(y[:, :d].astype(jnp.float32), ((0, 0), (0, blocks * BLOCK - d))).reshape(rows, blocks, BLOCK)
  return (q_RxBxK * scale_RxB[..., None]).reshape(rows, -1)[:, :d].astype(out_dtype)


def round_trip(x_RxD, dtype: str | None):
  """x as it arrives after one exchange in `dtype` (the reference's view of a quantised dispatch)."""
  return decode(encode(x_RxD, dtype), dtype, x_RxD.shape[1], x_RxD.dtype)


def payload_bytes(dtype: str | None, d: int, itemsize: int) -> int:
  """Bytes of a row's payload of width d in `dtype` (None: `itemsize` per element), scales included."""
  if dtype is None:
    return d * itemsize
  if dtype == FP8:
    return d + SCALE_BYTES * _blocks(d)
  return d * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class RowBytes:
  """Bytes of one row in each exchange of a layer (s: the token's device, p: its experts' device).

  dispatch: forward, s -> p; combine: forward, p -> s; dispatch_grad: the dispatch's backward, p -> s;
  combine_grad: the combine's backward, s -> p.
  """

  dispatch: float
  combine: float
  dispatch_grad: float
  combine_grad: float

  @classmethod
  def uniform(cls, bytes_per_row: float) -> "RowBytes":
    """Every exchange at the same bytes per row."""
    return cls(bytes_per_row, bytes_per_row, bytes_per_row, bytes_per_row)

  @property
  def backward(self) -> "RowBytes":
    """The backward's exchanges in the forward's places: the combine's gradients travel the dispatch's way
    (s -> p), the dispatch's come back the combine's way (p -> s)."""
    return RowBytes(self.combine_grad, self.dispatch_grad, self.combine, self.dispatch)

  def passes(self, backward: bool) -> tuple["RowBytes", ...]:
    """The forward's bytes, then with `backward` the backward's (`backward` property): one per pass."""
    return (self, self.backward) if backward else (self,)


def row_bytes(
  d: int,
  slots: int,
  itemsize: int,
  dispatch_dtype: str | None = None,
  combine_dtype: str | None = None,
  may_drop: bool = False,
) -> RowBytes:
  """A row's bytes in each exchange as the layer moves it (`moe.traffic.traffic_bytes`, the cost model).

  d: the row's width; slots: the choices a row carries (with dedup the token's K, without 1); itemsize: the
  activations' bytes per element (the dispatch's payload and its gradient when their dtype is None); the dtypes
  as `MoEConfig.dispatch_dtype` / `combine_dtype` (`payload_bytes`: FP8 adds a float32 scale per 128
  elements); may_drop: a hop may drop entries (a bounded buffer, the dense kind), so the slots' int32
  arrival flags come back with the results.

    dispatch       payload(dispatch_dtype, activations) + slots x (int32 id + float32 weight)
    combine        payload(combine_dtype, float32) + slots x int32 flag where a hop may drop
    dispatch_grad  payload(combine_dtype, activations) + slots x float32 (the weights' gradients)
    combine_grad   payload(combine_dtype, float32)

  (the experts' results are float32 rows, so a None combine dtype moves 4 bytes per element both ways).
  """
  payload = payload_bytes
  return RowBytes(
    dispatch=payload(dispatch_dtype, d, itemsize) + slots * (ID_BYTES + WEIGHT_BYTES),
    combine=payload(combine_dtype, d, 4) + (slots * FLAG_BYTES if may_drop else 0),
    dispatch_grad=payload(combine_dtype, d, itemsize) + slots * WEIGHT_BYTES,
    combine_grad=payload(combine_dtype, d, 4),
  )


def layer_row_bytes(cfg, d: int, itemsize: int) -> RowBytes:
  """`row_bytes` of the layer `cfg` at width d, activations of `itemsize` bytes: slots per row K with dedup (1
  without), arrival flags back where a hop may drop (a bounded buffer, the capacity collective's blocks)."""
  slots = cfg.choices_per_token if cfg.deduplicates else 1
  may_drop = cfg.buffer_factor is not None or cfg.collective_kind.fixed_blocks
  return row_bytes(d, slots, itemsize, cfg.dispatch_dtype, cfg.combine_dtype, may_drop)
