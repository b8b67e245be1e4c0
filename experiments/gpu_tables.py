"""The GPU suite's tables and targets, from the raw JSON records of a results directory (benchmarks/README.md's tables
are this program's output):

  python -m experiments.gpu_tables benchmarks/results/2026-11-28-h200

Reads every <step>.json below the directory (benchmarks/gpu_run.sh writes one folder per entry, a resumed or second
call more folders beside them); where two records measured the same case, the later one counts. MFU is against the
best bf16 GEMM rate of the directory's ceilings record (the same device kind, or none).
"""

import sys

from absl import app

from moejax.bench.gpu import tables


def main(argv):
  if len(argv) != 2:
    sys.exit("usage: python -m experiments.gpu_tables RESULTS_DIR")
  try:
    print(tables.markdown(tables.load(argv[1])))
  except tables.NoRecords as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
