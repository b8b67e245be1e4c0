"""`import moejax` offers the layer's public API, and nothing of the repository beside the package."""

import importlib
import subprocess
import sys

import pytest

import moejax
from moejax.moe import config, layer, module, overflow, params, reference
from moejax.runtime import mesh
from tests.helpers import ENV, ROOT


def test_public_names_are_the_modules_objects():
  assert moejax.MoEConfig is config.MoEConfig
  assert moejax.MoELayer is module.MoELayer
  assert moejax.moe_apply is layer.moe_apply
  assert moejax.apply_without_overflow is overflow.apply_without_overflow
  assert moejax.init_params is params.init_params
  assert moejax.moe_reference is reference.moe_reference
  assert moejax.make_mesh is mesh.make_mesh
  assert moejax.simulate_cpu_devices is mesh.simulate_cpu_devices
  assert issubclass(moejax.ConfigError, ValueError)
  with pytest.raises(AttributeError, match="no_such_name"):
    moejax.no_such_name  # noqa: B018


def test_kernels_importable_as_moejax_kernels():
  kernels = importlib.import_module("kernels")
  assert hasattr(importlib.import_module("kernels.gmm"), "gmm") and kernels.__name__ == "kernels"


def test_repository_root_is_not_a_subpackage():
  # kernels/, configs/ and experiments/ are moejax's subpackages (tests/test_packaging.py); tests/ is not, nor the root.
  for name in ("moejax.tests", "moejax.moejax"):
    run = subprocess.run(
      [sys.executable, "-c", f"import {name}"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0 and "ModuleNotFoundError" in run.stderr, name
