"""`MoEConfig`, the one description of an MoE layer, and up-front validation of experiment configs.

Every check runs in plain Python before anything is traced or compiled, and a failure names the
field, its value and what is allowed.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from kernels.activations import ACTIVATIONS
from moejax.moe import collective as collective_lib
from moejax.moe import expert_sharding as sharding_lib
from moejax.moe import experts as experts_lib
from moejax.moe import fields as fields_lib
from moejax.moe import path as path_lib
from moejax.moe import routing as routing_lib
from moejax.moe import schedule as schedule_lib
from moejax.moe.fields import TRANSPORT_ALIASES  # noqa: F401  (the old `transport` values, read here)
from moejax.moe.routing import scores as routing_scores
from moejax.validation import is_int, prefixed, reject_unknown, require

ROUTINGS = tuple(routing_lib.ROUTERS)  # topk, bilevel, node_limited: each choice's options are its registry's names
PATHS = tuple(path_lib.PATHS)  # flat, gpu_first, node_first
COLLECTIVES = tuple(collective_lib.COLLECTIVES)  # padded, ragged, capacity, auto
EXPERT_ACTIVATIONS = (*ACTIVATIONS, *experts_lib.GATED_ONLY)  # the elementwise ones, then the clamped SwiGLUs
EXPERT_BACKENDS = tuple(experts_lib.BACKENDS)  # ragged_dot, dense, the Pallas ones, tokamax, fp8, auto
DTYPES = ("float32", "bfloat16")
DISPATCH_DTYPES = (None, "float32", "bfloat16", "float8_e4m3fn")  # None: the activations' own dtype
COMBINE_DTYPES = (None, "float32", "bfloat16")  # None: float32, as the experts accumulate
SCHEDULES = tuple(schedule_lib.SCHEDULES)  # sequential, chunked, comet
SCORES = tuple(routing_scores.SCORES)
BALANCE_LOSSES = ("batch", "sequence", "global_batch")
ESP_SCHEDULES = tuple(sharding_lib.SHARDINGS)  # None, baseline, s1, s2, auto
GROUP_SCORES = ("top2_sum", "max")
OPTIONS = (
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
)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """One MoE layer.

  num_experts: E, the global number of experts (a multiple of the mesh's device count).
  top_k: experts per token (for 'bilevel', per chosen node); d_model, d_ff: model and expert hidden widths.
  routing: 'topk' (flat softmax top-k: Switch k=1, GShard k=2); 'bilevel' (SMILE: softmax over nodes, top
    node_top_k; softmax over a node's E / num_nodes experts, shared by all nodes, top top_k; weight p_node *
    q_local); 'node_limited' (DeepSeek-V3: flat router, the node_top_k nodes with the best sums of their two best
    expert probabilities kept, then the top top_k experts on them); 'hash' (DeepSeek-V4's hash-routed layers: top_k
    distinct experts fixed by the token id, `moe_apply(token_ids=)`, weighted by the flat router's scores).
  path: the hops rows take to their experts (`moe.path`): 'flat' (one exchange over both mesh axes), 'gpu_first'
    (Tutel-2DH's, DeepSpeed's hierarchical all-to-all) or 'node_first' (SMILE's path, DeepEP's internode one).
  collective: what moves each hop's rows (`moe.collective`): 'ragged' (GPU/TPU), 'padded' (its semantics from a ring
    of permutes), 'capacity' (GShard's dense dispatch; needs capacity_factor) or 'auto' (per platform).
  transport: the old single field, accepted for configs written before path and collective (a one-line notice):
    'ragged', 'padded', 'capacity' = path 'flat' with that collective; 'hierarchical' = 'gpu_first', 'bilevel' =
    'node_first', each with 'auto'. Not stored.
  expert_backend: one of `moe.experts.BACKENDS` ('ragged_dot', 'dense', the Pallas ones, 'tokamax', 'fp8') or 'auto':
    the fastest measured at the layer's per-device shape in expert_table (None: the table shipped for the device;
    resolved when the config is made, `moejax.cost.expert_backend.resolve`).
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
    renormalize_min: the sum's floor, weights / max(sum, renormalize_min) (ERNIE-4.5's moe_norm_min; 0: none).
  load_balance_coef, local_balance_coef: alpha of the Switch loss alpha * E * sum_e f_e P_e, or alpha and beta of
    SMILE's alpha * n * sum_i f_i P_i + beta * m' * sum_j f_j Q_j; None: the papers' 0.01 (Switch), 0.005.
  z_loss_coef: of the router z-loss mean(logsumexp(logits)^2); jitter: router-input noise x * U(1 - jitter, 1 +
    jitter) in training (0 = off). dtype: the expert matmuls' (accumulation is fp32).
  dispatch_dtype, combine_dtype: the rows' dtype on the wire, to the experts and back (and the backward's
    gradients, both ways, in combine_dtype): None (the activations' dtype; the combine's float32), 'bfloat16', or
    for the dispatch 'float8_e4m3fn' with a float32 scale per 128 elements of a row from its amax (DeepSeek-V3).
  schedule: the order of the exchanges and the expert compute (Comet; `moe.schedule`): 'sequential', 'chunked'
    (Tutel/FasterMoE) or 'comet'; the same result for every routing, path, collective, sharding and table.
  num_chunks: chunks of 'chunked' (dividing the rows a device sends) or column blocks of 'comet' (of d_model).
  esp_schedule: None = experts over both mesh axes (EP only), else Parm's (`moe.expert_sharding`): 'baseline'
    (DeepSpeed-MoE), 's1', 's2' (PauseMP) or 'auto' (Algorithm 1, resolved by `moejax.cost.parm.resolve_auto`).
  esp_cost: where 'auto' takes the collectives' alpha-beta terms: a topology preset of moejax.cost.topology
    (default 'dgx_h100_ib') or the path of an experiments/bench_collectives.py JSON record.
  expert_data_parallel: True: experts over the GPUs of a node only (expert e on GPU e // (E / m) of every node),
    replicated over 'node' (gradients summed over it); tokens go to experts in their own node (one hop over 'gpu').
    Refused with esp_schedule, the node routings and the two-hop paths.
  score: the flat router's scores (`routing.scores`): 'softmax' (Switch, GShard), 'sigmoid' (DeepSeek-V3: independent
    per-expert affinities) or 'sqrtsoftplus' (DeepSeek-V4: sqrt(softplus(logit))). Not with 'bilevel' (SMILE's routers are two softmaxes whose product is the weight).
  routed_scaling: the factor on the routed experts' weights, after renormalize (DeepSeek-V2: 16, V3: 2.5).
  weight_inputs: the weights scale each choice's expert input, FFN_e(w x), not its output (Llama 4); not with
    ffn_bias or schedule 'comet' (`fields.check`).
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
    = swiglu_limit; or 'swiglu_clamped_v4' (DeepSeek-V4; gated only): silu(min(x w_gate, limit)) * clip(x w_in, -limit,
    limit), routed and shared experts alike. ffn_bias: each routed expert's matmuls add biases b_in, b_gate [E, f] and b_out [E, d]
    (gpt-oss). router_bias: the flat router's logits add a bias router.bias [E] (gpt-oss). Neither clamped SwiGLU
    nor the biases run in the fused Pallas FFN ('pallas', 'pallas_saved'), which is refused with them.
  hash_vocab: with routing='hash', V > 0 gives the layer a frozen table [V, top_k] of each token id's experts
    (`hash_table`, DeepSeek-V4's tid2eid; initially the hash's), ids in [0, V); 0: no table, the hash function.
  zero_experts: Z zero-computation experts (LongCat-Flash) after the E real ones (ids E .. E + Z - 1): the router
    scores E + Z, a choice of one outputs the token itself times its weight, on the token's own device (it never
    crosses the wire; no parameters; aux['zero_expert_counts'] [Z]). Not with 'bilevel' or the bias's update rule.
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
  renormalize_min: float = 0.0
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
  weight_inputs: bool = False
  num_groups: int | None = None
  topk_groups: int = 1
  group_score: str = "top2_sum"
  bias_update_rate: float = 0.0
  balance_loss: str = "batch"
  num_shared_experts: int = 0
  shared_d_ff: int | None = None
  shared_gate: bool = False
  zero_experts: int = 0
  hash_vocab: int = 0
  slots_per_device: int | None = None
  replan_every: int = 0
  replan_window: int = 16
  transport: dataclasses.InitVar[str | None] = None

  def __post_init__(self, transport: str | None = None):
    """Field types and options first, then each choice checks the config (`check` of its object)."""
    if transport is not None:  # the old field, read as its path and collective
      path, collective = fields_lib.read_transport(transport, PATHS, COLLECTIVES)
      object.__setattr__(self, "path", path)
      object.__setattr__(self, "collective", collective)
    for name in ("num_experts", "top_k", "d_model", "d_ff"):
      require(is_int(getattr(self, name)), name, getattr(self, name), "a positive int")
    for name, options in OPTIONS:
      require(getattr(self, name) in options, name, getattr(self, name), f"one of {options}")
    fields_lib.check(self)
    self.router.check()
    for choice in (self.backend_kind, self.sharding_kind, self.schedule_kind, self.path_kind, self.collective_kind):
      choice.check(self)

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
  def path_kind(self) -> path_lib.PathKind:
    """The path's hops (`moe.path.PATHS`)."""
    return path_lib.of(self)

  @property
  def collective_kind(self) -> collective_lib.Collective:
    """The collective, unresolved ('auto' resolves per platform; `moe.collective.COLLECTIVES`)."""
    return collective_lib.of(self)

  @property
  def schedule_kind(self) -> schedule_lib.Schedule:
    """The order of the exchanges and the expert compute (`moe.schedule.SCHEDULES`)."""
    return schedule_lib.of(self)

  @property
  def sharding_kind(self) -> sharding_lib.ExpertParallel:
    """The expert sharding, 'auto' included (`moe.expert_sharding.chosen`)."""
    return sharding_lib.chosen(self)

  @property
  def backend_kind(self) -> experts_lib.Backend:
    """The expert backend (`moe.experts.BACKENDS`)."""
    return experts_lib.of(self)

  @property
  def balance_counts_size(self) -> int:
    """Length of the balance loss's choice counts: each balanced router's width (E; 'bilevel': n, then m')."""
    return sum(self.router.widths.values())

  @property
  def deduplicates(self) -> bool:
    """Whether rows travel once per destination of a hop (`dedup`, None resolved by the expert sharding)."""
    return self.sharding_kind.dedups_by_default if self.dedup is None else self.dedup

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
    return self.sharding_kind.holders(nodes, gpus_per_node)

  def check_mesh(self, nodes: int, gpus_per_node: int) -> None:
    """Raises ConfigError naming the field unless the layer runs on a nodes x gpus_per_node mesh."""
    self.experts_per_holder(nodes, gpus_per_node)

  def experts_per_holder(self, nodes: int, gpus_per_node: int) -> int:
    """The experts each holder keeps on a nodes x gpus_per_node mesh (a GPU's; with esp_schedule a node's, each
    split over its GPUs), after the checks of `check_mesh` (the router's nodes, then the expert sharding's)."""
    self.router.check_nodes(nodes)
    return self.sharding_kind.experts_per_holder(self, nodes, gpus_per_node)
