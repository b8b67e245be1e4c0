"""What every step of the GPU suite shares: its record <workdir>/<step>.json (rewritten as the step goes), the
machine's versions, timing statistics, and the signal that stops a step."""

import datetime
import importlib.metadata
import json
import os
import platform as host_platform
import statistics
import sys
import time

import jax
import numpy as np

OPTIONAL_PACKAGES = ("ml_collections", "tensorboardX", "tokamax", "qwix")


def timing(times: list[float]) -> dict:
  """Every timed call (seconds), their median and minimum."""
  return {"times_s": list(times), "median_s": statistics.median(times), "min_s": min(times)}


def package_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def versions() -> dict:
  import jaxlib  # pylint: disable=import-outside-toplevel

  out = {
    "python": host_platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "numpy": np.__version__,
  }
  for name in ("flax", "optax", "orbax-checkpoint", *OPTIONAL_PACKAGES):
    out[name] = package_version(name)
  return out


def utc_now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Record:
  """<workdir>/<step>.json, rewritten (atomically) on every `save`; `config` is the suite's (configs/gpu_suite.py)."""

  def __init__(self, workdir: str, step: str, config):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.path = os.path.join(workdir, f"{step}.json")
    self.start = time.perf_counter()
    device = jax.devices()[0]
    self.data = {
      "step": step,
      "status": "running",
      "smoke": config.smoke,
      "device": device.device_kind,
      "platform": device.platform,
      "device_count": jax.device_count(),
      "versions": versions(),
      "argv": sys.argv[1:],
      "started_utc": utc_now(),
    }

  def __setitem__(self, key, value):
    self.data[key] = value

  def __getitem__(self, key):
    return self.data[key]

  def setdefault(self, key, default):
    return self.data.setdefault(key, default)

  def save(self, status: str | None = None):
    if status is not None:
      self.data["status"] = status
      self.data["finished_utc"] = utc_now()
    self.data["wall_s"] = time.perf_counter() - self.start
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.data, f, indent=1, default=str)
    os.replace(tmp, self.path)


def say(*parts):
  print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


class Terminated(BaseException):
  """SIGTERM (e.g. from `timeout` in gpu_suite.sh): the step stops and its record says so. A
  BaseException, so that the per-case `except Exception` of bench_kernels.run lets it through."""
