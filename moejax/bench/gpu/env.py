"""The env step: device, driver (nvidia-smi), versions, platform, environment and optional packages."""

import os
import platform as host_platform
import shutil
import subprocess
import sys

import jax

from moejax.bench.gpu.record import OPTIONAL_PACKAGES, Record, Terminated, say


def nvidia_smi() -> dict:
  exe = shutil.which("nvidia-smi")
  if exe is None:
    return {"available": False, "reason": "nvidia-smi not on PATH"}
  fields = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit,pci.bus_id"
  out = {"available": True}
  for key, command in (("query", [exe, f"--query-gpu={fields}", "--format=csv"]), ("full", [exe])):
    try:
      out[key] = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
      out[key] = f"{type(e).__name__}: {e}"
  return out


def step_env(config, rec: Record):
  del config
  rec["devices"] = [
    {"id": d.id, "kind": d.device_kind, "platform": d.platform, "process_index": d.process_index} for d in jax.devices()
  ]
  rec["platform_version"] = getattr(getattr(jax.devices()[0], "client", None), "platform_version", None)
  rec["nvidia_smi"] = nvidia_smi()
  rec["environment_info"] = jax.print_environment_info(return_string=True)
  rec["env_vars"] = {
    k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "CUDA_", "NVIDIA_")) or k in ("PYTHONPATH",)
  }
  rec["python_executable"] = sys.executable
  rec["machine"] = {"system": host_platform.system(), "machine": host_platform.machine(), "cpus": os.cpu_count()}
  imports = {}
  for name in OPTIONAL_PACKAGES:
    try:
      imports[name] = getattr(__import__(name), "__version__", "imported")
    except (Exception, Terminated) as e:  # pylint: disable=broad-except
      imports[name] = f"not importable: {type(e).__name__}: {e}".splitlines()[0]
  rec["optional_imports"] = imports
  say(f"{rec['device']} ({rec['platform']}) x{rec['device_count']}; versions {rec['versions']}")
  say(f"optional packages: {imports}")
