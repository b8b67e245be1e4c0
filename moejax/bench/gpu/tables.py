"""The GPU suite's records as markdown tables, and the GPU issue's targets checked against them.

`load(root)` reads every record (`<step>.json`, written by experiments/gpu_suite.py) below root into `Results`;
`markdown(results)` renders the ceilings, the expert FFN per shape and implementation, the layer, attention, the
decoder step, compile times, the gated DeltaNet mixers and the targets. Where two records hold the same case, the one started later counts.
"""

import dataclasses
import glob
import json
import os

STEPS = ("ceilings", "kernels", "layer", "attention", "decoder_step", "compile_time", "mixers")
# The expert FFN's implementations in the table's column order (moejax.bench.kernel_impls.IMPLS' names).
FFN_COLUMNS = (
  "pallas",
  "pallas_saved",
  "pallas_unfused",
  "ragged_dot",
  "dense_capacity",
  "tokamax",
  "fp8",
  "torch_grouped_mm",
  "dense_gemm",
)


class NoRecords(ValueError):
  pass


@dataclasses.dataclass
class Results:
  """Cases by step, each keyed by what it measured; `device` and the GEMM `ceiling` (TFLOP/s) of the records."""

  device: str
  ceiling: float | None
  ffn: dict  # (model, rows, skew, passes, impl) -> kernels result
  layer: dict  # (model, collective, backend) -> layer case
  attention: dict  # (model, impl) -> attention case
  decoder: dict  # (backend, experts) -> decoder case
  compile: dict  # (family, layers, scan) -> compile point
  mixers: dict  # (model, impl, chunk, seq_len) -> mixers case
  sources: list  # the record files read, in the order they count


def _records(root: str) -> list[tuple[str, dict]]:
  found = []
  for path in sorted(glob.glob(os.path.join(root, "**", "*.json"), recursive=True)):
    if os.path.basename(path)[: -len(".json")] not in STEPS:
      continue
    with open(path) as f:
      record = json.load(f)
    if isinstance(record, dict) and record.get("step") in STEPS and not record.get("smoke"):
      found.append((path, record))
  if not found:
    raise NoRecords(f"no GPU suite records (non-smoke {', '.join(s + '.json' for s in STEPS)}) below {root!r}")
  found.sort(key=lambda pr: pr[1].get("started_utc", ""))
  devices = {r["device"] for _, r in found}
  if len(devices) > 1:
    raise NoRecords(f"records of several devices below {root!r}: {sorted(devices)}; tabulate one device at a time")
  return found


def load(root: str) -> Results:
  """Every record below root, later records replacing earlier ones case by case."""
  found = _records(root)
  res = Results(found[0][1]["device"], None, {}, {}, {}, {}, {}, {}, [p for p, _ in found])
  for _, rec in found:
    step = rec["step"]
    if step == "ceilings" and rec.get("gemm_tflops"):
      res.ceiling = rec["gemm_tflops"]
    elif step == "kernels":
      for e in rec.get("results", []):
        if e.get("op") == "ffn" and "median_s" in e:
          res.ffn[(e["model"], e["rows"], e["skew"], e["passes"], e["impl"])] = e
        elif e.get("op") == "ffn" and "error" in e:
          res.ffn.setdefault((e["model"], e["rows"], e["skew"], e["passes"], e["impl"]), e)
    elif step == "layer":
      for c in rec.get("cases", []):
        res.layer[(c["model"], c["collective"], c["expert_backend"])] = c
    elif step == "attention":
      for c in rec.get("cases", []):
        res.attention[(c["model"], c["impl"])] = c
    elif step == "decoder_step":
      for c in rec.get("cases", []):
        if "median_s" in c:
          res.decoder[(c["expert_backend"], c["experts"])] = c
    elif step == "compile_time":
      for p in rec.get("points", []):
        res.compile[(p["family"], p["layers"], p["scan_layers"])] = p
    elif step == "mixers":
      res.mixers.update({(c["model"], c["impl"], c["chunk"], c["seq_len"]): c for c in rec.get("cases", [])})
  return res


def _table(header: list[str], rows: list[list]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3g}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def _mfu(tflops: float | None, ceiling: float | None) -> str:
  return f"{tflops / ceiling:.2f}" if tflops and ceiling else "-"


def ffn_table(res: Results) -> list[str]:
  """Median ms (useful TFLOP/s) per shape, pass and implementation; `error` where a case raised."""
  cases = sorted({k[:4] for k in res.ffn})
  impls = [i for i in FFN_COLUMNS if any(k[4] == i for k in res.ffn)]
  rows = []
  for case in cases:
    cells = []
    for impl in impls:
      e = res.ffn.get((*case, impl))
      cells.append(
        "" if e is None else ("error" if "median_s" not in e else f"{_ms(e['median_s'])} ({e['tflops']:.0f})")
      )
    rows.append([case[0], case[2], case[3], *cells])
  return _table(["model", "groups", "pass", *impls], rows)


def layer_table(res: Results) -> list[str]:
  rows = []
  for (model, collective, backend), c in sorted(res.layer.items()):
    phases = c.get("phases_ms") or {}
    share = 1 - phases["layer_expert_ms"] / phases["layer_ms"] if phases.get("layer_ms") else None
    rows.append(
      [
        model,
        collective,
        backend,
        _ms(c["fwd"]["median_s"]),
        _ms(c["fwd_bwd"]["median_s"]),
        _mfu(c.get("tflops_fwd"), res.ceiling),
        _mfu(c.get("tflops_fwd_bwd"), res.ceiling),
        f"{phases['layer_expert_ms']:.3g}" if phases else "-",
        f"{share:.0%}" if share is not None else "-",
      ]
    )
  header = ["model", "collective", "experts", "fwd ms", "fwd+bwd ms", "MFU fwd", "MFU fwd+bwd", "expert ms (fwd)"]
  return _table([*header, "non-expert share (fwd)"], rows)


def attention_table(res: Results) -> list[str]:
  rows = []
  for (model, impl), c in sorted(res.attention.items()):
    base = res.attention.get((model, "materialized"))
    speedup = [
      f"{base[p]['median_s'] / c[p]['median_s']:.1f}x" if base and p in c and p in base else "-"
      for p in ("fwd", "fwd_bwd")
    ]
    if "fwd" not in c:
      rows.append([model, impl, c.get("skipped") or c.get("error", "")[:60], "", "", "", ""])
      continue
    mfu = _mfu(c.get("tflops_fwd_bwd"), res.ceiling)
    temp = f"{c.get('temp_bytes_fwd_bwd', 0) / 2**30:.2f}"
    rows.append([model, impl, _ms(c["fwd"]["median_s"]), _ms(c["fwd_bwd"]["median_s"]), *speedup, mfu, temp])
  header = ["model", "impl", "fwd ms", "fwd+bwd ms", "vs materialized fwd", "fwd+bwd", "MFU fwd+bwd"]
  return _table([*header, "temp GiB fwd+bwd"], rows)


def decoder_table(res: Results) -> list[str]:
  rows = [
    [
      backend,
      experts,
      c["layers"],
      _ms(c["median_s"]),
      f"{c['tokens_per_s']:.0f}",
      f"{c['tflops']:.0f}",
      _mfu(c["tflops"], res.ceiling),
      f"{c['peak_bytes_in_use'] / 2**30:.0f}",
    ]
    for (backend, experts), c in sorted(res.decoder.items())
  ]
  header = ["experts backend", "experts", "layers", "step ms", "tokens/s", "TFLOP/s", "MFU", "peak GiB"]
  return _table(header, rows)


def compile_table(res: Results) -> list[str]:
  rows = [
    [family, layers, "scanned" if scan else "unrolled", f"{p['total_s']:.1f}", f"{p['compile_s']:.1f}"]
    for (family, layers, scan), p in sorted(res.compile.items())
  ]
  return _table(["family", "layers", "layers are", "trace+lower+compile s", "compile s"], rows)


def mixers_table(res: Results) -> list[str]:
  """Per implementation, chunk, sequence length and pass: median ms, TFLOP/s of the chunked form, and the largest
  relative difference from the recurrent rule on the checked prefix (fwd+bwd: the largest over the gradients)."""
  rows = []
  for (model, impl, chunk, seq_len), c in sorted(res.mixers.items()):
    if "fwd" not in c:
      why = (c.get("skipped") or c.get("error", "-").strip().splitlines()[-1])[:80]
      rows.append([model, impl, chunk, seq_len, "", why, "", ""])
      continue
    diffs = c.get("max_rel_diff") or {}
    for passes in ("fwd", "fwd_bwd"):
      diff = diffs.get("out") if passes == "fwd" else max((v for k, v in diffs.items() if k != "out"), default=None)
      cells = [_ms(c[passes]["median_s"]), f"{c[f'tflops_{passes}']:.3g}", "-" if diff is None else f"{diff:.1e}"]
      rows.append([model, impl, chunk, seq_len, passes.replace("_", "+"), *cells])
  return _table(["model", "impl", "chunk", "tokens", "pass", "ms", "TFLOP/s", "max rel diff"], rows)


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a and b else None


def targets(res: Results) -> list[tuple[str, str, float | None, bool | None]]:
  """(target, measured as, value, met) for the GPU issue's targets this directory can answer; value None: not
  measured (or its case failed)."""

  def ffn_s(model, impl, passes="fwd_bwd"):
    e = res.ffn.get((model, 16384, "balanced", passes, impl))
    return e.get("median_s") if e else None

  out = []
  for model in sorted({k[0] for k in res.ffn}):
    for rival in ("dense_capacity", "tokamax", "torch_grouped_mm"):
      r = _ratio(ffn_s(model, rival), ffn_s(model, "pallas"))
      out.append(
        (f"{model} FFN fwd+bwd: pallas at least as fast as {rival}", f"{rival} ms / pallas ms", r, _at_least(r, 1))
      )
    r = _ratio(ffn_s(model, "pallas"), ffn_s(model, "fp8"))
    out.append((f"{model} FFN fwd+bwd: FP8 at least 1.5x bf16 (pallas)", "pallas ms / fp8 ms", r, _at_least(r, 1.5)))
  for passes in ("fwd", "fwd_bwd"):
    e = res.ffn.get(("mixtral_8x7b", 16384, "balanced", passes, "pallas"))
    r = _ratio(e and e.get("tflops"), res.ceiling)
    out.append(
      (
        f"mixtral_8x7b FFN {passes}: pallas at least 80% of the dense GEMM",
        "TFLOP/s / GEMM ceiling",
        r,
        _at_least(r, 0.8),
      )
    )
  for (model, collective, backend), c in sorted(res.layer.items()):
    phases = c.get("phases_ms") or {}
    share = 1 - phases["layer_expert_ms"] / phases["layer_ms"] if phases.get("layer_ms") else None
    name = f"{model} layer ({collective}, {backend})"
    out.append(
      (
        f"{name}: non-expert share of the forward at most 25%",
        "1 - expert ms / layer ms",
        share,
        None if share is None else share <= 0.25,
      )
    )
    r = _ratio(c.get("tflops_fwd_bwd"), res.ceiling)
    out.append((f"{name}: MFU fwd+bwd at least 0.55", "TFLOP/s / GEMM ceiling", r, _at_least(r, 0.55)))
  for model in sorted({k[0] for k in res.attention}):
    base = res.attention.get((model, "materialized"))
    for impl in ("cudnn", "tokamax"):  # the fused kernels (xla is jax's own einsum path)
      c = res.attention.get((model, impl))
      if base and c and "fwd_bwd" in c:
        r = base["fwd_bwd"]["median_s"] / c["fwd_bwd"]["median_s"]
        out.append(
          (f"{model} attention fwd+bwd: {impl} at least 2x the materialised", "materialized ms / ms", r, r >= 2)
        )
  return out


def _at_least(value: float | None, bound: float) -> bool | None:
  return None if value is None else value >= bound


def targets_table(res: Results) -> list[str]:
  rows = [
    [name, how, "not measured" if v is None else f"{v:.2f}", {True: "met", False: "not met", None: "-"}[met]]
    for name, how, v, met in targets(res)
  ]
  return _table(["target", "measured as", "value", ""], rows)


def markdown(res: Results) -> str:
  parts = [f"Device: {res.device}; bf16 GEMM ceiling {res.ceiling or '-'} TFLOP/s; records: {len(res.sources)}"]
  for title, table, present in (
    ("Expert FFN, 16384 routed rows: median ms (useful TFLOP/s)", ffn_table, res.ffn),
    ("MoE layer on a 1x1 mesh", layer_table, res.layer),
    ("Attention, one sequence of 4096 tokens", attention_table, res.attention),
    ("Decoder training step (Qwen3-MoE widths)", decoder_table, res.decoder),
    ("Train step compile time", compile_table, res.compile),
    ("Gated DeltaNet (Qwen3-Next), one sequence, bf16", mixers_table, res.mixers),
    ("Targets", targets_table, True),
  ):
    if present:
      parts.append(f"\n{title}\n\n" + "\n".join(table(res)))
  return "\n".join(parts)
