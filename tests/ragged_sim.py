"""A NumPy model of jax.lax.ragged_all_to_all over A simulated devices (the semantics, plainly)."""

import numpy as np


def ragged_all_to_all(operands, outputs, args):
  """operands/outputs: per-device arrays; args: per-device (input_offsets, send_sizes, output_offsets,
  recv_sizes). Returns the new outputs; checks that every receiver expects what is sent."""
  outputs = [np.array(o, copy=True) for o in outputs]
  for s, (input_offsets, send_sizes, output_offsets, _) in enumerate(args):
    for p in range(len(operands)):
      size = int(send_sizes[p])
      assert int(args[p][3][s]) == size, (s, p, "receiver expects a different size")
      rows = operands[s][int(input_offsets[p]) : int(input_offsets[p]) + size]
      outputs[p][int(output_offsets[p]) : int(output_offsets[p]) + size] = rows
  return outputs
