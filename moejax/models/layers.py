"""Where a model's layers live: unrolled (scan_layers=False: one module per layer, state `blocks/i/...`) or scanned
(scan_layers=True: state `segments/s/j/...`, every leaf stacked [repeats, ...] over a segment's repeats, each segment run
by one `jax.lax.scan`, `moejax.models.backbone.fold_layers`).

A segment is a unit of `period` consecutive layers repeated `repeats` times: layer start + r * period + j is repeat r
of the unit's sub-layer j. Layers are of one kind when their modules differ only in their arrays (the FFN, dense or
MoE; the attention's sliding window; the token mixer: Qwen3-Next's three gated DeltaNet layers and one attention
layer are a unit of period 4), so the repeats of a sub-layer stack. From the first layer on, each segment
covers as many layers as one unit can: DeepSeek's dense first layers are a segment of period 1 and its MoE layers
another; SMILE's every-other MoE layer one segment of period 2 (dense, MoE); a layer that repeats nothing (Qwen2-MoE's
dense layer among MoE layers) a segment of one layer. The MTP modules are not layers here (they stay outside).

Per-layer trees (`per_layer`, `with_per_layer`) and `where` translate between layer i and the state's paths, so
checkpoints, placement and upcycling read and write layers whatever the layout.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.models import deepseek_v4_mixer
from moejax.validation import ConfigError


@dataclasses.dataclass(frozen=True)
class Segment:
  """Layers start + r * period + j for r < repeats, j < period; sub-layer j's repeats are one stacked module."""

  start: int
  period: int
  repeats: int

  @property
  def stop(self) -> int:
    return self.start + self.period * self.repeats

  def layer(self, r: int, j: int) -> int:
    return self.start + r * self.period + j


def find_segments(kinds: tuple) -> tuple[Segment, ...]:
  """The segments of layers of the given kinds (one hashable per layer), greedily from the first layer: the unit
  (period p, repeated r >= 2 times when p > 1) covering the most layers, the shortest such unit on a tie."""
  segments, start, n = [], 0, len(kinds)
  while start < n:
    run = next((i for i in range(start, n) if kinds[i] != kinds[start]), n) - start
    best = Segment(start, 1, run)
    for period in range(2, (n - start) // 2 + 1):
      unit = kinds[start : start + period]
      if len(set(unit)) == 1:  # one kind: the run of period 1 covers at least as much
        continue
      repeats = 1
      while kinds[start + repeats * period : start + (repeats + 1) * period] == unit:
        repeats += 1
      if repeats >= 2 and period * repeats > best.period * best.repeats:
        best = Segment(start, period, repeats)
    segments.append(best)
    start = best.stop
  return tuple(segments)


def kinds(cfg) -> tuple:
  """Each layer's kind, the layers of a kind alike (`ModelConfig` or `DecoderConfig`: MoE or dense FFN, and a
  decoder's sliding window, token mixer, `DecoderConfig.mixers`, and NoPE layers, `nope_layers`)."""
  window, mixer = getattr(cfg, "window", lambda i: None), getattr(cfg, "mixer", lambda i: "attention")
  nope = getattr(cfg, "nope_layers", None) or (False,) * cfg.num_layers
  hashed = getattr(cfg, "hash_layers", None) or (False,) * cfg.num_layers  # a hash MoE layer holds its table
  v4 = lambda i: deepseek_v4_mixer.attention_config(cfg, i) if mixer(i) == "deepseek_v4" else None  # its shapes
  return tuple(
    (cfg.is_moe(i), window(i), mixer(i), bool(nope[i]), bool(hashed[i]), v4(i)) for i in range(cfg.num_layers)
  )


@functools.cache
def segments(cfg) -> tuple[Segment, ...]:
  """The segments of a model config, by its layers' `kinds`."""
  return find_segments(kinds(cfg))


@functools.cache
def where(cfg) -> tuple[tuple[tuple, int | None], ...]:
  """Per layer i: (the path of its subtree in the model's state, its index on the leaves' leading axis or None):
  (('blocks', i), None) unrolled, (('segments', s, j), r) scanned."""
  if not cfg.scan_layers:
    return tuple((("blocks", i), None) for i in range(cfg.num_layers))
  found = {
    seg.layer(r, j): (("segments", s, j), r)
    for s, seg in enumerate(segments(cfg))
    for r in range(seg.repeats)
    for j in range(seg.period)
  }
  return tuple(found[i] for i in range(cfg.num_layers))


def layer_container(cfg) -> str:
  """The state's top-level key of the layers: 'segments' scanned, 'blocks' unrolled."""
  return "segments" if cfg.scan_layers else "blocks"


def stacked(layers: list, cfg) -> nnx.List:
  """The layers' modules (one per layer, in order) as a scanned model holds them: per segment an nnx.List of its
  sub-layers' modules, each holding its repeats' Variables stacked [repeats, ...] (the same values as the unrolled
  layers')."""
  out = []
  for seg in segments(cfg):
    subs = []
    for j in range(seg.period):
      graphdefs, states = zip(*(nnx.split(layers[seg.layer(r, j)]) for r in range(seg.repeats)))
      if any(g != graphdefs[0] for g in graphdefs):  # a per-layer setting the kinds above do not know
        raise ConfigError(
          f"layers {[seg.layer(r, j) for r in range(seg.repeats)]} differ in more than their arrays, "
          "so one scanned body cannot run them: set scan_layers=False",
          "scan_layers",
          True,
          "False",
        )
      subs.append(nnx.merge(graphdefs[0], jax.tree.map(lambda *a: jnp.stack(a), *states)))
    out.append(nnx.List(subs))
  return nnx.List(out)


def layer_module(model, i: int) -> nnx.Module:
  """Layer i of a model as a module: the unrolled model's own block (changes to it change the model), or a copy of
  repeat r of the scanned model's stacked module (changes to it do not)."""
  path, r = where(model.cfg)[i]
  if r is None:
    return model.blocks[path[1]]
  graphdef, state = nnx.split(model.segments[path[1]][path[2]])
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[r], state))


class LayerViews:
  """For a model class (beside nnx.Module): `model.blocks` of a scanned model, each layer's module as a copy
  (`layer_module`), so code that reads the layers one by one reads a scanned model too. Writing to the copies
  changes nothing: change a layer through the state (`per_layer`, `with_per_layer`, `moejax.models.state`)."""

  def __getattr__(self, name):  # only when the instance has no such attribute: `blocks` of a scanned model
    cfg = self.__dict__.get("cfg")
    if name == "blocks" and cfg is not None and cfg.scan_layers:
      return tuple(layer_module(self, i) for i in range(cfg.num_layers))
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def subtree(tree: dict, path: tuple, r: int | None):
  """The pure-dict subtree of `tree` at `path`, its leaves indexed [r] when r is not None ({} where `tree` has
  nothing: a state filtered to some variables, e.g. the MoE layers' non-parameters, leaves the other layers out)."""
  for key in path:
    tree = tree.get(key, {})
  return tree if r is None else jax.tree.map(lambda a: a[r], tree)


def per_layer(tree: dict, cfg) -> list:
  """A pure-dict state tree (params, or the other state) -> each layer's subtree, in order (unstacked copies of a
  scanned tree's repeats)."""
  return [subtree(tree, path, r) for path, r in where(cfg)]


def _stack(leaves):
  return jnp.stack(leaves) if any(isinstance(a, jax.Array) for a in leaves) else np.stack(leaves)


def with_per_layer(tree: dict, layers: list, cfg) -> dict:
  """`tree` (a pure dict; its layers' entries, if any, are replaced) with `layers` (each layer's subtree, in order)
  laid out as `cfg` says: `blocks` {i: subtree}, or `segments` {s: {j: the repeats' leaves stacked [repeats, ...]}}."""
  out = {k: v for k, v in tree.items() if k not in ("blocks", "segments")}
  if not cfg.scan_layers:
    blocks = {i: layer for i, layer in enumerate(layers) if layer}  # empty: the layer has nothing in this state
    return {**out, "blocks": blocks} if blocks else out
  stack = lambda seg, j: jax.tree.map(lambda *a: _stack(a), *(layers[seg.layer(r, j)] for r in range(seg.repeats)))
  found = {
    s: {j: stack(seg, j) for j in range(seg.period) if layers[seg.layer(0, j)]} for s, seg in enumerate(segments(cfg))
  }
  found = {s: subs for s, subs in found.items() if subs}
  return {**out, "segments": found} if found else out


def map_outputs(fn, outputs: list, cfg) -> list:
  """`fn` on each entry of a layer tree (`fold_layers`' outputs: per layer, or per segment per sub-layer)."""
  if not cfg.scan_layers:
    return [fn(o) for o in outputs]
  return [[fn(o) for o in outs] for outs in outputs]


def stack_selected(outputs: list, cfg, select):
  """The outputs of the layers i with select(i) (a function of the layer's kind, the same for a sub-layer's
  repeats), stacked [count, ...] in layer order from a layer tree of pytrees of one structure; None if none."""
  if not cfg.scan_layers:
    chosen = [o for i, o in enumerate(outputs) if select(i)]
    return jax.tree.map(lambda *a: jnp.stack(a), *chosen) if chosen else None
  parts = []
  for seg, outs in zip(segments(cfg), outputs):
    subs = [outs[j] for j in range(seg.period) if select(seg.layer(0, j))]
    if subs:  # [repeats, ...] per sub-layer -> [repeats, subs, ...] -> layer order r * len(subs) + the sub-layer's rank
      parts.append(jax.tree.map(lambda *a: jnp.stack(a, axis=1).reshape(-1, *a[0].shape[1:]), *subs))
  return jax.tree.map(lambda *a: jnp.concatenate(a), *parts) if parts else None
