"""Any batch on the mesh: a model's batch is sharded over all its devices, so a batch that does not divide is padded
with copies of its last row and the padding cut from the results (`generate_tokens`; a model's own call pads its
batch the same way: `moejax.models.decoder.Decoder`)."""

import numpy as np

from moejax.validation import require


def padded(rows_BxS, devices: int) -> np.ndarray:
  """rows [B, ...] (B >= 1) -> [B', ...]: B' the next multiple of `devices`, the added rows copies of the last."""
  rows_BxS = np.asarray(rows_BxS)
  require(rows_BxS.ndim >= 1 and rows_BxS.shape[0] >= 1, "batch", rows_BxS.shape, "[B, ...] with B >= 1")
  return np.concatenate([rows_BxS, np.repeat(rows_BxS[-1:], -rows_BxS.shape[0] % devices, axis=0)])
