"""The kernel benchmark (experiments/bench_kernels.py): the Pallas expert kernels against other ways to compute the
same expert FFN, forward and forward+backward, at published expert shapes (moejax.bench.kernel_cases).

  python -m experiments.bench_kernels --workdir=results/kernels_h100
  python -m experiments.bench_kernels --workdir=/tmp/smoke --config.smoke=True   # CPU, tiny, interpreted
  python -m experiments.bench_kernels --workdir=/tmp/k --config.shape=16,32,2,1,silu --config.rows=256 \\
      --config.ops=ffn --config.backend_table=True   # one layer's per-device shape, for expert_backend='auto'

Writes <workdir>/kernels.json (every result) and, with backend_table, <workdir>/backend_table.json.
"""

import ml_collections

from moejax.bench.kernel_cases import MODELS
from moejax.bench.kernel_impls import IMPLS


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.smoke = False  # tiny shapes and few runs (runs on CPU, interpreted)
  config.models = tuple(MODELS)  # a subset of moejax.bench.kernel_cases.MODELS
  # D,F,EXPERTS,GATED,ACTIVATION: time this FFN shape (model "custom") instead of models, e.g. a layer's per-device
  # shape that expert_backend='auto' asked for; () = models.
  config.shape = ()
  # Also write <workdir>/backend_table.json: the expert-backend table (what expert_backend='auto' reads,
  # `moejax.cost.expert_backend`) of the ffn results.
  config.backend_table = False
  config.rows = (4096, 16384, 65536)  # routed rows R on the GPU
  config.skews = ("balanced", "skewed")  # group-size distributions
  config.ops = ("gmm", "ffn")  # operations: 'gmm', 'ffn', 'parts'
  config.impls = IMPLS  # implementations (moejax.bench.kernel_impls.IMPLS)
  config.dtype = "bfloat16"  # compute dtype: bfloat16 or float32
  config.warmup = 5  # untimed runs after compilation
  config.iters = 50  # timed runs; the median is reported
  return config
