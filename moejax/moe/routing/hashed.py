"""Hash routing (DeepSeek-V4's hash-routed layers; Roller et al.'s Hash Layers): a token's experts are a fixed function
of its token id, never of its activations, so a layer's exchange plan is known from the ids before the layer runs.
The function is `hash_experts` (a Knuth hash of the id), or with `hash_vocab` = V a frozen table [V, K] of each id's
experts (DeepSeek-V4's `tid2eid`, read from its checkpoint; `initial_table` until then: the hash's, so a layer built
without a checkpoint routes as the function does). Ids are meant to lie in [0, V): outside, concrete ids are refused
before tracing (`moe.layout`) and traced ones clipped to [0, V) and counted (aux['hash_ids_clipped']).
A placement moves experts to other indices, so the layer keeps where each expert the hash (or table) names now sits
(`hash_index` [E + Z], the identity until placed: `moejax.placement.apply`) and routes to that index; the table stays
in the experts' original numbering. The router kernel still weights the chosen experts (its scores at those ids,
renormalised and scaled as 'topk's), so it trains; the balance loss and z-loss are 'topk's."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.moe.routing.flat import TopK
from moejax.validation import is_int, require

MULTIPLIER = 2654435761  # Knuth's multiplicative hash: 2^32 / the golden ratio, products taken mod 2^32


def hash_experts(token_ids_T: jax.Array, top_k: int, scored: int) -> jax.Array:
  """[T, K] int32: K distinct experts of the `scored` ones for each token id: e_j = (h + j * (W // K)) mod W with
  h = (id * MULTIPLIER mod 2^32) mod W, W = scored (distinct: j * (W // K) < W for j < K)."""
  h_T = (token_ids_T.astype(jnp.uint32) * jnp.uint32(MULTIPLIER)) % jnp.uint32(scored)
  stride = scored // top_k
  return ((h_T[:, None] + jnp.arange(top_k, dtype=jnp.uint32) * stride) % scored).astype(jnp.int32)


def initial_table(cfg) -> np.ndarray:
  """[V, K] int32, V = cfg.hash_vocab: `hash_experts` of every id 0 .. V - 1 (the table's value until a checkpoint
  gives DeepSeek-V4's)."""
  with jax.ensure_compile_time_eval():  # concrete under a jit (a model built inside one: `moejax.models.state`)
    return np.asarray(hash_experts(jnp.arange(cfg.hash_vocab), cfg.top_k, cfg.router.scored))


class Hashed(TopK):
  """'hash': the experts of `hash_experts(token_ids)` (with hash_vocab, of the table's rows), weighted by the flat
  router's scores at them."""

  name = "hash"
  limits_groups = False
  needs_token_ids = True

  def check(self):
    super().check()
    require(
      self.cfg.bias_update_rate == 0,
      "bias_update_rate",
      self.cfg.bias_update_rate,
      "0 with routing='hash' (the bias shifts the scores that choose experts; a hash of the token id chooses them)",
    )
    require(
      is_int(self.cfg.hash_vocab, 0),
      "hash_vocab",
      self.cfg.hash_vocab,
      "an int >= 0: the token ids' range V of the layer's table [V, top_k] of experts (0: no table, the hash function)",
    )

  def choose(self, select_TxE, token_ids_T, hash_index_S, hash_table_VxK=None):
    """[T, K]: the experts the ids hash to (hash_table_VxK [V, K]: its rows at the ids, clipped to [0, V); None: the
    hash function's), at their places hash_index_S [E + Z] (None: not placed)."""
    require(token_ids_T is not None, "token_ids", None, "the tokens' ids with routing='hash' (moe_apply(token_ids=))")
    if self.cfg.hash_vocab:  # outside [0, V) refused where concrete (`moe.layout`), else clipped and counted
      token_ids_T = jnp.clip(token_ids_T, 0, self.cfg.hash_vocab - 1)
    if hash_table_VxK is None:
      ids_TxK = hash_experts(token_ids_T, self.cfg.top_k, self.scored)
    else:  # a table entry outside [0, E + Z) is refused where concrete; traced, clipped as any gather's index
      ids_TxK = jnp.clip(jnp.take(hash_table_VxK, token_ids_T, axis=0, mode="clip"), 0, self.scored - 1)
    return ids_TxK if hash_index_S is None else hash_index_S[ids_TxK]
