"""Overlap (Comet) and expert-sharding (Parm) schedules in the scaling sweep, beside their baselines.

The default sweep's cluster, meshes and model (configs/scaling_default.py) on a DGX H100-like cluster:
  flat_dropless  the flat dropless layer, exchanges and expert matmuls one after another;
  chunked        the same rows in moe.num_chunks chunks, one chunk's exchanges under another's matmuls;
  comet          Comet's decomposition: layer0 by source peer, layer1 by moe.num_chunks column blocks of d;
  esp_baseline   experts over nodes, each expert's d_ff over the node's GPUs, DeepSpeed-MoE's schedule (Parm);
  s1, s2         Parm's schedules of the same layer;
  switch         the dense capacity dispatch, the reference of the 'vs switch' column.
'chunked' and 'comet' reuse flat_dropless's small run and the Parm schemes need none, so this sweep runs the
layer on simulated devices as often as a two-scheme sweep. See moejax/study/price.py for how each is priced.

  python -m experiments.scaling --config=configs/scaling_schedules.py --workdir=/tmp/scaling_schedules
"""

import ml_collections

from configs import scaling_default


def get_config() -> ml_collections.ConfigDict:
  config = scaling_default.get_config()
  config.topology = "dgx_h100_ib"
  config.gemm_sms = 132  # H100 SXM5 datasheet: 132 SMs
  config.schemes = ("switch", "flat_dropless", "chunked", "comet", "esp_baseline", "s1", "s2")
  config.moe.top_k = 1  # as Switch: the schedules move the same rows, with or without dedup
  return config
