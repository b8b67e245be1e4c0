"""Collectives after another in one program, interleaved with other programs and back to back
(experiments/collective_chains.py).

python -m experiments.collective_chains --workdir=/tmp/chains
python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- python -m experiments.collective_chains \
    --workdir=/tmp/chains_2p     # the mesh over two processes (gloo): 'node' between them
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.nodes = 2  # mesh: nodes x gpus_per_node simulated CPU devices (in a job: its processes' devices)
  config.gpus_per_node = 4
  config.links = 5  # collectives in the long program (the short one has 1)
  config.repeats = 9  # timed calls per program and way (median)
  return config
