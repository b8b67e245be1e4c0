"""Memory planner: per-device bytes of a training config's parameters, optimizer states, gradients, activations and
exchange buffers, from the compiled train step's memory analysis on simulated CPU devices of the config's mesh
(nothing allocated: the step is lowered from abstract arrays), beside an analytic count, with a verdict against the
device's memory.

  python -m experiments.memory --config=configs/memory.py:decoder:deepseek_v3,published --config.model.fsdp=True
  python -m experiments.memory --workdir=benchmarks/results/2026-11-25-cpu            # every preset: memory.json
  python -m experiments.memory --config=configs/memory.py:decoder:qwen3_moe --config.planner.whole=True \\
      --config.planner.device_gb=0.01

configs/memory.py names what is planned (PRESETS' rows, or one training config) and the planner's options; with
--workdir the rows go to memory.json there. A scanned model (model.scan_layers, the default) is compiled whole; an
unrolled one as a few blocks ((dense, MoE) = (1,1), (2,1), (1,2)) scaled by the block counts
(`moejax.study.memory.scale`), unless config.planner.whole. XLA:CPU has no ragged all-to-all, so a 'ragged' collective compiles as 'padded' (the same buffer bounds).
docs/memory.md explains every column.
"""

import os
import sys
import tempfile
import time

from moejax import cli
from moejax.study import memory as memory_lib
from moejax.study.memory import GB

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "memory.py")

# A micro-batch of one 4096-token sequence per device: the published configs' 2 sequences per device in 2 micro-batches.
_ONE_SEQUENCE = dict(micro_batches=2)
PRESETS = {  # name: (config spec of configs/decoder.py, top-level, model, moe and mesh overrides, explain)
  "deepseek_v3_fsdp_remat": (
    "deepseek_v3,published",
    _ONE_SEQUENCE,
    dict(fsdp=True, remat="full"),
    dict(path="gpu_first"),
    {},
    True,
  ),
  "deepseek_v3_fsdp_remat_seq2048": (
    "deepseek_v3,published",
    dict(micro_batches=2, seq_len=2048),
    dict(fsdp=True, remat="full"),
    dict(path="gpu_first"),
    {},
    False,
  ),
  "deepseek_v3_remat": (
    "deepseek_v3,published",
    _ONE_SEQUENCE,
    dict(fsdp=False, remat="full"),
    dict(path="gpu_first"),
    {},
    False,
  ),
  "qwen3_moe": ("qwen3_moe,published", _ONE_SEQUENCE, {}, {}, {}, False),
  "qwen3_moe_fsdp_remat": ("qwen3_moe,published", _ONE_SEQUENCE, dict(fsdp=True, remat="full"), {}, {}, False),
  "mixtral": ("mixtral,published", _ONE_SEQUENCE, {}, {}, {}, False),
  "mixtral_fsdp_remat": ("mixtral,published", _ONE_SEQUENCE, dict(fsdp=True, remat="full"), {}, {}, False),
  "mixtral_2x8_edp": (
    "mixtral,published",
    dict(batch_size=32, micro_batches=2),
    {},
    dict(expert_data_parallel=True, num_nodes=2),
    dict(nodes=2),
    False,
  ),
}
# Pipelined rows (analytic only: `plan_pipelined`): name -> (a PRESETS row, mesh.nodes of a stage's nodes x 8 GPUs,
# schedule, stages, virtual_stages, micro-batches of one 4096-token sequence a device). DeepSeek-V3 as trained: 16
# stages of 8 x 8 GPUs (EP 64; its 2048 GPUs are two such replicas, data parallel), DualPipe; on 32 x 8, 16 stages
# of 2 x 8 GPUs (DualPipeV's 8 devices of 4 x 8), 32 micro-batches (DualPipe's least at 16 stages: m >= 2p).
PIPELINED = {
  "deepseek_v3_pp16_ep64_dualpipe": ("deepseek_v3_fsdp_remat", 8, "dualpipe", 16, 1, 32),
  **{
    f"deepseek_v3_32x8_{s}": (
      "deepseek_v3_fsdp_remat",
      4 if s == "dualpipev" else 2,
      s,
      16,
      2 if s == "interleaved" else 1,
      32,
    )
    for s in ("gpipe", "1f1b", "interleaved", "dualpipe", "dualpipev")
  },
}
# XLA:CPU's default schedule maximises concurrency and ignores memory; its memory-minimising one is the honest
# stand-in for a GPU compiler that schedules under a memory limit. Optimisation level 0 only speeds compiling.
SCHEDULE = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED", "xla_backend_optimization_level": 0}


def preset_config(name: str):
  from configs import decoder

  spec, top, model, moe, mesh, _ = PRESETS[name]
  config = decoder.get_config(spec)
  config.update(top)
  config.model.update(model)
  config.moe.update(moe)
  config.mesh.update(mesh)
  config.data.shards = config.mesh.nodes * config.mesh.gpus_per_node
  return config


def _tokens(vocab: int):
  """Special ids for a vocabulary of `vocab` (the step only reads the padding and mask ids)."""
  from moejax.train import objective

  return objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=vocab - 2, num_ids=vocab)


def _compile(config, mesh, dump_dir=None):
  """The train step of `config` compiled for `mesh` from abstract arguments -> (memory numbers, seconds, schedule)."""
  import jax

  from moejax.models import state as state_lib
  from moejax.train import config as config_lib
  from moejax.train import trainer as train

  config, model_cfg, moe_cfg = config_lib.checked(config)
  trainer = train.Trainer(config, model_cfg, moe_cfg, mesh, _tokens(model_cfg.vocab_size), donate=True)
  _, _, rest = state_lib.abstract_state(model_cfg, moe_cfg, mesh, config.seed)
  rows = config.batch_size // config.micro_batches
  batch = jax.ShapeDtypeStruct(
    (config.micro_batches, rows, config.seq_len), jax.numpy.int32, sharding=trainer.batch_sharding
  )
  start = time.perf_counter()
  lowered = trainer.step.lower(trainer.abstract_state, rest, batch)
  options = dict(SCHEDULE, **({"xla_dump_to": dump_dir, "xla_dump_hlo_module_re": ".*_step.*"} if dump_dir else {}))
  try:
    compiled, schedule = lowered.compile(compiler_options=options), "memory-optimised"
  except Exception:  # noqa: BLE001  an XLA without the scheduler option: its default schedule
    compiled, schedule = lowered.compile(), "default"
  m = compiled.memory_analysis()
  sizes = {k: float(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
  return sizes, time.perf_counter() - start, schedule


def _checked_on(config, mesh):
  """(the config as compiled on `mesh`'s CPU devices, the configured collective, `config_lib.checked` of it): a
  collective XLA:CPU lacks ('ragged') compiled as 'padded', which has the same buffer bounds."""
  from moejax.moe import collective as collective_lib
  from moejax.moe.config import TRANSPORT_ALIASES
  from moejax.runtime import platform as platform_lib
  from moejax.train import config as config_lib

  config = config.copy_and_resolve_references()
  transport = config.moe.get("transport")  # the old name of path and collective, read first where set
  path, configured = TRANSPORT_ALIASES[transport] if transport else (config.moe.path, config.moe.collective)
  if not collective_lib.runs_on(configured, platform_lib.of_mesh(mesh)):
    config.moe.update(path=path, collective="padded", **({"transport": None} if transport else {}))
  return config, configured, config_lib.checked(config)


def plan(config, device_gb: float = 80.0, whole: bool = False, explain: bool = False) -> dict:
  """One row of the planner (devices already simulated): the config's per-device bytes by category, compiled and
  analytic, and the verdicts against `device_gb`."""
  import jax
  import numpy as np

  from moejax.models.decoder_config import DecoderConfig
  from moejax.runtime import mesh as mesh_lib
  from moejax.train import objective
  from moejax.train import trainer as train

  nodes, gpus = config.mesh.nodes, config.mesh.gpus_per_node
  mesh = mesh_lib.make_mesh(nodes, gpus)
  config, configured, (full, model_cfg, moe_cfg) = _checked_on(config, mesh)
  trainer = train.Trainer(full, model_cfg, moe_cfg, mesh, _tokens(model_cfg.vocab_size))
  state = {
    k: sum(memory_lib.shard_bytes(x) for x in jax.tree.leaves(trainer.abstract_state[k]))
    for k in trainer.abstract_state
  }
  params, optimizer = state.pop("params"), state.pop("opt_state")
  # The step accumulates gradients in float32 zeros sharded like the parameters (precision.zeros_for_accumulation).
  gradients = sum(
    memory_lib.shard_bytes(jax.ShapeDtypeStruct(x.shape, np.float32, sharding=x.sharding))
    for x in jax.tree.leaves(trainer.abstract_state["params"])
  )
  rows = full.batch_size // full.micro_batches
  exchange = memory_lib.exchange_bytes(moe_cfg, mesh, rows * full.seq_len) if model_cfg.num_moe_layers else None
  target = memory_lib.layer_counts(model_cfg)
  # Scanned layers compile in the time of one layer variant whatever the depth, and a variant's segments of one or
  # two repeats do not compile as the loop of many does (docs/memory.md): a scanned model compiles whole.
  whole = whole or model_cfg.scan_layers
  points = [target] if whole else memory_lib.variants(model_cfg)
  decoder = isinstance(model_cfg, DecoderConfig)
  compiled = []
  for i, (dense, moe) in enumerate(points):
    variant = config.copy_and_resolve_references()
    if not whole:
      variant.model.update(memory_lib.variant_model(dict(config.model), decoder, dense, moe))
    with tempfile.TemporaryDirectory() as dump:
      sizes, seconds, schedule = _compile(variant, mesh, dump if explain and i == 0 else None)
      peak = _peak_buffers(dump) if explain and i == 0 else None
    compiled.append(
      dict(
        dense=dense, moe=moe, seconds=seconds, schedule=schedule, **sizes, **({"peak_buffers": peak} if peak else {})
      )
    )
  scaled = {
    k: memory_lib.scale(points, [c[k] for c in compiled], target) for k in ("argument", "temp", "output", "alias")
  }
  temp = scaled["temp"][0]
  exch = exchange["bytes"] if exchange else 0.0
  out = {
    "parameters": params,
    "optimizer": optimizer,
    "gradients": gradients,
    "exchange_buffers": exch,
    "activations": temp - gradients - exch,
    "other_state": sum(state.values()),
    "batch": full.micro_batches * rows * full.seq_len * 4 / (nodes * gpus),
    "unaliased_output": max(0.0, scaled["output"][0] - scaled["alias"][0]),
  }
  out["total"] = params + optimizer + out["other_state"] + out["batch"] + temp + out["unaliased_output"]
  analytic = memory_lib.analytic_state(model_cfg, moe_cfg, nodes, gpus, full.optim)
  analytic.update(
    memory_lib.analytic_activations(
      model_cfg, moe_cfg, rows // (nodes * gpus), full.seq_len, exchange, full.get("loss_chunk", objective.LOSS_CHUNK)
    )
  )
  analytic["exchange_buffers"] = exch
  analytic["total"] = sum(
    analytic[k] for k in ("parameters", "optimizer", "gradients", "activations", "exchange_buffers")
  )
  verdict = lambda total: "fits" if total <= device_gb * GB else "does not fit"
  return {
    "model": getattr(model_cfg, "family", getattr(model_cfg, "kind", "?")),
    "mesh": [nodes, gpus],
    "layers": {"dense": target[0], "moe": target[1], "mtp": getattr(model_cfg, "num_mtp_layers", 0)},
    "fsdp": model_cfg.fsdp,
    "remat": model_cfg.remat,
    "param_dtype": getattr(model_cfg, "param_dtype", "float32"),
    "dtype": model_cfg.dtype,
    "optim": {k: full.optim.get(k) for k in ("name", "master_dtype", "moment_dtype")},
    "micro_batch": {
      "sequences_per_device": rows // (nodes * gpus),
      "seq_len": full.seq_len,
      "micro_batches": full.micro_batches,
    },
    "collective": {"configured": configured, "compiled": moe_cfg.collective},
    "buffer_factor": moe_cfg.buffer_factor,
    "expert_data_parallel": moe_cfg.expert_data_parallel,
    "schedule": compiled[0]["schedule"],
    "method": "whole model compiled" if whole else "layer variants scaled",
    "variants": compiled,
    "scaling": {k: {"value": val, "base_per_dense_per_moe": coef} for k, (val, coef) in scaled.items()},
    "compiled": out,
    "analytic": analytic,
    "exchange": exchange,
    "device_gb": device_gb,
    "verdict": verdict(out["total"]),
    "analytic_verdict": verdict(analytic["total"]),
    "argument_check": {
      "scaled": scaled["argument"][0],
      "exact_state_and_batch": params + optimizer + out["other_state"] + out["batch"],
    },
  }


def plan_pipelined(config, schedule: str, stages: int, virtual_stages: int = 1, device_gb: float = 80.0) -> dict:
  """A row of the planner for `config` (its mesh: one stage's nodes x GPUs; its micro_batches through the stages)
  pipelined by `schedule` (`moejax.pipeline.schedules`): the analytic count of the busier end stage's devices
  (`study.memory.pipeline_count` of `moejax.pipeline.memory.per_device`) and its verdict. Not compiled: the step
  runs two of the five schedules, and a stage's program at DeepSeek-V3's size on CPU devices is out of reach here."""
  from moejax.pipeline import memory as pipeline_memory
  from moejax.pipeline import schedules
  from moejax.runtime import mesh as mesh_lib
  from moejax.train import objective
  from moejax.validation import require

  section = config.get("pipeline")
  require(
    section is None or section.schedule == "none",
    "pipeline.schedule",
    section and section.schedule,
    "'none' in the planned training config: the planner's pipeline is planner.schedule",
  )
  nodes, gpus = config.mesh.nodes, config.mesh.gpus_per_node
  mesh = mesh_lib.make_mesh(nodes, gpus)
  _, configured, (full, model_cfg, moe_cfg) = _checked_on(config, mesh)
  rows = full.batch_size // full.micro_batches
  exchange = memory_lib.exchange_bytes(moe_cfg, mesh, rows * full.seq_len) if model_cfg.num_moe_layers else None
  per = pipeline_memory.per_device(schedule, stages, full.micro_batches, virtual_stages)
  stage_devices = len(schedules.timetable(schedule, stages, full.micro_batches, virtual_stages).slots)
  analytic = memory_lib.pipeline_count(
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
    "fsdp": model_cfg.fsdp,
    "remat": model_cfg.remat,
    "param_dtype": model_cfg.param_dtype,
    "dtype": model_cfg.dtype,
    "optim": {k: full.optim.get(k) for k in ("name", "master_dtype", "moment_dtype")},
    "micro_batch": {
      "sequences_per_device": rows // (nodes * gpus),
      "seq_len": full.seq_len,
      "micro_batches": full.micro_batches,
    },
    "collective": {"configured": configured, "compiled": moe_cfg.collective},
    "method": "analytic only",
    "compiled": None,
    "analytic": analytic,
    "exchange": exchange,
    "device_gb": device_gb,
    "analytic_verdict": "fits" if analytic["total"] <= device_gb * GB else "does not fit",
  }


def pipelined_preset(name: str):
  """(training config, (schedule, stages, virtual_stages)) of a PIPELINED row."""
  base, nodes, schedule, stages, virtual, micro = PIPELINED[name]
  config = preset_config(base)
  gpus = config.mesh.gpus_per_node
  config.update(micro_batches=micro, batch_size=micro * nodes * gpus)
  config.mesh.nodes = config.moe.num_nodes = nodes
  config.data.shards = nodes * gpus
  return config, (schedule, stages, virtual)


def _peak_buffers(dump_dir: str, top: int = 8) -> list | None:
  """The largest buffers live at the peak of the dumped step's schedule, by shape: [(count, shape, GB)]."""
  import glob
  import re

  names = glob.glob(os.path.join(dump_dir, "*_step*buffer-assignment.txt"))
  ranges = glob.glob(os.path.join(dump_dir, "*_step*live-range.txt"))
  if not names or not ranges:
    return None
  sizes = {
    m[0]: (int(m[1]), m[2])
    for m in re.findall(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)", open(names[0]).read())
  }
  live = {
    n: (int(a), int(b))
    for n, a, b in re.findall(
      r"^\s+(\S+?)\{[\d,]*\}:(\d+)-(\d+)$", open(ranges[0]).read().split("BufferLiveRange")[-1], re.M
    )
    if n in sizes and not n.startswith("param")
  }
  if not live:
    return None
  events = sorted(
    [(a, sizes[n][0]) for n, (a, b) in live.items()] + [(b + 1, -sizes[n][0]) for n, (a, b) in live.items()]
  )
  level, best, when = 0, -1, 0
  for t, delta in events:
    level += delta
    if level > best:
      best, when = level, t
  by_shape = {}
  for n, (a, b) in live.items():
    if a <= when <= b:
      count, total = by_shape.get(sizes[n][1], (0, 0))
      by_shape[sizes[n][1]] = (count + 1, total + sizes[n][0])
  rows = sorted(((c, shape, total / GB) for shape, (c, total) in by_shape.items()), key=lambda r: -r[2])
  return [{"count": c, "shape": s, "gb": g} for c, s, g in rows[:top]] + [{"live_at_peak_gb": best / GB}]


CATEGORIES = ("parameters", "optimizer", "gradients", "activations", "exchange_buffers", "total")


def format_row(name: str, row: dict) -> str:
  """A row's category table: compiled (measured or derived) and analytic GB per device, and their ratio."""
  mb = row["micro_batch"]
  t = row["collective"]
  lines = [
    f"{name}: {row['model']} on {row['mesh'][0]} x {row['mesh'][1]}, fsdp={row['fsdp']}, "
    f"remat={row['remat']}, params {row['param_dtype']}, micro-batch {mb['sequences_per_device']} x "
    f"{mb['seq_len']} tokens/device ({mb['micro_batches']} micro-batches), collective {t['compiled']}"
    + (f" (configured {t['configured']})" if t["compiled"] != t["configured"] else "")
    + f", {row['method']}, XLA:CPU {row['schedule']} schedule",
    f"  analytic: attention {row['analytic']['attention']} (planned for a Hopper GPU), loss "
    + (f"in chunks of {row['analytic']['loss_chunk']} columns" if row["analytic"]["loss_chunk"] else "unchunked")
    + f", optimizer {row['optim']}",
    f"  {'GB per device':<28}{'compiled':>10}{'analytic':>10}{'ratio':>8}",
  ]
  labels = {"activations": "activations (derived)", "exchange_buffers": "exchange buffers (analytic)"}
  for k in CATEGORIES:
    c, a = row["compiled"][k], row["analytic"][k]
    ratio = f"{c / a:8.2f}" if a else f"{'-':>8}"
    lines.append(f"  {labels.get(k, k):<28}{c / GB:10.2f}{a / GB:10.2f}{ratio}")
  lines.append(
    f"  verdict against {row['device_gb']:g} GB: {row['verdict']} (compiled), {row['analytic_verdict']} (analytic)"
  )
  for b in (row["variants"][0].get("peak_buffers") or [])[:-1]:
    lines.append(f"    at the peak: {b['count']:3d} x {b['shape']:<28} {b['gb']:8.2f} GB")
  return "\n".join(lines)


def format_pipelined(name: str, row: dict) -> str:
  """A pipelined row's analytic GB per device (the busier end stage's) and what the schedule multiplies."""
  mb, pp, a = row["micro_batch"], row["pipeline"], row["analytic"]
  lines = [
    f"{name}: {row['model']}, {pp['schedule']} over {pp['stages']} stages"
    + (f" ({pp['virtual_stages']} chunks a device)" if pp["virtual_stages"] > 1 else "")
    + f" on {pp['stage_devices']} x {row['mesh'][0]} x {row['mesh'][1]} = {pp['devices']} devices, "
    f"fsdp={row['fsdp']}, remat={row['remat']}, micro-batch {mb['sequences_per_device']} x {mb['seq_len']} "
    f"tokens/device ({mb['micro_batches']} micro-batches), attention {a['attention']}, loss "
    + (f"in chunks of {a['loss_chunk']} columns" if a["loss_chunk"] else "unchunked")
    + f", optimizer {row['optim']}, analytic only",
    f"  a device holds {a['parameter_stages']} x {a['layers_fraction']:.4g} of the layers' state and "
    f"{a['activation_stages']:g} x {a['layers_fraction']:.4g} of one micro-batch's layer activations; the "
    f"{a['stage']} stage is the busier ({', '.join(f'{s} {t / GB:.2f}' for s, t in a['stage_totals'].items())}"
    " GB)",
  ]
  for k in CATEGORIES:
    lines.append(f"  {k:<28}{a[k] / GB:10.2f}")
  lines.append(f"  verdict against {row['device_gb']:g} GB: {row['analytic_verdict']} (analytic)")
  return "\n".join(lines)


def summary(rows: dict) -> str:
  """One line per row: the categories in GB per device (activations compiled / analytic) and both verdicts."""
  head = (
    f"{'row':<32}{'mesh':>6}{'params':>8}{'optim':>8}{'grads':>8}{'act c/a':>15}{'exch':>7}{'total c/a':>17}"
    "  verdict (compiled / analytic)"
  )
  lines = [head]
  g = lambda x: f"{x / GB:.1f}"
  for name, r in rows.items():
    c, a = r["compiled"], r["analytic"]
    if c is None:  # a pipelined row: analytic only (its mesh: one stage's)
      lines.append(
        f"{name:<32}{r['mesh'][0]:>3}x{r['mesh'][1]:<2}{g(a['parameters']):>8}{g(a['optimizer']):>8}"
        f"{g(a['gradients']):>8}{'- / ' + g(a['activations']):>15}{g(a['exchange_buffers']):>7}"
        f"{'- / ' + g(a['total']):>17}  - / {r['analytic_verdict']}"
      )
      continue
    lines.append(
      f"{name:<32}{r['mesh'][0]:>3}x{r['mesh'][1]:<2}{g(c['parameters']):>8}{g(c['optimizer']):>8}"
      f"{g(c['gradients']):>8}{g(c['activations']) + ' / ' + g(a['activations']):>15}"
      f"{g(c['exchange_buffers']):>7}{g(c['total']) + ' / ' + g(a['total']):>17}  {r['verdict']} / "
      f"{r['analytic_verdict']}"
    )
  return "\n".join(lines)


def configs_to_plan(config) -> dict:
  """name -> (training config, None or its pipeline (schedule, stages, virtual_stages)): the rows config.presets picks
  ('all': PRESETS' and PIPELINED's, 'pipelined': PIPELINED's, or names of either), or the one training config as
  'config', pipelined by planner.schedule; errors name the field."""
  from moejax.pipeline import schedules
  from moejax.train import config as config_lib
  from moejax.validation import require

  if "presets" not in config:
    p = config.planner
    require(
      p.schedule == "none" or p.schedule in schedules.SCHEDULES,
      "planner.schedule",
      p.schedule,
      f"'none' or one of {sorted(schedules.SCHEDULES)}",
    )
    pipeline = None if p.schedule == "none" else (p.schedule, p.stages, p.virtual_stages)
    return {"config": (config_lib.training_config(config), pipeline)}
  keyword = {("all",): [*PRESETS, *PIPELINED], ("pipelined",): list(PIPELINED)}
  names = keyword.get(tuple(config.presets), list(config.presets))
  unknown = [n for n in names if n not in PRESETS and n not in PIPELINED]
  require(
    names and not unknown,
    "presets",
    config.presets,
    f"'all', 'pipelined' or some of {sorted(PRESETS)} and {sorted(PIPELINED)}",
  )
  return {n: (preset_config(n), None) if n in PRESETS else pipelined_preset(n) for n in names}


def main(argv):
  del argv
  from moejax.runtime import mesh as mesh_lib
  from moejax.validation import ConfigError

  config, workdir = _CONFIG.value, _WORKDIR.value
  planner = config.planner
  configs = configs_to_plan(config)
  mesh_lib.simulate_cpu_devices(max(c.mesh.nodes * c.mesh.gpus_per_node for c, _ in configs.values()))
  start, rows = time.perf_counter(), {}
  try:
    for name, (train_config, pipeline) in configs.items():
      if pipeline is None:
        explain = planner.explain or (name in PRESETS and PRESETS[name][5])
        rows[name] = plan(train_config, planner.device_gb, planner.whole, explain)
      else:
        rows[name] = plan_pipelined(train_config, *pipeline, planner.device_gb)
      print((format_row if pipeline is None else format_pipelined)(name, rows[name]), flush=True)
  except (ConfigError, mesh_lib.MeshError) as e:
    sys.exit(f"error: {e}")
  print(summary(rows))
  print(f"planned {len(rows)} row(s) in {time.perf_counter() - start:.0f} s")
  if workdir:
    cli.write_json(workdir, "memory.json", {"rows": rows, "run_s": time.perf_counter() - start})


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Planner config file (configs/memory.py).")
  _WORKDIR = cli.define_workdir("Directory for memory.json (optional: without it, the tables only).", required=False)
  cli.run(main)
