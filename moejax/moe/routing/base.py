"""What every router shares: the `Router` interface, its results (`RoutingDecision`, `ReferenceRoute`, `Blocks`) and
the statistics' helpers (choice counts, z-loss sums, the Switch loss of the reference)."""

import abc
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.moe import plan as plan_lib
from moejax.moe.routing import zero
from moejax.validation import is_int, require


class RoutingDecision(NamedTuple):
  """expert_ids: [T, K] int32 global expert of each choice (index = priority rank);
  weights: [T, K] fp32 combine weights."""

  expert_ids: jax.Array
  weights: jax.Array


class ReferenceRoute(NamedTuple):
  """The whole batch's routing (`Router.reference`): ids and weights [T, K], the load-balance loss and z-loss, and
  the balanced routers' choice counts [balance_counts_size]."""

  ids: jax.Array
  weights: jax.Array
  load_balance: jax.Array
  z_loss: jax.Array
  counts: jax.Array


class Blocks(NamedTuple):
  """Contiguous blocks of experts that a routing treats as units (nodes, groups): a placement may permute experts
  inside a block or move a block whole, never split it. unit: what a block is called ('node', 'group'); reason: why
  splitting one changes the routing."""

  count: int
  unit: str
  reason: str


class Router(abc.ABC):
  """The interface. cfg: the layer's `MoEConfig`.

  Plain Python: `widths` ({kernel name: width}, in the order of the balance counts), `choices_per_token` (K),
  `max_top_k`, `group_limit` ((groups, kept per token) of group-limited selection, or None), `placement_blocks`
  (`Blocks` or None), `columns` ({kernel name: what its columns index: 'expert', 'block' or 'local' (an expert's
  index inside its block, shared by every block)}), `default_alpha` (the balance loss's coefficient when the config
  gives none). Traced: `route`, `reference`; `balance_terms` name the statistics `aux_losses` reads.
  """

  name: str
  needs_token_ids = False  # it routes by the tokens' ids ('hash'): moe_apply(token_ids=) is required
  zero_refusal = None  # why the routing cannot score zero experts (`routing.zero`), or None: it can
  chooses_nodes = False  # it needs num_nodes (the mesh's), and a placement keeps each node's experts together
  shares_local_router = False  # one router over a node's local experts, shared by every node
  default_alpha = 0.01  # Switch's

  def __init__(self, cfg):
    self.cfg = cfg

  @property
  @abc.abstractmethod
  def widths(self) -> dict[str, int]:
    """{kernel name: width} of the router parameters, each {'kernel': [d, width]}."""

  @property
  def scored(self) -> int:
    """The experts a token's choices range over: the E real ones, then the zero experts (ids E .. E + Z - 1)."""
    return self.cfg.num_experts + self.cfg.zero_experts

  @property
  def choices_per_token(self) -> int:
    return self.cfg.top_k

  @property
  def max_top_k(self) -> int:
    return self.cfg.num_experts

  group_limit = None
  placement_blocks = None
  limits_groups = False  # it takes num_groups (group-limited selection among contiguous experts)

  def check_nodes(self, nodes: int) -> None:
    """Raises ConfigError unless a routing that chooses nodes has the mesh's `nodes`."""
    if self.chooses_nodes:
      require(self.cfg.num_nodes == nodes, "num_nodes", self.cfg.num_nodes, f"the mesh's node count {nodes}")

  def check(self) -> None:
    """Raises ConfigError naming the field where the config's other fields do not fit this routing."""
    cfg = self.cfg
    zero.check(cfg, self)
    if self.chooses_nodes:
      n = cfg.num_nodes
      require(
        is_int(n) and cfg.num_experts % n == 0,
        "num_nodes",
        n,
        f"a positive int dividing num_experts={cfg.num_experts} (routing={cfg.routing!r} chooses nodes)",
      )
      require(
        is_int(cfg.node_top_k) and cfg.node_top_k <= n, "node_top_k", cfg.node_top_k, f"an int in [1, num_nodes={n}]"
      )
    require(
      cfg.hash_vocab == 0 or self.needs_token_ids,
      "hash_vocab",
      cfg.hash_vocab,
      f"0 unless routing='hash' (a table of each token id's experts; routing={cfg.routing!r} scores them)",
    )
    limit = self.max_top_k
    require(cfg.top_k <= limit, "top_k", cfg.top_k, f"at most {limit} for routing={cfg.routing!r}")
    require(
      cfg.num_groups is None or self.limits_groups,
      "num_groups",
      cfg.num_groups,
      "None unless routing='topk' ('node_limited' is group-limited with groups = nodes; 'bilevel' picks one "
      "node's experts)",
    )

  @property
  def columns(self) -> dict[str, str]:
    return {"router": "expert"}

  @abc.abstractmethod
  def balance_terms(self) -> list[tuple[str, float, int]]:
    """(kernel name, coefficient, choices per token) of each balanced router, in `widths` order."""

  @abc.abstractmethod
  def route(
    self,
    x_TxD,
    params: dict,
    bias_E=None,
    sequence_length: int | None = None,
    token_ids_T=None,
    hash_index_S=None,
    hash_table_VxK=None,
  ):
    """x [T, d] (and the tokens' ids [T], used by 'hash' only) -> (RoutingDecision, loss statistics: sums over these T tokens, to be summed over devices: 'counts'
    and 'prob_sums' {kernel name: [width]}, 'z_sum', 'tokens', and with balance_loss='sequence'
    'sequence_loss_sum' and 'sequences'). hash_index_S: where each expert a hash names sits, hash_table_VxK [V, K]
    each id's experts ('hash': `Hashed`)."""

  @abc.abstractmethod
  def reference(
    self,
    x_TxD,
    params: dict,
    bias_E=None,
    sequence_length: int | None = None,
    prior=None,
    token_ids_T=None,
    hash_index_S=None,
    hash_table_VxK=None,
  ) -> ReferenceRoute:
    """The routing of the whole batch x [T, d], written plainly; prior: earlier micro-batches' choice counts;
    token_ids_T: the tokens' ids [T], hash_index_S the experts' places and hash_table_VxK [V, K] each id's experts
    ('hash')."""


def counts(ids, size):
  """[size] float32 choices per id (ids out of range count nowhere)."""
  return plan_lib.histogram(ids, size).astype(jnp.float32)


def z_sum(logits):
  z = jax.nn.logsumexp(logits, axis=-1)
  return jnp.sum(z * z)


def renormalized(weights_TxK, cfg):
  """The weights over their sum (at least renormalize_min: ERNIE-4.5's clamp) with renormalize, else as they are."""
  if not cfg.renormalize:
    return weights_TxK
  total = jnp.sum(weights_TxK, axis=-1, keepdims=True)
  return weights_TxK / (jnp.maximum(total, cfg.renormalize_min) if cfg.renormalize_min else total)


def softmax_router(x_TxD, params, name):
  """(logits, probabilities) [T, width] of the softmax router `name`, in fp32."""
  logits = jnp.dot(x_TxD.astype(jnp.float32), params[name]["kernel"].astype(jnp.float32))
  return logits, jax.nn.softmax(logits, axis=-1)


def switch_loss(chosen_TxK, probs_TxX, coef, prior_X=None):
  """coef * X * sum_x f_x P_x (the reference's form): f = fraction of the choices made for x (with prior_X, of these
  choices and the prior counts together), P = mean probability of x."""
  num = probs_TxX.shape[1]
  made = counts(chosen_TxK, num)
  f = made / chosen_TxK.size if prior_X is None else (made + prior_X) / (chosen_TxK.size + prior_X.sum())
  return coef * num * jnp.sum(f * probs_TxX.mean(0))
