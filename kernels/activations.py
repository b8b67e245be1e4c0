"""Expert activations, one definition shared by every expert backend.

gelu is the tanh approximation, `jax.nn.gelu(x, approximate=True)`: the Pallas Triton lowering
(jax 0.10) has no rule for erf/erfc, so the exact form cannot run inside the fused kernel. Other
backends (ragged_dot, dense reference) must use `ACTIVATIONS` too, or results differ by ~1e-3.
"""

import functools

import jax

GELU_APPROXIMATE = True

ACTIVATIONS = {
  "gelu": functools.partial(jax.nn.gelu, approximate=GELU_APPROXIMATE),
  "relu": jax.nn.relu,
  "silu": jax.nn.silu,
}


def get_activation(name: str):
  """The elementwise function called `name` (one of `ACTIVATIONS`)."""
  if name not in ACTIVATIONS:
    raise ValueError(f"activation={name!r} is not one of {sorted(ACTIVATIONS)}")
  return ACTIVATIONS[name]
