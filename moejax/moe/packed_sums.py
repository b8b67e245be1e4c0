"""A layer's statistics summed over the mesh in as few all-reduce operands as their axes and dtypes allow.

XLA combines a program's small independent psums into one all-reduce of many operands, and a collective library
runs each operand as a call of its own: on the 2-process CPU job (gloo) each costs milliseconds, and the switch
layer's statistics took 14 and 25 ms as all-reduces of 4 and 5 operands against a forward of 75 ms. Packed, the
statistics of one (axes, dtype) are one flat vector, summed once, split back: the sums are the same, element by
element.
"""

import jax
import jax.numpy as jnp


def psum_packed(named: dict) -> dict:
  """{name: (tree, axes)} -> {name: jax.lax.psum(tree, axes)}, one all-reduce operand per (axes, dtype): every leaf
  of that group raveled into one vector [sum of the leaves' sizes], summed, cut back into the leaves' shapes."""
  leaves, where = {}, {}  # per (axes, dtype): the leaves in order; per name: its treedef and each leaf's group slot
  for name, (tree, axes) in named.items():
    flat, treedef = jax.tree.flatten(tree)
    slots = []
    for leaf in flat:
      key = (tuple(axes), jnp.result_type(leaf))
      group = leaves.setdefault(key, [])
      slots.append((key, len(group)))
      group.append(jnp.asarray(leaf))
    where[name] = (treedef, slots)
  summed = {}
  for key, group in leaves.items():
    total = jax.lax.psum(jnp.concatenate([leaf.reshape(-1) for leaf in group]), key[0])
    cuts, start = [], 0
    for leaf in group:
      cuts.append(total[start : start + leaf.size].reshape(leaf.shape))
      start += leaf.size
    summed[key] = cuts
  return {
    name: jax.tree.unflatten(treedef, [summed[key][i] for key, i in slots]) for name, (treedef, slots) in where.items()
  }
