"""Input checks shared by the public kernels: shapes and dtypes fail at trace time, by name."""

import jax.numpy as jnp


def check_rank(name: str, x, rank: int, layout: str):
  if x.ndim != rank:
    raise ValueError(f"{name} must be {rank}-D {layout}, got shape {x.shape}")


def check_dim(name: str, x, axis: int, expected: int, what: str):
  if x.shape[axis] != expected:
    raise ValueError(f"{name}.shape[{axis}]={x.shape[axis]} does not match {what}={expected} ({name}.shape={x.shape})")


def check_floating(name: str, x):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")


def check_group_sizes(group_sizes, num_groups: int | None = None, what: str = ""):
  """group_sizes: [G] integer, G >= 1, and G == num_groups where given."""
  if group_sizes.ndim != 1:
    raise ValueError(f"group_sizes must be 1-D [G], got shape {group_sizes.shape}")
  if num_groups is not None and group_sizes.shape[0] != num_groups:
    raise ValueError(
      f"group_sizes has shape {group_sizes.shape}, expected ({num_groups},) to match {what}={num_groups}"
    )
  if group_sizes.shape[0] < 1:
    raise ValueError(f"need at least one group, got group_sizes.shape={group_sizes.shape}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be integer, got dtype {group_sizes.dtype}")
