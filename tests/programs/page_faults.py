"""Prints, as one JSON line, the minor page faults of each run of a CPU program whose temp buffer is larger than
glibc's largest mmap threshold (32 MiB) and than a thread arena's heap (64 MiB), with freed memory kept (`retain` as
the argument) or not (`default`). Every run after the compiling call is counted: with the heap's reserve none needs
a warm-up."""

import json
import resource
import sys

from moejax.runtime import host_allocator

RUNS = 8  # without the reserve, the kept heap grew by the temp buffer in up to 5 of its first 8 runs


def main():
  refused = host_allocator.retain_freed_memory() if sys.argv[1] == "retain" else None
  import jax
  import jax.numpy as jnp

  def program(a_N):  # two scans and a reversal: temporaries XLA cannot fuse away
    y_N = jnp.cumsum(a_N)
    z_N = jnp.cumsum(y_N[::-1])
    return jnp.sum(z_N * y_N)

  x_N = jax.random.normal(jax.random.key(0), (1 << 23,))
  compiled = jax.jit(program).lower(x_N).compile()
  faults = []
  for _ in range(RUNS):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(compiled(x_N))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  temp = compiled.memory_analysis().temp_size_in_bytes
  print(json.dumps(dict(refused=refused, temp_bytes=temp, faults=faults)))


if __name__ == "__main__":
  main()
