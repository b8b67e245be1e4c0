"""Hash routing (DeepSeek-V4's hash-routed layers; Roller et al.'s Hash Layers): a token's experts are a fixed function
of its token id, never of its activations, so a layer's exchange plan is known from the ids before the layer runs
(`hash_experts`, a pure function of the ids). A placement moves experts to other indices, so the layer keeps where
each expert the hash names now sits (`hash_index` [E + Z], the identity until placed: `moejax.placement.apply`) and
routes to that index. The router kernel still weights the chosen experts (its scores at those
ids, renormalised and scaled as 'topk's), so it trains; the balance loss and z-loss are 'topk's."""

import jax
import jax.numpy as jnp

from moejax.moe.routing.flat import TopK
from moejax.validation import require

MULTIPLIER = 2654435761  # Knuth's multiplicative hash: 2^32 / the golden ratio, products taken mod 2^32


def hash_experts(token_ids_T: jax.Array, top_k: int, scored: int) -> jax.Array:
  """[T, K] int32: K distinct experts of the `scored` ones for each token id: e_j = (h + j * (W // K)) mod W with
  h = (id * MULTIPLIER mod 2^32) mod W, W = scored (distinct: j * (W // K) < W for j < K)."""
  h_T = (token_ids_T.astype(jnp.uint32) * jnp.uint32(MULTIPLIER)) % jnp.uint32(scored)
  stride = scored // top_k
  return ((h_T[:, None] + jnp.arange(top_k, dtype=jnp.uint32) * stride) % scored).astype(jnp.int32)


class Hashed(TopK):
  """'hash': the experts of `hash_experts(token_ids)`, weighted by the flat router's scores at them."""

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

  def choose(self, select_TxE, token_ids_T, hash_index_S):
    """[T, K]: the experts the ids hash to, at their places hash_index_S [E + Z] (None: not placed)."""
    require(token_ids_T is not None, "token_ids", None, "the tokens' ids with routing='hash' (moe_apply(token_ids=))")
    ids_TxK = hash_experts(token_ids_T, self.cfg.top_k, self.scored)
    return ids_TxK if hash_index_S is None else hash_index_S[ids_TxK]
