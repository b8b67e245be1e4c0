"""How a language model is laid out over the mesh and trained, the same fields for SMILE's models (`ModelConfig`)
and the decoder families (`DecoderConfig`): tensor parallelism, Lina's gradient sync, FSDP, rematerialisation,
scanned layers."""

import dataclasses

from moejax.validation import require

GRAD_SYNCS = ("default", "prioritized")
REMATS = ("none", "full", "save_exchanged", "save_matmuls")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
  """tensor_parallel: Megatron-style tensor parallelism of the dense parts over 'gpu': attention heads and the dense
    FFN's hidden units split over the node's GPUs (one all-reduce after each), activations sharded over 'node'
    only, so the MoE layers see their input replicated over 'gpu' (Parm's setting, `MoEConfig.esp_schedule`).
    False: data parallelism over both axes.
  grad_sync: 'default' (XLA places the data-parallel gradient all-reduces) or 'prioritized' (Lina): each block's
    parameter gradients are reduced as one bucket as soon as its backward is done, and the gradient flowing on to
    the block below waits for that bucket, so no bucket's all-reduce runs during another block's backward
    all-to-alls. Same gradients (`moejax.models.grad_sync`).
  fsdp: FSDP (ZeRO-3): the dense parameters, their gradients and optimizer states sharded over the data-parallel
    devices (both axes, or 'node' with tensor_parallel), gathered where used, gradients reduce-scattered.
  remat: what the backward recomputes of each block: 'none' (keeps every activation), 'full' (recomputes the
    block from its input), 'save_exchanged' (keeps the MoE layer's exchanged rows, so no exchange runs twice),
    'save_matmuls' (keeps the matmuls' outputs).
  scan_layers: the repeated layers' parameters stacked [repeats, ...] per segment and run by one `jax.lax.scan` each, so
    the compiled program (and its compile time) does not grow with depth (`moejax.models.layers`); False: one
    module per layer, unrolled (`blocks/i/...`: the layout of checkpoints written before scanned layers).
  """

  tensor_parallel: bool = False
  grad_sync: str = "default"
  fsdp: bool = False
  remat: str = "none"
  scan_layers: bool = True

  def check_parallelism(self) -> None:
    for name in ("tensor_parallel", "fsdp", "scan_layers"):
      require(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
    require(self.grad_sync in GRAD_SYNCS, "grad_sync", self.grad_sync, f"one of {GRAD_SYNCS}")
    require(self.remat in REMATS, "remat", self.remat, f"one of {REMATS}")

  # The sizes (heads, widths) tensor parallelism splits over a node's GPUs; each model config names its own (not
  # annotated: a class constant, not a dataclass field).
  TENSOR_PARALLEL_SIZES = ()

  def check_mesh(self, nodes: int, gpus_per_node: int) -> None:
    """Refuses, naming the field, a model that does not fit a nodes x gpus_per_node mesh: with tensor parallelism,
    TENSOR_PARALLEL_SIZES split evenly over a node's GPUs (the nodes are data parallel: any count fits). The
    signature of `MoEConfig.check_mesh`."""
    del nodes
    if self.tensor_parallel:
      for name in self.TENSOR_PARALLEL_SIZES:
        value = getattr(self, name)
        require(
          value % gpus_per_node == 0,
          name,
          value,
          f"a multiple of the mesh's {gpus_per_node} GPUs per node (tensor_parallel=True splits it over them)",
        )
