"""The checks the sweep's point-model tests share (tests/test_point_models.py, tests/test_hf_point_models.py), on a
sweep config of one model named 'dec' over a 1 x 2 mesh."""

import math

import jax
import numpy as np

from moejax.models.state import abstract_state
from moejax.runtime import mesh as mesh_lib
from moejax.study import point_models
from moejax.study.points import Point, moe_section, scheme_config
from moejax.study.price import price_point_layer


def built_tree(config) -> dict:
  """{path: size} of the parameters moejax.models builds for the sweep's model on a 1 x 2 mesh."""
  model = config.models.dec
  cfg = scheme_config("flat_dropless", 1, 2, moe_section(config, "dec"), model.d_model, model.d_ff)
  _, params, _ = abstract_state(point_models.training_model(model, "float32"), cfg, mesh_lib.make_mesh(1, 2))
  return {
    jax.tree_util.keystr(path): math.prod(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
  }


def check_dense_parameters(config) -> None:
  """`point_models.dense_params` is the built tree less its routed experts, and the sweep's own count of each MoE
  layer's routers and shared experts (what its step all-reduces) is the tree's, on a fresh random traffic."""
  tree = built_tree(config)
  routed = sum(
    size
    for path, size in tree.items()
    if "['moe']" in path and "['shared']" not in path and path.rsplit("[", 1)[1][1:-2].startswith("w_")
  )
  replicated = sum(size for path, size in tree.items() if "['router']" in path or "['shared']" in path)
  assert routed > 0 and replicated > 0
  model = config.models.dec
  assert point_models.dense_params(model, replicated / model.moe_layers, True) == sum(tree.values()) - routed
  traffic = np.random.default_rng().integers(0, 9, (1, 2, 2))
  sim = dict(traffic_rows=traffic.tolist(), rows_per_device=traffic[0].sum(0).tolist(), dropped=0, tokens_per_gpu=8)
  sim["control"] = dict(collectives=[], node_of=[0, 0])  # a hand-made run: no control collectives
  layer = price_point_layer(sim, Point("flat_dropless", 1, 2, "dec", "weak"), config)
  assert layer["moe_replicated"] * model.moe_layers == replicated
