"""Old names kept while the programs that import them move to `moe.path` and `moe.collective` (to be deleted)."""

from moejax.moe import path as path_lib
from moejax.moe.collective import buffer_bound, padded_all_to_all  # noqa: F401
from moejax.moe.config import TRANSPORT_ALIASES


def transport_hops(transport: str) -> tuple:
  return path_lib.hops(TRANSPORT_ALIASES[transport][0])
