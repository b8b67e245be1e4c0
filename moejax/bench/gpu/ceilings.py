"""The ceilings step: bf16 dense GEMM TFLOP/s (square, several sizes) and on-device copy GB/s, the rates the other
steps are judged against."""

import jax
import jax.numpy as jnp

from kernels.tuning import time_call
from moejax.bench.gpu.record import Record, say, timing


def step_ceilings(config, rec: Record):
  sizes = [256] if config.smoke else list(config.gemm_sizes)
  copy_bytes = (4 if config.smoke else config.copy_mib) * 2**20
  gemm = []
  matmul = jax.jit(lambda a, b: a @ b)  # bf16 inputs and output; accumulation in fp32
  for n in sizes:
    ka, kb = jax.random.split(jax.random.key(n))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    entry = {
      "m": n,
      "n": n,
      "k": n,
      "dtype": "bfloat16",
      "flops": 2 * n**3,
      **timing(time_call(matmul, (a, b), config.warmup, config.iters)),
    }
    entry["tflops"] = entry["flops"] / entry["median_s"] / 1e12
    gemm.append(entry)
    rec["gemm"] = gemm
    rec.save()
    say(f"gemm {n}^3 bf16: {entry['median_s'] * 1e3:.3f} ms, {entry['tflops']:.4g} TFLOP/s")
    del a, b
  best = max(gemm, key=lambda e: e["tflops"])
  rec["gemm_tflops"], rec["gemm_tflops_size"] = best["tflops"], best["n"]

  x = jax.random.normal(jax.random.key(1), (copy_bytes // 2,), jnp.bfloat16)
  copies = []
  # Bytes counted: one read and one write of the buffer.
  for name, fn in (("copy", jax.jit(jnp.copy)), ("scale", jax.jit(lambda v: v * 2))):
    entry = {
      "kind": name,
      "bytes": copy_bytes,
      "bytes_moved": 2 * copy_bytes,
      **timing(time_call(fn, (x,), config.warmup, config.iters)),
    }
    entry["gbps"] = entry["bytes_moved"] / entry["median_s"] / 1e9
    copies.append(entry)
    say(
      f"on-device {name} of {copy_bytes / 2**20:.0f} MiB: {entry['median_s'] * 1e3:.3f} ms, "
      f"{entry['gbps']:.4g} GB/s (read + write)"
    )
  devices = jax.devices()
  if len(devices) > 1:  # between two devices: bytes counted once
    put = lambda v: jax.device_put(v, devices[1])
    entry = {
      "kind": "device_put_0_to_1",
      "bytes": copy_bytes,
      "bytes_moved": copy_bytes,
      **timing(time_call(put, (x,), config.warmup, config.iters)),
    }
    entry["gbps"] = entry["bytes_moved"] / entry["median_s"] / 1e9
    copies.append(entry)
    say(f"device 0 -> 1 of {copy_bytes / 2**20:.0f} MiB: {entry['gbps']:.4g} GB/s")
  rec["copy"] = copies
  rec["copy_gbps"] = max(e["gbps"] for e in copies if e["kind"] in ("copy", "scale"))
