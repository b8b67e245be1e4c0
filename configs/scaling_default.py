"""The default scaling sweep: the routing schemes on 1, 2 and 4 nodes x 4 GPUs of a P4d-like cluster.

Each point runs the layer on simulated CPU devices (4 batches of 128 tokens per device, a tiny layer
d 32, f 64: the traffic depends on the routing only), then prices a small BERT-like model
(d 512, f 2048, 8 layers of which 4 MoE, micro batch 32 x 128 tokens) on the p4d_efa topology.
Runs in about half a minute on 2 CPU cores.

Tokens choose two experts (Switch one). Node-limited and SMILE's bi-level routing put both on one node, so with
deduplicated dispatch (moe.dedup, default on) a token crosses the network once, carrying both choices, and without
('smile_nodedup', 'node_limited_nodedup': a row per token-choice) twice. Rows travel in bfloat16 both ways
(moe.dispatch_dtype, combine_dtype; 'float8_e4m3fn' dispatch prices DeepSeek-V3's FP8 rows).

  python -m experiments.scaling --workdir=/tmp/scaling
  python -m experiments.scaling --workdir=/tmp/scaling --config.topology=dgx_h100_ib --config.gpus_per_node="(2, 4)"
  python -m experiments.scaling --workdir=/tmp/scaling --config.gpus_per_node="(8,)" --config.global_batch=1024

The meshes are every nodes x gpus_per_node pair (a sweep has no mesh section; each scheme derives its moe.num_nodes
and moe.num_experts from the mesh). Strong scaling splits global_batch over every mesh: it must be a multiple of
devices x micro_batch on each, so the default 512 fits meshes of up to 16 devices at micro batch 32; 4 x 8 needs
1024 (the error names the value that fits every mesh and model of the sweep).
"""

import ml_collections

from configs.moe_section import moe_section
from moejax.study.points import SCHEME_FIELDS


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.topology = "p4d_efa"  # a preset of moejax.cost.topology
  config.topology_overrides = ""  # e.g. "nic_bw=25e9,inter_latency=2e-5" (fields of moejax.cost.topology)
  config.device_rate_json = ""  # benchmark JSON with a measured FLOP/s; "" = datasheet peak x efficiency
  config.gemm_sms = 108  # A100 SXM4 datasheet: 108 SMs; the wave model of the GEMM pieces of 'chunked' and 'comet'
  config.nodes = (1, 2, 4)
  config.gpus_per_node = (4,)
  # more: configs/scaling_schedules.py
  config.schemes = (
    "switch",
    "flat_dropless",
    "hierarchical",
    "smile",
    "smile_nodedup",
    "node_limited",
    "node_limited_nodedup",
  )
  config.scalings = ("weak", "strong")
  config.global_batch = 512  # samples per step under strong scaling (a multiple of devices x micro_batch on each mesh)
  config.models = ml_collections.ConfigDict(
    {
      "small": {
        "d_model": 512,
        "d_ff": 2048,
        "layers": 8,
        "moe_layers": 4,
        "seq_len": 128,
        "micro_batch": 32,
        "vocab": 32128,
      },
    }
  )
  # Every MoEConfig field but those each scheme sets (moejax.study.points.SCHEME_FIELDS), at its default unless set
  # here, passed to every scheme that does not fix it; then the sweep's own fields (points.SWEEP_FIELDS).
  config.moe = moe_section(
    omit=SCHEME_FIELDS,
    top_k=2,  # experts per token (every scheme but switch, which is top-1; local experts for smile)
    node_top_k=1,  # nodes per token for node_limited (smile: always 1)
    num_chunks=4,  # chunks of 'chunked', column blocks of d of 'comet'
    dtype="bfloat16",  # the activations' bytes per element and the compute dtype of measured points
    dispatch_dtype="bfloat16",  # the rows to the experts on the wire (None: dtype; 'float8_e4m3fn': FP8)
    combine_dtype="bfloat16",
  )  # the results back and the backward's gradients (None: float32)
  config.moe.update(
    {
      "experts_per_gpu": 1,
      "switch_capacity_factor": 2.0,
      "smile_capacity_factor": 2.0,  # SMILE Sec. 4.1
      "esp_capacity_factor": 1.2,  # 'esp_baseline', 's1', 's2' (Parm Table III: f in {1.2, 2.4})
    }
  )
  # The small run on simulated devices: `batches` calls of `tokens_per_gpu` tokens per device;
  # balanced_router: routers built to route uniformly (moejax.study.inputs.balanced_routers), else the
  # layer's own random initialisation.
  config.sim = ml_collections.ConfigDict(
    {"tokens_per_gpu": 128, "batches": 4, "d_model": 32, "d_ff": 64, "seed": 0, "balanced_router": True}
  )
  # Points whose mesh the job's devices of `platform` can form are also timed (rows 'measured'): one MoE layer
  # forward and a whole training step at the model's shapes. 'gpu': one host's GPUs, or whole hosts of a job of
  # several processes (moejax.study.hosts); 'cpu': the CPU devices (simulated nodes in one process), which
  # exercises the measured path but says nothing about GPUs. models: the models to time (() = all). Each program is
  # timed at least `repeats` times, then until its median's 95% interval (none before the sixth call) is within
  # `spread` of it, at most `max_repeats` (a step) or `layer_max_repeats` (a layer forward) (moejax.study.repeats).
  # price_program: each measured mesh's collectives and compute ops are first timed as microbenchmarks
  # (moejax.study.program_calibration) and the timed layer and step programs priced with them
  # (moejax.cost.program_price): columns priced_layer_ms, priced_step_s and their errors, held out.
  config.measure = ml_collections.ConfigDict(
    {
      "platform": "gpu",
      "warmup": 3,
      "repeats": 5,
      "max_repeats": 30,
      "layer_max_repeats": 30,
      "spread": 0.05,
      "models": (),
      "price_program": True,
    }
  )
  # Calibration (moejax.cost.fitted): source '' prices on the topology as given; 'measure' first times this job's
  # all-to-alls (`rows` rows per peer) and one layer on measure.platform's devices and prices every point with the
  # fitted terms, the timed expert rate and non-expert cost (<workdir>/calibration.json); or the path of such a
  # record, or of experiments/bench_collectives' collectives.json. Then a modelled point beyond the timed node
  # counts and GPUs per node is labelled 'extrapolated'.
  config.calibration = ml_collections.ConfigDict({"source": "", "rows": (4, 32, 256)})
  return config
