"""Lina's prioritised gradient synchronisation: the all-to-all before the all-reduce.

In data-parallel training the backward pass runs the MoE layers' all-to-alls while the gradient
all-reduces of the blocks above are still in flight, and the two share the network (Lina, ATC'23,
Sec. 2-3). 'prioritized' keeps them apart: at each block's input an identity with a custom backward
reduces the block's parameter gradients as one bucket (a sharding constraint to the parameters' own
layout, which is where XLA's SPMD partitioner places the data-parallel all-reduce) and releases the
gradient of the block's input only together with that bucket (`optimization_barrier`). The block
below, and with it its backward all-to-alls, starts after the bucket is reduced; a bucket's
all-reduce can overlap only its own block's compute. The values are unchanged: identical gradients.
"""

import jax
from flax import nnx
from jax.sharding import NamedSharding


def reduce_before_passing_on(block: nnx.Module, x, mesh: jax.sharding.Mesh, specs: dict):
  """Ties `block`'s parameters to its input x [B, S, d] (identity forward); in the backward, the
  parameters' gradients are reduced to their layout `specs` (a pure dict of PartitionSpecs, as the
  parameters) before x's gradient passes on. Updates the block's parameters in place; returns x."""
  state = nnx.state(block, nnx.Param)
  params = nnx.to_pure_dict(state)
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)

  @jax.custom_vjp
  def tie(params, x):
    return params, x

  def tie_fwd(params, x):
    return (params, x), None

  def tie_bwd(_, grads):
    grad_params, grad_x = grads
    grad_params = jax.lax.with_sharding_constraint(grad_params, shardings)
    return jax.lax.optimization_barrier((grad_params, grad_x))

  tie.defvjp(tie_fwd, tie_bwd)
  params, x = tie(params, x)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(block, state)
  return x
