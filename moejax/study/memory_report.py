"""The memory planner's printed rows (`experiments/memory.py`): each row's category table in GB per device, a
pipelined row's analytic count, and the one-line summary of every row."""

from moejax.study.memory import GB

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
