"""`MoEConfig`, the one description of an MoE layer, and up-front validation of experiment configs.

Every check runs in plain Python before anything is traced or compiled, and a failure names the
field, its value and what is allowed.
"""

import dataclasses
import importlib.util
import logging
from collections.abc import Mapping
from typing import Any

from kernels.activations import ACTIVATIONS
from moejax.moe import routing as routing_lib
from moejax.moe.experts import CLAMPED_SWIGLU, FUSED
from moejax.validation import is_int, is_number, prefixed, reject_unknown, require

ROUTINGS = tuple(routing_lib.ROUTERS)  # topk, bilevel, node_limited
PATHS = ("flat", "gpu_first", "node_first")
COLLECTIVES = ("padded", "ragged", "capacity", "auto")
# The one field `transport` that path and collective were before: each old value as (path, collective).
TRANSPORT_ALIASES = {
  "ragged": ("flat", "ragged"),
  "padded": ("flat", "padded"),
  "capacity": ("flat", "capacity"),
  "hierarchical": ("gpu_first", "auto"),
  "bilevel": ("node_first", "auto"),
}
EXPERT_ACTIVATIONS = (*ACTIVATIONS, CLAMPED_SWIGLU)
EXPERT_BACKENDS = ("ragged_dot", "dense", "pallas", "pallas_saved", "pallas_unfused", "tokamax", "fp8", "auto")
DTYPES = ("float32", "bfloat16")
DISPATCH_DTYPES = (None, "float32", "bfloat16", "float8_e4m3fn")  # None: the activations' own dtype
COMBINE_DTYPES = (None, "float32", "bfloat16")  # None: float32, as the experts accumulate
SCHEDULES = ("sequential", "chunked", "comet")
SCORES = ("softmax", "sigmoid")
BALANCE_LOSSES = ("batch", "sequence", "global_batch")
ESP_SCHEDULES = (None, "baseline", "s1", "s2", "auto")
GROUP_SCORES = ("top2_sum", "max")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """One MoE layer.

  num_experts: E, the global number of experts (a multiple of the mesh's device count).
  top_k: experts per token (for 'bilevel', per chosen node); d_model, d_ff: model and expert hidden widths.
  routing: 'topk' (flat softmax top-k: Switch k=1, GShard k=2); 'bilevel' (SMILE: softmax over nodes, top
    node_top_k; softmax over a node's E / num_nodes experts, shared by all nodes, top top_k; weight p_node *
    q_local); 'node_limited' (DeepSeek-V3: flat router, the node_top_k nodes with the best sums of their two best
    expert probabilities kept, then the top top_k experts on them).
  path: the hops rows take to their experts (`moe.path`): 'flat' (one exchange over both mesh axes), 'gpu_first'
    (over 'gpu', then over 'node': Tutel-2DH's and DeepSpeed's hierarchical all-to-all) or 'node_first' (over
    'node' to the same GPU index of the expert's node, then over 'gpu': SMILE's path, DeepEP's internode one).
  collective: what moves the rows of each hop (`moe.collective`): 'ragged' (jax.lax.ragged_all_to_all; GPU/TPU),
    'padded' (the same semantics from a ring of fixed-size collective permutes; runs anywhere), 'capacity'
    (GShard/Switch's dense dispatch: one all_to_all of a fixed block per peer, sized by capacity; needs
    capacity_factor) or 'auto' ('ragged' where the platform has it, else 'padded'). Any routing, path and collective.
  transport: the old single field, accepted for configs written before path and collective (a one-line notice):
    'ragged', 'padded', 'capacity' = path 'flat' with that collective; 'hierarchical' = 'gpu_first', 'bilevel' =
    'node_first', each with 'auto'. Not stored.
  expert_backend: 'ragged_dot', 'dense' (per-expert loop; reference speed), 'pallas' (kernels' fused FFN),
    'pallas_saved' (the same, its pre-activations kept for the backward), 'pallas_unfused' (a gmm per matmul, hidden
    activations kept), 'tokamax' (`moejax[tokamax]`), 'fp8' (qwix FP8 matmuls, `moejax[fp8]`) or 'auto': the fastest
    measured at the layer's per-device shape in expert_table (None: the table shipped for the device; resolved when
    the config is made, `moejax.cost.expert_backend.resolve`).
  num_nodes, node_top_k: n, the mesh's nodes, and nodes per token (1 = SMILE), for the node routings.
  capacity_factor: None = dropless; else each device sends each expert at most ceil(capacity_factor *
    local_tokens * K / E) token-choices (K = choices_per_token), first choices first, earlier tokens first.
  buffer_factor: None = each hop receives into a worst-case buffer (all rows of all its peers; exact, but
    memory grows with the mesh). b: each hop receives at most ceil(b * local_tokens * K) rows and choices (on
    every hop, so it does not compound); what does not fit drops deterministically (lower sources first, a
    block's later rows), outputs zero and is counted in aux['tokens_overflowed']. Ignored by 'capacity'.
  dedup: True: in each exchange hop a token travels once per destination of the hop, with the ids and weights
    of its experts there; the experts weight their outputs and one sum per token goes back, summed again per hop
    (reduced combine). False: one row per token-choice. None (default): True, but False with esp_schedule='s2'
    (its dispatched tensor holds a row per token-choice; 's2' with True is refused).
  renormalize: combine weights divided by their sum over the token's choices (else raw; Mixtral, Qwen3-MoE and
    DeepSeek-V3 renormalise, Qwen2-MoE and DeepSeek-V2 do not).
  load_balance_coef, local_balance_coef: alpha of the Switch loss alpha * E * sum_e f_e P_e, or alpha and beta of
    SMILE's alpha * n * sum_i f_i P_i + beta * m' * sum_j f_j Q_j; None: the papers' 0.01 (Switch), 0.005.
  z_loss_coef: of the router z-loss mean(logsumexp(logits)^2); jitter: router-input noise x * U(1 - jitter, 1 +
    jitter) in training (0 = off). dtype: the expert matmuls' (accumulation is fp32).
  dispatch_dtype, combine_dtype: the rows' dtype on the wire, to the experts and back (and the backward's
    gradients, both ways, in combine_dtype): None (the activations' dtype; the combine's float32), 'bfloat16', or
    for the dispatch 'float8_e4m3fn' with a float32 scale per 128 elements of a row from its amax (DeepSeek-V3).
  schedule: the order of the exchanges and the expert compute (Comet; `moe.schedule`): 'sequential',
    'chunked' (num_chunks chunks of rows, each dispatched, computed and combined on its own; Tutel/FasterMoE)
    or 'comet' (own rows into the first GEMM while the others arrive, the second GEMM by num_chunks column
    blocks of d, each combined when done). The same result for every routing, path, collective, sharding and table.
  num_chunks: chunks of 'chunked' (dividing the rows a device sends) or column blocks of 'comet' (of d_model).
  esp_schedule: None = experts over both mesh axes (EP only). Else Parm's expert sharding: experts over 'node',
    each one's d_ff over 'gpu', scheduled as 'baseline' (DeepSpeed-MoE), 's1', 's2' (PauseMP) or 'auto' (Parm's
    Algorithm 1; resolved when the config is made by `moejax.cost.parm.resolve_auto`; the layer refuses it).
  esp_cost: where 'auto' takes the collectives' alpha-beta terms: a topology preset of moejax.cost.topology
    (default 'dgx_h100_ib') or the path of an experiments/bench_collectives.py JSON record.
  expert_data_parallel: True: experts over the GPUs of a node only (expert e on GPU e // (E / m) of every node),
    replicated over 'node' with their gradients summed over it, so E need only divide over a node's GPUs; tokens
    go to experts in their own node (one hop over 'gpu'). Refused with esp_schedule, the node routings and the
    two-hop paths (every node holds every expert: no node to choose, no inter-node hop).
  score: the flat router's scores: 'softmax' (Switch, GShard) or 'sigmoid' (DeepSeek-V3: independent per-expert
    affinities). Not with 'bilevel' (SMILE's routers are two softmaxes whose product is the weight).
  routed_scaling: the factor on the routed experts' weights, after renormalize (DeepSeek-V2: 16, V3: 2.5).
  num_groups, topk_groups: group-limited routing (DeepSeek-V3: 8 groups, 4 kept; None = no limit): E experts
    in num_groups contiguous groups, each scored by group_score ('top2_sum': its two best selection scores, V3;
    'max': its best, V2), a token's experts chosen among its topk_groups best ('node_limited' is the case groups
    = nodes, topk_groups = node_top_k).
  bias_update_rate: u of DeepSeek-V3's auxiliary-loss-free balancing (V3: 0.001; 0 = off; flat routings): a
    per-expert bias b (`moe_apply(..., expert_bias=b)`) added to the scores that choose experts, never to the
    weights; the trainer updates it after every step, b += u * sign(mean load - load).
  balance_loss: the balance loss's token group: 'batch' (all tokens of the call, every data-parallel
    device's; Switch), 'sequence' (DeepSeek-V3 Eqs. 17-20: per sequence, averaged; x as [batch, seq, d]; flat
    routings) or 'global_batch' (f over the optimizer step: the call's counts plus `moe_apply(...,
    balance_counts=c)`, the step's earlier micro-batches', which the trainer accumulates; P stays the call's:
    Megatron-Core's global_aux_loss, Qwen's). With 'bilevel', f of both of SMILE's routers.
  num_shared_experts: dense FFNs (width shared_d_ff, default d_ff) on every token, added to the routed output
    (DeepSeek-V2/V3, Qwen2-MoE); shared.w_in [d, S f], shared.w_out [S f, d] (+ shared.w_gate if gated).
    shared_gate: Qwen2-MoE's sigmoid(x w) on the shared output (shared_gate.kernel [d, 1]).
  activation: the experts' ('gelu', 'relu', 'silu'; gated: act(x w_gate) * (x w_in)) or 'swiglu_clamped' (gpt-oss;
    gated only): (clip(x w_in, -limit, limit) + 1) * g * sigmoid(swiglu_alpha * g), g = min(x w_gate, limit), limit
    = swiglu_limit. ffn_bias: each routed expert's matmuls add biases b_in, b_gate [E, f] and b_out [E, d]
    (gpt-oss). router_bias: the flat router's logits add a bias router.bias [E] (gpt-oss). Neither the clamped SwiGLU
    nor the biases run in the fused Pallas FFN ('pallas', 'pallas_saved'), which is refused with them.
  slots_per_device: None = no replication. S: each expert holder (`expert_holders`) has S expert slots: its
    own E / holders experts and, in the spare slots, replicas of others (Lina, DeepSeek EPLB). `MoELayer` keeps the
    slot table as state; the trainer re-plans it every replan_every steps (0 = never) from the mean load of the
    last replan_window (`moejax.replication.rebalance`).
  """

  num_experts: int
  top_k: int
  d_model: int
  d_ff: int
  routing: str = "topk"
  path: str = "flat"
  collective: str = "padded"
  expert_backend: str = "ragged_dot"
  expert_table: str | None = None
  num_nodes: int | None = None
  node_top_k: int = 1
  capacity_factor: float | None = None
  buffer_factor: float | None = None
  dedup: bool | None = None
  activation: str = "gelu"
  gated: bool = False
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0
  ffn_bias: bool = False
  router_bias: bool = False
  renormalize: bool = False
  load_balance_coef: float | None = None
  local_balance_coef: float | None = None
  z_loss_coef: float = 0.0
  jitter: float = 0.0
  dtype: str = "float32"
  dispatch_dtype: str | None = None
  combine_dtype: str | None = None
  schedule: str = "sequential"
  num_chunks: int = 1
  esp_schedule: str | None = None
  esp_cost: str = "dgx_h100_ib"
  expert_data_parallel: bool = False
  score: str = "softmax"
  routed_scaling: float = 1.0
  num_groups: int | None = None
  topk_groups: int = 1
  group_score: str = "top2_sum"
  bias_update_rate: float = 0.0
  balance_loss: str = "batch"
  num_shared_experts: int = 0
  shared_d_ff: int | None = None
  shared_gate: bool = False
  slots_per_device: int | None = None
  replan_every: int = 0
  replan_window: int = 16
  transport: dataclasses.InitVar[str | None] = None

  def __post_init__(self, transport: str | None = None):
    if transport is not None:
      require(
        transport in TRANSPORT_ALIASES,
        "transport",
        transport,
        f"one of {tuple(TRANSPORT_ALIASES)} (the old field; now path {PATHS} and collective {COLLECTIVES})",
      )
      path, collective = TRANSPORT_ALIASES[transport]
      logging.getLogger(__name__).warning(
        "transport=%r is read as path=%r, collective=%r (the old name of the two)", transport, path, collective
      )
      object.__setattr__(self, "path", path)
      object.__setattr__(self, "collective", collective)
    for name in ("num_experts", "top_k", "d_model", "d_ff"):
      value = getattr(self, name)
      require(is_int(value), name, value, "a positive int")
    for name, options in (
      ("routing", ROUTINGS),
      ("path", PATHS),
      ("collective", COLLECTIVES),
      ("expert_backend", EXPERT_BACKENDS),
      ("activation", EXPERT_ACTIVATIONS),
      ("dtype", DTYPES),
      ("schedule", SCHEDULES),
      ("esp_schedule", ESP_SCHEDULES),
      ("score", SCORES),
      ("balance_loss", BALANCE_LOSSES),
      ("dispatch_dtype", DISPATCH_DTYPES),
      ("combine_dtype", COMBINE_DTYPES),
      ("group_score", GROUP_SCORES),
    ):
      require(getattr(self, name) in options, name, getattr(self, name), f"one of {options}")
    if self.router.chooses_nodes:
      n = self.num_nodes
      require(
        is_int(n) and self.num_experts % n == 0,
        "num_nodes",
        n,
        f"a positive int dividing num_experts={self.num_experts} (routing={self.routing!r} chooses nodes)",
      )
      require(
        is_int(self.node_top_k) and self.node_top_k <= n, "node_top_k", self.node_top_k, f"an int in [1, num_nodes={n}]"
      )
    require(
      self.num_groups is None or (is_int(self.num_groups) and self.num_experts % self.num_groups == 0),
      "num_groups",
      self.num_groups,
      f"None or a positive int dividing num_experts={self.num_experts}",
    )
    if self.num_groups is not None:
      require(
        is_int(self.topk_groups) and self.topk_groups <= self.num_groups,
        "topk_groups",
        self.topk_groups,
        f"an int in [1, num_groups={self.num_groups}]",
      )
    limit = self.router.max_top_k
    require(self.top_k <= limit, "top_k", self.top_k, f"at most {limit} for routing={self.routing!r}")
    require(
      self.expert_backend != "tokamax" or importlib.util.find_spec("tokamax") is not None,
      "expert_backend",
      self.expert_backend,
      "tokamax installed (pip install 'moejax[tokamax]'; Python >= 3.12, jax >= 0.11.1)",
    )
    for name in ("gated", "renormalize", "shared_gate", "expert_data_parallel", "ffn_bias", "router_bias"):
      require(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
    self._check_gpt_oss_experts()
    require(self.dedup in (None, True, False), "dedup", self.dedup, "None, True or False")
    edp = "expert_data_parallel"
    require(
      not self.expert_data_parallel or (self.esp_schedule is None and self.routing == "topk" and self.path == "flat"),
      edp,
      True,
      "False with esp_schedule, the node routings or a two-hop path: its experts are "
      "replicated over 'node', which Parm shards them over, and every node holds every expert, so there is no "
      "node to choose and no inter-node hop to take",
    )
    require(
      not (self.dedup and self.esp_schedule == "s2"),
      "dedup",
      self.dedup,
      "False or None with "
      "esp_schedule='s2': its dispatched tensor [E, C', d] holds one row per token-choice, which S2 splits over "
      "the node's GPUs, so a row per token and destination has no place in it",
    )
    require(is_int(self.num_chunks), "num_chunks", self.num_chunks, "a positive int")
    require(
      self.schedule != "comet" or self.d_model % self.num_chunks == 0,
      "num_chunks",
      self.num_chunks,
      f"a divisor of d_model={self.d_model} (schedule='comet' splits the second GEMM by column blocks)",
    )
    require(
      isinstance(self.esp_cost, str) and self.esp_cost,
      "esp_cost",
      self.esp_cost,
      "a topology preset name or the path of a bench_collectives JSON record",
    )
    require(
      self.score == "softmax" or self.routing != "bilevel",
      "score",
      self.score,
      "'softmax' with routing='bilevel' (SMILE's weight is the product of two softmax routers)",
    )
    require(
      is_number(self.routed_scaling) and self.routed_scaling > 0, "routed_scaling", self.routed_scaling, "a number > 0"
    )
    require(
      self.num_groups is None or self.routing == "topk",
      "num_groups",
      self.num_groups,
      "None unless routing='topk' ('node_limited' is group-limited with groups = nodes; 'bilevel' picks one "
      "node's experts)",
    )
    require(
      is_number(self.bias_update_rate) and self.bias_update_rate >= 0,
      "bias_update_rate",
      self.bias_update_rate,
      "a number >= 0",
    )
    require(
      self.bias_update_rate == 0 or self.routing != "bilevel",
      "bias_update_rate",
      self.bias_update_rate,
      "0 with routing='bilevel' (SMILE balances its two routers with its additive loss; the bias acts on "
      "one flat router's scores)",
    )
    require(
      self.balance_loss != "sequence" or self.routing != "bilevel",
      "balance_loss",
      self.balance_loss,
      "'batch' or 'global_batch' with routing='bilevel' (DeepSeek-V3's sequence-wise loss is over one flat "
      "router's choices; SMILE's Eq. 4 balances the node and the local router over the batch)",
    )
    for name, none in (("shared_d_ff", "d_ff"), ("slots_per_device", "no replication")):
      require(
        getattr(self, name) is None or is_int(getattr(self, name)),
        name,
        getattr(self, name),
        f"None ({none}) or a positive int",
      )
    for name, low in (("replan_every", 0), ("replan_window", 1), ("num_shared_experts", 0)):
      require(is_int(getattr(self, name), low), name, getattr(self, name), f"an int >= {low}")
    require(
      not self.shared_gate or self.num_shared_experts > 0,
      "shared_gate",
      self.shared_gate,
      "False without shared experts (num_shared_experts=0)",
    )
    require(
      self.expert_table is None or isinstance(self.expert_table, str),
      "expert_table",
      self.expert_table,
      "None (the table shipped for the device) or the path of a measured expert-backend table",
    )
    require(
      self.replan_every == 0 or self.slots_per_device is not None,
      "replan_every",
      self.replan_every,
      "0 unless slots_per_device is set (re-planning moves replicas between slots)",
    )
    for name, none in (("capacity_factor", "dropless"), ("buffer_factor", "worst-case receive buffers")):
      value = getattr(self, name)
      require(value is None or (is_number(value) and value > 0), name, value, f"None ({none}) or a number > 0")
    cf = self.capacity_factor
    require(
      self.collective != "capacity" or cf is not None,
      "capacity_factor",
      cf,
      "a number > 0 when collective='capacity' (dense dispatch has fixed capacity)",
    )
    require(is_number(self.z_loss_coef) and self.z_loss_coef >= 0, "z_loss_coef", self.z_loss_coef, "a number >= 0")
    for name in ("load_balance_coef", "local_balance_coef"):
      require(
        getattr(self, name) is None or is_number(getattr(self, name)) and getattr(self, name) >= 0,
        name,
        getattr(self, name),
        "a number >= 0, or None for the paper's value",
      )
    require(isinstance(self.jitter, (int, float)) and 0 <= self.jitter < 1, "jitter", self.jitter, "in [0, 1)")

  def _check_gpt_oss_experts(self) -> None:
    """The clamped SwiGLU and the biases (gpt-oss): where they can run."""
    clamped = self.activation == CLAMPED_SWIGLU
    require(
      not clamped or self.gated,
      "gated",
      self.gated,
      f"True with activation={CLAMPED_SWIGLU!r} (a function of the gate and up projections)",
    )
    for name in ("swiglu_alpha", "swiglu_limit"):
      require(is_number(getattr(self, name)) and getattr(self, name) > 0, name, getattr(self, name), "a number > 0")
    require(
      not self.router_bias or self.routing != "bilevel",
      "router_bias",
      self.router_bias,
      "False with routing='bilevel' (a bias on one flat router's logits)",
    )
    why = self.fused_ffn_refusal
    require(
      self.expert_backend not in FUSED or why is None,
      "expert_backend",
      self.expert_backend,
      f"not {FUSED} here: {why}; 'ragged_dot', 'pallas_unfused', 'tokamax' or 'dense' run them",
    )

  @property
  def fused_ffn_refusal(self) -> str | None:
    """Why the fused Pallas FFN (expert_backend in experts.FUSED) cannot run these experts, or None."""
    if self.ffn_bias or self.activation == CLAMPED_SWIGLU:
      return (
        f"its kernels compute act(x w_gate) * (x w_in) w_out with activation in {tuple(ACTIVATIONS)}, not "
        f"ffn_bias={self.ffn_bias} with activation={self.activation!r}"
      )
    return None

  @classmethod
  def from_mapping(cls, fields: Mapping[str, Any], prefix: str = "") -> "MoEConfig":
    """Builds from a dict or ConfigDict (e.g. `config.moe` with prefix 'moe.'), rejecting unknown
    fields by name (with their nearest known fields); errors name the field with `prefix`."""
    fields = dict(fields)
    known = [f.name for f in dataclasses.fields(cls)] + ["transport"]
    reject_unknown(fields, known, prefix)  # one line: the nearest fields
    return prefixed(prefix, cls, **fields)

  @property
  def router(self) -> routing_lib.Router:
    """The routing's router (`moe.routing`): a view of this config, so nothing is stored beside its fields."""
    return routing_lib.of(self)

  @property
  def balance_counts_size(self) -> int:
    """Length of the balance loss's choice counts: each balanced router's width (E; 'bilevel': n, then m')."""
    return sum(self.router.widths.values())

  @property
  def deduplicates(self) -> bool:
    """Whether rows travel once per destination of a hop (`dedup`, None resolved)."""
    return self.esp_schedule != "s2" if self.dedup is None else self.dedup

  @property
  def experts_per_node(self) -> int:
    """m' = E / n, the experts one node holds (node routings only)."""
    return self.num_experts // self.num_nodes

  @property
  def choices_per_token(self) -> int:
    """K, the (token, expert) pairs each token is sent as."""
    return self.router.choices_per_token

  @property
  def shared_width(self) -> int:
    """The shared experts' total hidden width (num_shared_experts x shared_d_ff)."""
    return self.num_shared_experts * (self.d_ff if self.shared_d_ff is None else self.shared_d_ff)

  @property
  def alpha(self) -> float:
    return self.router.default_alpha if self.load_balance_coef is None else self.load_balance_coef

  @property
  def beta(self) -> float:
    return 0.005 if self.local_balance_coef is None else self.local_balance_coef

  def expert_holders(self, nodes: int, gpus_per_node: int) -> int:
    """H: what a slot table has a row for: the devices, the nodes (expert sharding) or a node's GPUs (expert data
    parallelism)."""
    if self.expert_data_parallel:
      return gpus_per_node
    return nodes if self.esp_schedule is not None else nodes * gpus_per_node

  def check_mesh(self, nodes: int, gpus_per_node: int) -> None:
    """Raises ConfigError naming the field unless the layer runs on a nodes x gpus_per_node mesh."""
    self.experts_per_holder(nodes, gpus_per_node)

  def experts_per_holder(self, nodes: int, gpus_per_node: int) -> int:
    """The experts each holder keeps on a nodes x gpus_per_node mesh (a GPU's; with esp_schedule a node's, each
    split over its GPUs), after the checks of `check_mesh`."""
    if self.router.chooses_nodes:
      require(self.num_nodes == nodes, "num_nodes", self.num_nodes, f"the mesh's node count {nodes}")
    holders = self.expert_holders(nodes, gpus_per_node)
    where = (
      f"{nodes} nodes (expert sharding puts E / n whole experts on each node)"
      if self.esp_schedule
      else f"{holders} GPUs per node (expert data parallelism)"
      if self.expert_data_parallel
      else f"{holders} devices (expert e lives on device e // experts_per_gpu)"
    )
    require(self.num_experts % holders == 0, "num_experts", self.num_experts, f"a multiple of the mesh's {where}")
    require(
      not self.esp_schedule or self.d_ff % gpus_per_node == 0,
      "d_ff",
      self.d_ff,
      f"a multiple of the mesh's {gpus_per_node} GPUs per node (each holds d_ff / m of its node's experts)",
    )
    per_holder = self.num_experts // holders
    if self.slots_per_device is not None:
      require(
        self.slots_per_device >= per_holder,
        "slots_per_device",
        self.slots_per_device,
        f">= the {per_holder} experts each holder keeps on this mesh",
      )
    return per_holder
