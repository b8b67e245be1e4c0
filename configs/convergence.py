"""The routers' convergence study (experiments/convergence.py): Switch, GShard, SMILE, node-limited and
DeepSeek-V3 routing on one small model, at equal active parameters and steps, over a few seeds.

  python -m experiments.convergence --workdir=/tmp/convergence
  python -m experiments.convergence --workdir=/tmp/convergence --config.seeds=0 --config.steps=100

Every FFN is an MoE layer (model.moe_every=1), so an expert's width is model.d_ff and nothing else
changes with it. Active parameters are equalised per token: with expert width F = d_ff and E = 8
experts for the top-1 routers, a router that sends a token to k experts (plus shared ones) gets experts of
width F / (k + shared) and E x (k + shared) experts, so the active and the routed total FFN widths are
those of Switch (DeepSeek-V3's shared expert adds F / 4 of parameters that every token uses anyway).
"""

import ml_collections

from moejax.study import schemes

ROUTERS = ("switch", "gshard", "smile", "node_limited", "deepseek_v3")


def routers(d_ff: int, experts: int = 8, nodes: int = 2) -> dict[str, dict]:
  """Per router: 'model' (fields of the model section) and 'moe' (fields of the moe section) over the
  base config: the router's fields of the scheme table (moejax.study.schemes), then the study's sizes and balancing;
  d_ff and experts are the top-1 routers' expert width and count."""
  table = {router: schemes.fields(router, nodes) for router in ROUTERS}
  return {
    # Switch Transformer: top-1 softmax with the Switch balance loss (alpha 0.01).
    "switch": {"model": {"d_ff": d_ff}, "moe": {**table["switch"], "num_experts": experts, "load_balance_coef": 0.01}},
    # GShard: top-2 softmax, half-width experts, twice as many.
    "gshard": {
      "model": {"d_ff": d_ff // 2},
      "moe": {**table["gshard"], "num_experts": 2 * experts, "load_balance_coef": 0.01},
    },
    # SMILE: one node by a node softmax, then one of its experts by the local softmax; SMILE's loss.
    "smile": {
      "model": {"d_ff": d_ff},
      "moe": {
        **table["smile"],
        "num_experts": experts,
        "top_k": 1,
        "load_balance_coef": 0.005,
        "local_balance_coef": 0.005,
      },
    },
    # Node-limited (DeepSeek-V3's, with softmax scores): one node, the top-2 of its experts.
    "node_limited": {
      "model": {"d_ff": d_ff // 2},
      "moe": {
        **table["node_limited"],
        "num_experts": 2 * experts,
        "top_k": 2,
        "node_top_k": 1,
        "load_balance_coef": 0.01,
      },
    },
    # DeepSeek-V3: sigmoid affinities normalised over the 3 chosen of 4E quarter-width experts, times
    # V3's 2.5, one quarter-width shared expert, no balance loss but the loss-free bias (u = 1e-3).
    "deepseek_v3": {
      "model": {"d_ff": d_ff // 4},
      "moe": {
        **table["deepseek_v3"],
        "num_experts": 4 * experts,
        "top_k": 3,
        "num_shared_experts": 1,
        "load_balance_coef": 0.0,
        "bias_update_rate": 1e-3,
      },
    },
  }


def get_config(mode: str = "default") -> ml_collections.ConfigDict:
  """mode: 'default' (the study) or 'quick' (a tiny model for a few steps: a smoke test)."""
  config = ml_collections.ConfigDict()
  config.routers = ROUTERS
  config.models = ("gpt", "bert")
  config.seeds = (0, 1, 2)
  config.steps = 200
  config.batch_size = 16
  config.seq_len = 64
  config.num_layers = 2
  config.d_model = 64
  config.num_heads = 4
  config.d_ff = 128  # the top-1 routers' expert width; the others' follow (see routers())
  config.num_experts = 8
  config.learning_rate = 5e-3
  config.warmup_steps = 20
  config.capacity = 1.25  # the capacity factor whose drop share is measured from the dropless runs' loads
  config.heldout_fraction = 0.1  # of the corpus' documents, never trained on
  config.heldout_batches = 8  # of batch_size sequences
  config.tokenizer_train_chars = 2_000_000
  if mode == "quick":
    config.models = ("gpt",)
    config.seeds = (0,)
    config.steps = 8
    config.batch_size = 8
    config.seq_len = 16
    config.d_model = 32
    config.num_heads = 2
    config.d_ff = 64
    config.warmup_steps = 2
    config.heldout_batches = 2
    config.tokenizer_train_chars = 200_000
  elif mode != "default":
    raise ValueError(f"unknown mode {mode!r}; choose default or quick")
  return config
