"""The communication remedies measured on one decoder family's Hugging Face checkpoint (experiments/family_remedies.py):
one scheme (MoEConfig overrides) loaded with `from_hf`, its forward with details, each MoE layer's own traffic
accounting per hop (inter- and intra-node rows and bytes per token), the jitted forward compiled and timed with the
other schemes interleaved, and its logits against the baseline's and the checkpoint's reference.
"""

import os
import statistics
import time

import numpy as np

from moejax.validation import ConfigError

# The MoEConfig fields a scheme's record keeps: what the schemes set.
RECORDED_FIELDS = (
  "path",
  "collective",
  "dedup",
  "schedule",
  "num_chunks",
  "esp_schedule",
  "slots_per_device",
  "expert_data_parallel",
  "dispatch_dtype",
  "combine_dtype",
)


def hop_name(hop) -> str:
  return hop if isinstance(hop, str) else "flat"


def relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def lossless(overrides: dict) -> bool:
  """Whether a scheme moves the rows in their own dtypes (then its logits must equal the baseline's)."""
  return not overrides.get("dispatch_dtype") and not overrides.get("combine_dtype")


def resolve(overrides: dict, hf_config: dict, nodes: int, gpus_per_node: int) -> dict:
  """The overrides with 'spare' slots made a number: the experts a holder keeps, plus one."""
  out = dict(overrides)
  if out.get("slots_per_device") == "spare":
    from moejax.models import hf_config as hf_config_lib

    _, moe_cfg = hf_config_lib.from_hf_config(hf_config, moe={k: v for k, v in out.items() if k != "slots_per_device"})
    out["slots_per_device"] = moe_cfg.num_experts // moe_cfg.expert_holders(nodes, gpus_per_node) + 1
  return out


def make_tokens(checkpoint: str, vocab: int, max_len: int, batch: int, seq_len: int, seed: int):
  """(tokens [batch, S] int32, reference logits of the first rows or None)."""
  rng = np.random.default_rng(seed)
  path = os.path.join(checkpoint, "reference.npz")
  if not os.path.exists(path):
    return rng.integers(0, vocab, (batch, min(seq_len, max_len))).astype(np.int32), None
  with np.load(path) as ref:
    tokens, logits = np.asarray(ref["tokens"], np.int32), np.asarray(ref["logits"], np.float32)
  extra = rng.integers(0, vocab, (max(batch - len(tokens), 0), tokens.shape[1])).astype(np.int32)
  return np.concatenate([tokens, extra])[: max(batch, len(tokens))], logits


def layer_traffic(model, tokens_BxS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(traffic_rows [M, hops, A, A], traffic_bytes [M, hops, A, A], logits) of the MoE layers, each run on its input
  as the model's forward gives it (the blocks' loop of `blocks.run_blocks`, eagerly; the logits check the loop)."""
  import jax.numpy as jnp

  from moejax.models import shortcut_block
  from moejax.models.blocks import MoEFFN
  from moejax.validation import require

  why = shortcut_block.refusal(model.cfg)  # this loop runs each block's attention and FFN halves apart
  require(why is None, "checkpoint", model.cfg.family, f"a family of sequential layers: {why}")
  x = model.embed_tokens(tokens_BxS)
  rows, nbytes = [], []
  for block in model.blocks:
    x = block.attend(x, train=False, rngs=None)
    if isinstance(block.ffn, MoEFFN):
      _, aux = block.ffn.moe(block.ffn_input(x), train=False, rng=None)
      rows.append(np.asarray(aux["traffic_rows"]))
      nbytes.append(np.asarray(aux["traffic_bytes"]))
    x, _ = block.feed_forward(x, train=False, rngs=None)
    x = x.astype(jnp.dtype(model.cfg.dtype))
  return np.stack(rows), np.stack(nbytes), np.asarray(model.head_logits(x))


def hop_summary(rows_MxHxAxA, bytes_MxHxAxA, hops, gpus_per_node: int, tokens: int) -> list[dict]:
  """Per hop: inter- and intra-node rows and bytes per token, the mean over the MoE layers."""
  from moejax.runtime import mesh as mesh_lib

  cross, inside = mesh_lib.pair_masks(rows_MxHxAxA.shape[-1], gpus_per_node)
  layers = rows_MxHxAxA.shape[0]
  out = []
  for h, hop in enumerate(hops):
    r, b = rows_MxHxAxA[:, h], bytes_MxHxAxA[:, h]
    out.append(
      {
        "hop": hop_name(hop),
        "inter_rows_per_token": float(r[:, cross].sum() / layers / tokens),
        "intra_rows_per_token": float(r[:, inside].sum() / layers / tokens),
        "inter_bytes_per_token": float(b[:, cross].sum() / layers / tokens),
        "intra_bytes_per_token": float(b[:, inside].sum() / layers / tokens),
      }
    )
  return out


def compile_forward(model, tokens):
  """(a call of the jitted forward that blocks until its logits are ready, its compile seconds, the logits)."""
  import jax
  from flax import nnx

  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])
  start = time.perf_counter()
  logits = jax.block_until_ready(forward(state, tokens))
  return lambda: jax.block_until_ready(forward(state, tokens)), time.perf_counter() - start, np.asarray(logits)


def time_rounds(calls: dict, rounds: int) -> dict:
  """name -> seconds of each of `rounds` calls, the schemes interleaved (round r calls every scheme once, so a
  busy spell of the machine falls on all of them alike); one untimed call each first."""
  for call in calls.values():
    call()
  times = {name: [] for name in calls}
  for _ in range(rounds):
    for name, call in calls.items():
      start = time.perf_counter()
      call()
      times[name].append(time.perf_counter() - start)
  return times


def measure(name: str, overrides: dict, checkpoint: str, hf_config: dict, mesh, tokens_BxS) -> dict:
  """One scheme: load, forward with details, the layers' traffic, the compiled forward (its call under 'call', for
  `time_rounds`); a ConfigError is a refusal."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from moejax import models
  from moejax.moe import expert_sharding as esp_lib
  from moejax.runtime import mesh as mesh_lib

  nodes, gpus = mesh_lib.axis_sizes(mesh)
  entry = {"scheme": name, "overrides": dict(overrides), "lossless": lossless(overrides)}
  try:
    resolved = resolve(overrides, hf_config, nodes, gpus)
    entry["overrides"] = resolved
    model = models.from_hf(checkpoint, mesh, dtype="float32", moe=resolved)
    tokens = jax.device_put(tokens_BxS, NamedSharding(mesh, P(mesh_lib.AXES)))
    logits, aux = model(tokens, details=True)
    logits = np.asarray(logits)
    rows, nbytes, walk_logits = layer_traffic(model, tokens)
    call, compile_s, jit_logits = compile_forward(model, tokens)
  except ConfigError as e:
    return {**entry, "status": "refused", "reason": str(e)}
  except Exception as e:  # noqa: BLE001 (recorded, the study goes on)
    return {**entry, "status": "error", "reason": f"{type(e).__name__}: {e}"}
  moe_cfg = model.moe_cfg
  model_rows = np.asarray(aux["traffic_rows"])
  entry.update(
    {
      "status": "ok",
      "logits": logits,
      "expert_ids": np.asarray(aux["expert_ids"]),
      "moe_config": {k: getattr(moe_cfg, k) for k in RECORDED_FIELDS},
      "deduplicates": moe_cfg.deduplicates,
      "traffic_rows_match_model": bool(np.array_equal(rows, model_rows)),
      "layer_loop_rel_err": relative_error(walk_logits, logits),
      "jit_rel_err": relative_error(jit_logits, logits),
      "tokens_overflowed": int(np.asarray(aux["tokens_overflowed"]).sum()),
      "tokens_dropped": int(np.asarray(aux["tokens_dropped"]).sum()),
      "hops": hop_summary(rows, nbytes, esp_lib.of(moe_cfg).hops(moe_cfg), gpus, tokens_BxS.size),
      "forward": {"compile_s": compile_s},
      "call": call,
    }
  )
  for key in ("rows", "bytes"):
    for side in ("inter", "intra"):
      entry[f"{side}_{key}_per_token"] = sum(h[f"{side}_{key}_per_token"] for h in entry["hops"])
  return entry


def time_forwards(entries: list[dict], iters: int) -> None:
  """Each run scheme's forward timed over `iters` interleaved rounds (`time_rounds`): its times and median added
  under 'forward', its 'call' taken out."""
  times = time_rounds({e["scheme"]: e.pop("call") for e in entries if e["status"] == "ok"}, iters)
  for entry in entries:
    if entry["status"] == "ok":
      entry["forward"].update(times_s=times[entry["scheme"]], median_s=statistics.median(times[entry["scheme"]]))


def compare_to_baseline(entries: list[dict], reference) -> None:
  """Each run scheme against the first (the baseline): logits' errors (and against the checkpoint's reference
  logits where given), the share of the baseline's experts chosen, the forward's time ratio; its logits and expert
  ids taken out."""
  base = entries[0]
  base_ids, base_logits = np.sort(base["expert_ids"], axis=-1), base["logits"]
  for entry in entries:
    if entry["status"] != "ok":
      continue
    logits = entry.pop("logits")
    entry["rel_err_vs_baseline"] = relative_error(logits, base_logits)
    entry["max_abs_err_vs_baseline"] = float(np.abs(logits - base_logits).max())
    entry["rel_err_vs_reference"] = None if reference is None else relative_error(logits[: len(reference)], reference)
    entry["same_experts_as_baseline"] = float((np.sort(entry.pop("expert_ids"), axis=-1) == base_ids).mean())
    entry["forward"]["ratio_to_baseline"] = entry["forward"]["median_s"] / base["forward"]["median_s"]
