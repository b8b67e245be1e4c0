"""The communication remedies on one decoder family: a Hugging Face checkpoint loaded with `from_hf` on a 2 x 4 mesh
of simulated CPU devices under each scheme (MoEConfig overrides), its logits against the baseline's and the
checkpoint's reference, the rows and bytes each exchange hop moves per token, and the forward's CPU time.

  python -m experiments.family_remedies --workdir=/tmp/family_remedies                    # qwen3_moe fixture (~2 min)
  python -m experiments.family_remedies --config.family=deepseek_v3 --workdir=/tmp/ds3_remedies
  python -m experiments.family_remedies --config.checkpoint=/path/to/hf_dir --config.schemes=flat,node_first

configs/family_remedies.py holds the options. Schemes (its SCHEMES; the first, BASELINE, is the one every other is
compared with) are schemes of the one table (`moejax.study.schemes`) on the checkpoint's own routing: the flat
'padded' exchange with one row per token-choice; dedup (a row per token and destination of each hop); the two-hop
'gpu_first' and 'node_first' paths, without and with dedup; FP8 dispatch (e4m3 with a float32 scale per 128
elements; BF16 back, or the combine's default float32); the 'chunked' and 'comet' schedules; Parm's expert sharding
('s1', 's2'); replicas (one spare slot per device, `slots_per_device`); expert data parallelism; and 'ragged' (refused
where XLA has no ragged all-to-all, e.g. on CPU). A scheme the config or the layer refuses (ConfigError) is recorded
as 'refused' with its reason; any other failure as 'error', and the study goes on. With --workdir the record goes to
<workdir>/family_remedies.json.

Tokens: with the checkpoint's reference.npz (tests/data/hf fixtures), its `tokens` as the first rows, then random
tokens up to config.batch rows (the batch is sharded over the 8 devices); logits of those first rows are compared with
the reference's. Relative error: ||a - b|| / ||b|| over all logits. Traffic: the MoE layers' own accounting, each
layer run on its input (`aux['traffic_rows']`, `aux['traffic_bytes']`: the payload in the wire dtype, FP8's scales,
the slots' ids and weights out, the results back; the loop's logits and rows checked against the model's own
`model(tokens, details=True)`, whose aux carries the rows but not the bytes); per hop,
inter-node and intra-node rows and bytes per token, the mean over the MoE layers, a device's rows to itself left
out. Forward: the jitted model, one compiling call and one untimed call, then the median of config.iters calls, the schemes
interleaved (each round calls every scheme once), as a ratio to the baseline's.
These are CPU times of simulated devices: the exchanges are memory copies, so the ratios say what each scheme costs in
compute and copies, not what it saves on a network.
"""

import json
import os
import pathlib
import time

from configs.family_remedies import BASELINE
from moejax import cli
from moejax.study import family_remedies as remedies
from moejax.study import schemes as schemes_lib
from moejax.study.progress import Progress
from moejax.validation import is_int, require

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "data" / "hf"
_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "family_remedies.py")


def run(
  checkpoint: str,
  schemes: dict,
  batch: int = 16,
  seq_len: int = 16,
  iters: int = 20,
  seed: int = 0,
  nodes: int = 2,
  gpus_per_node: int = 4,
) -> dict:
  """The record: every scheme against the first (the baseline; it must load and run). The devices must exist
  (`simulate_cpu_devices`)."""
  import jax

  from moejax.runtime import mesh as mesh_lib

  with open(os.path.join(checkpoint, "config.json")) as f:
    hf_config = json.load(f)
  mesh = mesh_lib.make_mesh(nodes, gpus_per_node)
  tokens, reference = remedies.make_tokens(
    checkpoint, hf_config["vocab_size"], hf_config["max_position_embeddings"], batch, seq_len, seed
  )
  record = {
    "date": time.strftime("%Y-%m-%d"),
    "jax": jax.__version__,
    "device": jax.devices()[0].device_kind,
    "platform": jax.default_backend(),
    "mesh": [nodes, gpus_per_node],
    "cpu_count": os.cpu_count(),
    "checkpoint": os.path.relpath(checkpoint, ROOT) if str(checkpoint).startswith(str(ROOT)) else checkpoint,
    "family": hf_config.get("model_type"),
    "tokens_shape": list(tokens.shape),
    "reference_rows": None if reference is None else len(reference),
    "iters": iters,
    "seed": seed,
    "baseline": next(iter(schemes)),
    "schemes": [],
  }
  start, progress = time.time(), Progress(len(schemes))
  for name, overrides in schemes.items():
    entry = remedies.measure(name, overrides, checkpoint, hf_config, mesh, tokens)
    print(f"  {name}: {outcome(entry)}", flush=True)
    record["schemes"].append(entry)
    print("  " + progress.step(f"schemes: {name} {entry['status']}"), flush=True)
  base = record["schemes"][0]
  if base["status"] != "ok":
    raise RuntimeError(f"the baseline scheme {base['scheme']} did not run: {base['reason']}")
  print(f"timing the forward of every scheme, {iters} rounds ...", flush=True)
  remedies.time_forwards(record["schemes"], iters)
  remedies.compare_to_baseline(record["schemes"], reference)
  record["seconds"] = time.time() - start
  return record


def outcome(entry: dict) -> str:
  """A scheme's line as measured: its rows per hop, or why it was refused or failed."""
  if entry["status"] == "refused":
    return f"refused: {entry['reason']}"
  if entry["status"] == "error":
    return f"error: {entry['reason']}"
  return ", ".join(
    f"{h['hop']} {h['inter_rows_per_token']:.3f}+{h['intra_rows_per_token']:.3f} rows" for h in entry["hops"]
  )


def table(record: dict) -> str:
  """One line per scheme: errors, rows and kB per token per hop (inter + intra node), the forward's CPU ratio."""
  ref = record["reference_rows"] is not None
  lines = [
    f"{record['family']} ({record['checkpoint']}), {record['mesh'][0]} x {record['mesh'][1]} simulated CPU "
    f"devices, tokens {record['tokens_shape'][0]} x {record['tokens_shape'][1]}; per token and MoE layer; "
    f"hops 'inter+intra' node; forward = CPU median over {record['iters']} calls / baseline's",
    f"{'scheme':23s} {'status':7s} {'rel err':>8s} {'vs ref':>8s} {'experts':>7s}  {'rows/token per hop':30s} "
    f"{'bytes/token per hop':36s} {'inter B':>7s} {'intra B':>7s} {'fwd ms':>7s} {'ratio':>5s}",
  ]
  for e in record["schemes"]:
    if e["status"] != "ok":
      lines.append(f"{e['scheme']:23s} {e['status']:7s} {e['reason'][:150]}")
      continue
    rows = " ".join(f"{h['hop']} {h['inter_rows_per_token']:.2f}+{h['intra_rows_per_token']:.2f}" for h in e["hops"])
    nbytes = " ".join(
      f"{h['hop']} {h['inter_bytes_per_token']:.0f}+{h['intra_bytes_per_token']:.0f}" for h in e["hops"]
    )
    vs_ref = f"{e['rel_err_vs_reference']:8.1e}" if ref else f"{'-':>8s}"
    lines.append(
      f"{e['scheme']:23s} {e['status']:7s} {e['rel_err_vs_baseline']:8.1e} {vs_ref} "
      f"{e['same_experts_as_baseline']:7.1%}  {rows:30s} {nbytes:36s} {e['inter_bytes_per_token']:7.0f} "
      f"{e['intra_bytes_per_token']:7.0f} {e['forward']['median_s'] * 1e3:7.1f} "
      f"{e['forward']['ratio_to_baseline']:5.2f}"
    )
  return "\n".join(lines)


def scheme_overrides(scheme: str, nodes: int, num_chunks: int) -> dict:
  """The MoEConfig overrides of a scheme of the table (`moejax.study.schemes.fields`) on a mesh of `nodes` nodes,
  with `num_chunks` for an overlap schedule."""
  fields = schemes_lib.fields(scheme, nodes)
  if "schedule" in fields:
    fields["num_chunks"] = num_chunks
  return fields


def chosen_schemes(config) -> dict:
  """name -> MoEConfig overrides: config.schemes (BASELINE first whatever the order), then config.extra_schemes;
  errors name the field."""
  chosen = {}
  for name in (BASELINE, *config.schemes):
    try:
      chosen[name] = scheme_overrides(name, config.nodes, config.num_chunks)
    except ValueError as e:
      require(False, "schemes", name, str(e))
  try:
    extra = json.loads(config.extra_schemes or "{}")
  except json.JSONDecodeError as e:
    extra = e
  require(
    isinstance(extra, dict) and all(isinstance(v, dict) for v in extra.values()),
    "extra_schemes",
    config.extra_schemes,
    "'' or a JSON object {NAME: {MoEConfig field: value}}",
  )
  return {**chosen, **extra}


def check(config) -> None:
  """The integer fields; errors name the field."""
  for field in ("batch", "seq_len", "iters", "num_chunks", "nodes", "gpus_per_node"):
    require(is_int(config[field]), field, config[field], "a positive int")
  require(is_int(config.seed, 0), "seed", config.seed, "an int >= 0")
  checkpoint = config.checkpoint or str(FIXTURES / config.family)
  require(
    os.path.isfile(os.path.join(checkpoint, "config.json")),
    "checkpoint" if config.checkpoint else "family",
    config.checkpoint or config.family,
    f"a Hugging Face checkpoint directory, or a fixture of {FIXTURES}",
  )


def main(argv):
  del argv
  from moejax.runtime import mesh as mesh_lib

  config, workdir = _CONFIG.value, _WORKDIR.value
  check(config)
  mesh_lib.simulate_cpu_devices(config.nodes * config.gpus_per_node)

  schemes = chosen_schemes(config)
  record = run(
    config.checkpoint or str(FIXTURES / config.family),
    schemes,
    config.batch,
    config.seq_len,
    config.iters,
    config.seed,
    config.nodes,
    config.gpus_per_node,
  )
  print(table(record), flush=True)
  if workdir:
    cli.write_json(workdir, "family_remedies.json", record)


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Study config file (configs/family_remedies.py).")
  _WORKDIR = cli.define_workdir(
    "Directory for family_remedies.json (optional: without it, the table only).", required=False
  )
  cli.run(main)
