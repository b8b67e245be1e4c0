"""The memory planner's rows (`experiments/memory.py`): what a row says was planned (`setting`), and a pipelined row,
counted analytically (`plan_pipelined`)."""

from moejax.pipeline import memory as pipeline_memory
from moejax.pipeline import schedules
from moejax.study import memory as memory_lib
from moejax.study import memory_compile
from moejax.study.memory import GB
from moejax.validation import require


def setting(full, model_cfg, moe_cfg, configured: str) -> dict:
  """A row's fields that say what was planned: the layout, dtypes, optimizer, micro-batch and collective."""
  devices = full.mesh.nodes * full.mesh.gpus_per_node
  return {
    "fsdp": model_cfg.fsdp,
    "remat": model_cfg.remat,
    "param_dtype": getattr(model_cfg, "param_dtype", "float32"),
    "dtype": model_cfg.dtype,
    "optim": {k: full.optim.get(k) for k in ("name", "master_dtype", "moment_dtype")},
    "micro_batch": {
      "sequences_per_device": full.batch_size // full.micro_batches // devices,
      "seq_len": full.seq_len,
      "micro_batches": full.micro_batches,
    },
    "collective": {"configured": configured, "compiled": moe_cfg.collective},
  }


def analytic(full, model_cfg, moe_cfg, exchange: dict | None) -> dict:
  """The analytic count of a compiled row's config (`full`: the checked training config): its state, one
  micro-batch's activations and the exchange buffers per device, and their total."""
  from moejax.train import objective

  devices = full.mesh.nodes * full.mesh.gpus_per_node
  count = memory_lib.analytic_state(model_cfg, moe_cfg, full.mesh.nodes, full.mesh.gpus_per_node, full.optim)
  sequences, chunk = full.batch_size // full.micro_batches // devices, full.get("loss_chunk", objective.LOSS_CHUNK)
  count.update(memory_lib.analytic_activations(model_cfg, moe_cfg, sequences, full.seq_len, exchange, chunk))
  count["exchange_buffers"] = exchange["bytes"] if exchange else 0.0
  count["total"] = sum(count[k] for k in ("parameters", "optimizer", "gradients", "activations", "exchange_buffers"))
  return count


def plan_pipelined(config, schedule: str, stages: int, virtual_stages: int = 1, device_gb: float = 80.0) -> dict:
  """A row of the planner for `config` (its mesh: one stage's nodes x GPUs; its micro_batches through the stages)
  pipelined by `schedule` (`moejax.pipeline.schedules`): the analytic count of the busier end stage's devices
  (`pipeline_count` of `moejax.pipeline.memory.per_device`) and its verdict. Not compiled: the step
  runs two of the five schedules, and a stage's program at DeepSeek-V3's size on CPU devices is out of reach here."""
  from moejax.runtime import mesh as mesh_lib
  from moejax.train import objective

  section = config.get("pipeline")
  planned = None if section is None else schedules.SCHEDULES.get(section.schedule)
  require(
    section is None or (planned is not None and planned.plain),
    "pipeline.schedule",
    section and section.schedule,
    "'none' in the planned training config: the planner's pipeline is planner.schedule",
  )
  nodes, gpus = config.mesh.nodes, config.mesh.gpus_per_node
  mesh = mesh_lib.make_mesh(nodes, gpus)
  _, configured, (full, model_cfg, moe_cfg) = memory_compile.checked_on(config, mesh)
  rows = full.batch_size // full.micro_batches
  exchange = memory_lib.exchange_bytes(moe_cfg, mesh, rows * full.seq_len) if model_cfg.num_moe_layers else None
  per = pipeline_memory.per_device(schedule, stages, full.micro_batches, virtual_stages)
  stage_devices = len(schedules.timetable(schedule, stages, full.micro_batches, virtual_stages).slots)
  analytic = pipeline_count(
    model_cfg,
    moe_cfg,
    nodes,
    gpus,
    full.optim,
    rows // (nodes * gpus),
    full.seq_len,
    exchange,
    full.get("loss_chunk", objective.LOSS_CHUNK),
    per,
  )
  dense, moe = memory_lib.layer_counts(model_cfg)
  return {
    "model": model_cfg.family,
    "mesh": [nodes, gpus],
    "pipeline": {
      "schedule": schedule,
      "stages": stages,
      "virtual_stages": virtual_stages,
      "stage_devices": stage_devices,
      "devices": stage_devices * nodes * gpus,
    },
    "layers": {"dense": dense, "moe": moe, "mtp": model_cfg.num_mtp_layers},
    **setting(full, model_cfg, moe_cfg, configured),
    "method": "analytic only",
    "compiled": None,
    "analytic": analytic,
    "exchange": exchange,
    "device_gb": device_gb,
    "analytic_verdict": "fits" if analytic["total"] <= device_gb * GB else "does not fit",
  }


def pipeline_count(
  cfg, moe_cfg, nodes: int, gpus: int, optim, rows: int, seq_len: int, exchange: dict | None, loss_chunk: int, per: dict
) -> dict:
  """The analytic count of one device of a pipeline stage (`nodes` x `gpus` devices a stage, `rows` sequences of
  `seq_len` tokens a device per micro-batch), by `per` (`moejax.pipeline.memory.per_device` of the schedule): its
  layers' parameters, gradients and optimizer state parameter_stages x layers_fraction x all layers' (DualPipe's
  two stages), their activations activation_stages x layers_fraction x one micro-batch's of all layers (the
  busiest device's micro-batches in flight), and beside them once: with remat the recomputed block, FSDP's gathered
  weights, the exchange buffers. The first stage adds the embeddings' state, the last the head's (final norm,
  output kernel, the embeddings again where tied, the MTP modules) and one micro-batch's MTP blocks and loss (the
  last stage's backward follows its forward). -> the busier stage's counts, with 'stage' ('first' or 'last') and
  both totals."""
  share = lambda value: per["parameter_stages"] * per["layers_fraction"] * value
  layers = memory_lib.analytic_state(cfg, moe_cfg, nodes, gpus, optim, parts=("layers",))
  acts = memory_lib.analytic_activations(cfg, moe_cfg, rows, seq_len, exchange, loss_chunk)
  exchanged = exchange["bytes"] if exchange else 0.0
  layer_acts = per["activation_stages"] * per["layers_fraction"] * acts["layers"]
  tied = getattr(cfg, "tie_embeddings", True)
  ends = {
    "first": (("embeddings",), 0.0),
    "last": (("head", "embeddings") if tied else ("head",), acts["mtp_blocks"] + acts["head"]),
  }
  counts = {}
  for stage, (parts, own_acts) in ends.items():
    own = memory_lib.analytic_state(cfg, moe_cfg, nodes, gpus, optim, parts=parts)
    count = {
      k: share(layers[k]) + own[k] for k in ("parameters", "gradients", "optimizer", "master_weights", "moments")
    }
    count.update(
      activations=layer_acts + acts["recomputed_block"] + acts["gathered_weights"] + own_acts,
      exchange_buffers=exchanged,
    )
    count["total"] = sum(count[k] for k in ("parameters", "optimizer", "gradients", "activations", "exchange_buffers"))
    counts[stage] = count
  stage = max(counts, key=lambda s: counts[s]["total"])
  return {
    **counts[stage],
    "stage": stage,
    "stage_totals": {s: c["total"] for s, c in counts.items()},
    "attention": acts["attention"],
    "loss_chunk": acts["loss_chunk"],
    **per,
  }
