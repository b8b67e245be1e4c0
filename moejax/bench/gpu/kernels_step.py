"""The kernels step: the kernel benchmark's implementations (moejax.bench) at the suite's expert shapes, and
<workdir>/backend_table.json (per FFN shape and pass, the fastest moejax backend)."""

import json
import os

import jax
import jax.numpy as jnp

from moejax.bench import kernel_cases, kernel_parts, kernels
from moejax.bench.gpu.record import Record, say
from moejax.bench.gpu.shapes import KERNEL_MODELS, SMOKE_KERNEL_MODELS
from moejax.cost import expert_backend
from moejax.runtime import platform as platform_lib
from moejax.validation import require


def step_kernels(config, rec: Record) -> bool:
  """moejax.bench.kernels.run, one implementation of one case at a time so that the record grows as it goes."""
  if config.smoke:  # the whole FFN only: the interpreter makes every case cost seconds
    models, rows, ops = SMOKE_KERNEL_MODELS, [64], ["ffn", "parts"]
  else:
    models, rows = {m: KERNEL_MODELS[m] for m in config.kernel_models}, list(config.kernel_rows)
    ops = config.kernel_ops
  impls, skews = config.kernel_impls, config.kernel_skews
  require(set(skews) <= set(kernel_cases.SKEWS), "kernel_skews", skews, f"a subset of {kernel_cases.SKEWS}")
  dtype = jnp.bfloat16
  rec.data.update(
    models=models,
    rows=rows,
    ops=ops,
    skews=skews,
    impls=impls,
    dtype="bfloat16",
    warmup=config.kernel_warmup,
    iters=config.kernel_iters,
    interpret=platform_lib.pallas_interprets(jax.devices()[0].platform),
  )
  results = []
  rec["results"] = results
  for name, model in models.items():
    for r in rows:
      for skew in skews:
        for op in ops:
          if op == "parts":  # each kernel of the fused FFN alone: where its backward loses
            results.extend(kernel_parts.run(name, model, r, skew, dtype, config.kernel_warmup, config.kernel_iters))
            rec.save()
            continue
          for impl in impls:  # both passes of one implementation per call
            results.extend(
              kernels.run({name: model}, [r], [skew], [op], [impl], dtype, config.kernel_warmup, config.kernel_iters)
            )
            rec.save()
  rec["summary"] = kernels.summary(results, impls).splitlines()
  print("\nmedian ms (useful TFLOP/s)\n" + "\n".join(rec["summary"]), flush=True)
  rec["skipped_cases"] = sum("skipped" in e for e in results)
  # A case skipped for a missing optional package or device is fine; any error fails the step.
  failed = [e for e in results if "error" in e]
  rec["failed_cases"] = len(failed)
  table = backend_table(results, rec)
  path = os.path.join(rec.workdir, BACKEND_TABLE)
  with open(path, "w") as f:
    json.dump(table, f, indent=1)
  rec["backend_table"] = path
  for row in table["shapes"]:
    say(
      f"fastest moejax backend {row['model']} R={row['rows']} {row['skew']} {row['passes']}: {row['fastest']} "
      f"({', '.join(f'{k} {v * 1e3:.3f} ms' for k, v in row['candidates_median_s'].items())})"
    )
  return not failed


BACKEND_TABLE = "backend_table.json"


def backend_table(results: list[dict], rec: Record) -> dict:
  """`moejax.cost.expert_backend.table_from_results` of this step's results: what expert_backend='auto' reads."""
  meta = {k: rec[k] for k in ("device", "platform", "dtype", "smoke", "versions")}
  return expert_backend.table_from_results(results, {**meta, "source": os.path.basename(rec.path)})
