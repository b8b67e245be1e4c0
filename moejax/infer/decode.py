"""Generation: prefill the prompts, then decode one token per request per step with the KV cache.

Requests are data parallel like training batches: B sharded over both mesh axes, request r owned
by flat device r // (B / D). The prefill runs the model on the prompts as in training (MoE layers:
`moe_apply`). The decode steps run in one of two modes:
  'vanilla'  the model with its MoE layers as `moe_apply`: two exchanges per MoE layer (dispatch to
             the experts, then back home for the next attention; DeepSpeed-MoE, ExFlow §III-A).
  'exflow'   context coherence (`moejax.infer.exflow`): the cache is gathered onto every device once
             after the prefill, then one exchange per MoE layer and one all-gather of the new
             tokens' state per step (ExFlow §IV-A).
Both give the same tokens and logits (up to float rounding), and the same as a 1 x 1 mesh.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.infer import batch as batch_lib
from moejax.infer import cache as cache_lib
from moejax.infer import exflow
from moejax.models import state as state_lib
from moejax.models.language_model import LanguageModel
from moejax.models.placed import with_placement  # noqa: F401 (public here: decoding's placement)
from moejax.moe import overflow as overflow_lib
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.validation import require

MODES = ("vanilla", "exflow")


@dataclasses.dataclass(frozen=True)
class Generation:
  """tokens [B, N]: the generated ids; logits [B, N, V] fp32: what each was drawn from.

  exchange_rows: token rows the MoE exchanges of the decode steps moved per generated token, split
  into {'intra_node', 'inter_node'} (a device's rows to itself move nothing and are left out).
  allgather_rows: the same for exflow's end-of-step all-gather: each new token's state (its id and
  the keys and values of every block, 2 x d per block) reaches every other device; zero for vanilla.
  decode_seconds: wall time of the decode steps after the first (which includes compilation), for
  decode_tokens = B x (N - 2) tokens; prefill_seconds: the prefill, compilation included.
  lost_choices: token-choices whose expert output was lost, dropped by capacity (vanilla with
  capacity_factor: outputs then depend on the batch) or by a full receive buffer. With buffer_factor
  none is lost to a full buffer: the prefill or decode step is repeated with the factor doubled
  (overflow_retries, `moejax.moe.overflow.until_no_overflow`).
  overflow_retries: (step, buffer_factor) of each repeat (step 0: the prefill); the prefill's factor
  and the decode steps' factor grow separately, and later steps keep the last one.
  """

  tokens: np.ndarray
  logits: np.ndarray
  exchange_rows: dict
  allgather_rows: dict
  decode_seconds: float
  decode_tokens: int
  prefill_seconds: float
  lost_choices: int
  overflow_retries: tuple = ()

  @property
  def tokens_per_second(self) -> float:
    return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def split_rows(rows_AxA: np.ndarray, gpus_per_node: int) -> dict:
  """rows [..., A, A] sent from flat device s to p -> {'intra_node', 'inter_node'} totals."""
  rows = np.asarray(rows_AxA, np.int64)
  cross, inside = mesh_lib.pair_masks(rows.shape[-1], gpus_per_node)
  return {"intra_node": int(rows[..., inside].sum()), "inter_node": int(rows[..., cross].sum())}


def on_mesh(model: LanguageModel, mesh: jax.sharding.Mesh) -> LanguageModel:
  """The same model (same parameters) laid out on another mesh."""
  graphdef, params, rest = state_lib.abstract_state(model.cfg, model.moe_cfg, mesh)
  _, have_params, have_rest = nnx.split(model, nnx.Param, ...)
  have_params, have_rest = nnx.to_pure_dict(have_params), nnx.to_pure_dict(have_rest)
  put = lambda a, like: jax.device_put(a, like.sharding)
  moved = nnx.merge(graphdef, jax.tree.map(put, have_params, params), jax.tree.map(put, have_rest, rest))
  if getattr(model, "expert_order", None) is not None:  # a placed model stays placed (`with_placement`)
    moved.expert_order = model.expert_order
  return moved


@functools.partial(jax.jit, static_argnames="graphdef")
def _vanilla_step(params, rest, cache, tokens_B, position, step, seed, temperature, *, graphdef):
  model = nnx.merge(graphdef, params, rest)
  logits_Bx1xV, aux, cache = model(tokens_B[:, None], cache=cache, start=position, details=True)
  logits_BxV = logits_Bx1xV[:, 0]
  next_B = exflow.sample(logits_BxV, jnp.arange(tokens_B.shape[0]), step, seed, temperature)
  d = mesh_lib.axis_sizes(model.mesh)
  dispatch = aux.get("traffic_rows", jnp.zeros((0, 1, d[0] * d[1], d[0] * d[1]), jnp.int32))
  # The combine sends every dispatched row back the way it came.
  return (
    next_B,
    logits_BxV,
    cache,
    {
      "rows": jnp.sum(dispatch + jnp.swapaxes(dispatch, -1, -2), axis=1),
      "dropped": _lost_choices(aux),
      "overflowed": jnp.sum(aux["tokens_overflowed"]),
    },
  )


def _lost_choices(aux):
  """Token-choices the MoE layers dropped by capacity or lost to full receive buffers."""
  return jnp.sum(aux["tokens_dropped"]) + jnp.sum(aux["tokens_overflowed"])


@functools.partial(jax.jit, static_argnames="graphdef")
def _prefill(params, rest, cache, prompts_BxS, *, graphdef):
  model = nnx.merge(graphdef, params, rest)
  last_Bx1 = jnp.full((prompts_BxS.shape[0], 1), prompts_BxS.shape[1] - 1)
  logits_Bx1xV, aux, cache = model(prompts_BxS, positions_BxP=last_Bx1, cache=cache, start=0)
  return logits_Bx1xV[:, 0], cache, _lost_choices(aux), jnp.sum(aux["tokens_overflowed"])


def _graphdef(model, moe_cfg):
  """The model's graph under `moe_cfg` (the same parameters; e.g. another buffer_factor)."""
  return state_lib.abstract_state(model.cfg, moe_cfg, model.mesh)[0]


def check_request(model, prompts_BxS, steps: int, mode: str, temperature: float) -> None:
  """Rejects bad generation requests before compiling, naming the value."""
  require(mode in MODES, "mode", mode, f"one of {MODES}")
  require(model.cfg.causal, "kind", getattr(model.cfg, "kind", None), "'gpt' (generation needs a causal decoder)")
  require(prompts_BxS.ndim == 2 and prompts_BxS.shape[1] >= 1, "prompts.shape", prompts_BxS.shape, "[B, P] with P >= 1")
  n, m = mesh_lib.axis_sizes(model.mesh)
  require(
    prompts_BxS.shape[0] % (n * m) == 0,
    "batch",
    prompts_BxS.shape[0],
    f"a multiple of the mesh's {n * m} devices (requests are data parallel)",
  )
  require(isinstance(steps, int) and steps >= 1, "steps", steps, "an int >= 1")
  require(
    prompts_BxS.shape[1] + steps - 1 <= model.cfg.max_len,
    "steps",
    steps,
    f"at most max_len - prompt length + 1 = {model.cfg.max_len - prompts_BxS.shape[1] + 1}",
  )
  require(isinstance(temperature, (int, float)) and temperature >= 0, "temperature", temperature, ">= 0 (0: greedy)")
  if mode == "exflow":
    require(
      model.cfg.num_moe_layers > 0,
      "mode",
      mode,
      "'vanilla' for a model without MoE layers (ExFlow's one exchange per layer is its MoE layers')",
    )
    exflow.check_moe(model.moe_cfg, platform_lib.of_mesh(model.mesh))


def traffic_per_token(rows: list, mesh, mode: str, generated: int) -> tuple[dict, dict]:
  """(exchange rows, all-gather rows) per generated token, split intra- and inter-node: `rows` the decode steps'
  [devices, devices] exchange counts; ExFlow's one all-gather of the cache moves each row to every other device."""
  n, m = mesh_lib.axis_sizes(mesh)
  per_token = lambda totals: {k: v / max(generated, 1) for k, v in totals.items()}
  exchange_rows = per_token(
    split_rows(np.sum([np.asarray(r) for r in rows], axis=0) if rows else np.zeros((n * m, n * m)), m)
  )
  if mode == "exflow":
    return exchange_rows, {"intra_node": float(m - 1), "inter_node": float(n * m - m)}
  return exchange_rows, {"intra_node": 0.0, "inter_node": 0.0}


def _prefill_and_draw(model, params, rest, cache, tokens_BxS, seed: int, temperature: float, on_retry):
  """(step 0's tokens [B], their logits [B, V] fp32, the filled cache, lost choices) of the prompts tokens [B, S].

  The prefill is repeated from the same empty cache with buffer_factor doubled while it loses token-choices to full
  receive buffers (each repeat told to `on_retry`), since a lost choice would corrupt its request.
  """

  def prefill(moe_cfg):
    out = _prefill(params, rest, cache, tokens_BxS, graphdef=_graphdef(model, moe_cfg))
    return out, int(out[3]) if moe_cfg.buffer_factor is not None else 0

  (logits_BxV, filled, lost, _), _ = overflow_lib.until_no_overflow(prefill, model.moe_cfg, on_retry)
  next_B = jax.jit(exflow.sample)(logits_BxV, jnp.arange(tokens_BxS.shape[0]), 0, seed, temperature)
  next_B.block_until_ready()
  return next_B, logits_BxV, filled, lost


def _step_runner(model, params, rest, mode: str):
  """(run, current): run(moe_cfg, cache, args) -> (the decode step's outputs, overflowed) for `until_no_overflow`;
  current: [the config the steps run with, its compiled step], kept from step to step so that a step is compiled
  again only when a repeat doubles buffer_factor, and later steps keep the last factor."""
  step_for = lambda moe_cfg: (
    exflow.exflow_step(model, moe_cfg)
    if mode == "exflow"
    else functools.partial(_vanilla_step, graphdef=_graphdef(model, moe_cfg))
  )
  current = [model.moe_cfg, step_for(model.moe_cfg)]

  def run(moe_cfg, cache, args):
    if moe_cfg is not current[0]:
      current[:] = moe_cfg, step_for(moe_cfg)
    out = current[1](params, rest, cache, *args)
    return out, int(out[3]["overflowed"]) if moe_cfg.buffer_factor is not None else 0

  return run, current


def _decode_steps(runner, cache, first, length: int, steps: int, seed: int, temperature: float, retried):
  """Decode steps 1 .. steps - 1 after the prefill -> (tokens [B] and logits [B, V] of every step from 0, each step's
  exchange rows, lost choices, seconds of the steps from 2 on: step 1 compiles, 0.0 with fewer than 3 steps).

  runner: `_step_runner`'s (run, current); first: the prefill's (next_B, logits_BxV, lost); a step that lost choices
  to a full buffer is run again from the same cache (`retried(step)` told of it).
  """
  run, current = runner
  next_B, logits_BxV, lost = first
  out_tokens, out_logits, rows, start = [next_B], [logits_BxV], [], None
  for step in range(1, steps):
    if step == 2:
      start = time.perf_counter()
    args = (next_B, jnp.int32(length + step - 1), jnp.int32(step), jnp.int32(seed), jnp.float32(temperature))
    (next_B, logits_BxV, cache, counts), _ = overflow_lib.until_no_overflow(
      functools.partial(run, cache=cache, args=args), current[0], retried(step)
    )
    out_tokens.append(next_B)
    out_logits.append(logits_BxV)
    rows.append(counts["rows"])
    lost = lost + counts["dropped"]
  jax.block_until_ready(out_tokens[-1])
  return out_tokens, out_logits, rows, lost, time.perf_counter() - start if steps > 2 else 0.0


def generate(
  model: LanguageModel, prompts_BxS, steps: int, *, mode: str = "vanilla", temperature: float = 0.0, seed: int = 0
) -> Generation:
  """prompts [B, P] int (equal lengths) -> `Generation` of `steps` tokens per request.

  temperature 0: greedy; else tokens drawn from softmax(logits / temperature), the draw of request
  r at step t keyed by (seed, t, r), so it does not depend on the mesh or the mode.
  """
  prompts_BxS = np.asarray(prompts_BxS)
  check_request(model, prompts_BxS, steps, mode, temperature)
  mesh, (batch, length) = model.mesh, prompts_BxS.shape
  _, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  start = time.perf_counter()
  cache = cache_lib.init_cache(model.cfg, batch, length + steps - 1, mesh)
  tokens = jax.device_put(prompts_BxS.astype(np.int32), cache_lib.cache_sharding(mesh, coherent=False))
  # A token-choice lost to a full receive buffer would corrupt its request: a prefill or decode step
  # that lost any is run again from the same cache with buffer_factor doubled (at the worst case, all
  # rows, nothing overflows), as the trainer's on_overflow='retry' does.
  retries = []
  retried = lambda step: lambda _, moe_cfg: retries.append((step, moe_cfg.buffer_factor))
  next_B, logits_BxV, cache, lost = _prefill_and_draw(model, params, rest, cache, tokens, seed, temperature, retried(0))
  prefill_seconds = time.perf_counter() - start
  if mode == "exflow":
    cache = jax.device_put(cache, cache_lib.cache_sharding(mesh, coherent=True))  # the one all-gather
  runner = _step_runner(model, params, rest, mode)
  out_tokens, out_logits, rows, lost, decode_seconds = _decode_steps(
    runner, cache, (next_B, logits_BxV, lost), length, steps, seed, temperature, retried
  )
  exchange_rows, allgather_rows = traffic_per_token(rows, mesh, mode, batch * (steps - 1))
  return Generation(
    tokens=np.stack([np.asarray(t) for t in out_tokens], axis=1),
    logits=np.stack([np.asarray(x) for x in out_logits], axis=1),
    exchange_rows=exchange_rows,
    allgather_rows=allgather_rows,
    decode_seconds=decode_seconds,
    decode_tokens=batch * max(steps - 2, 0),
    prefill_seconds=prefill_seconds,
    lost_choices=int(lost),
    overflow_retries=tuple(retries),
  )


def generate_tokens(
  model, prompt_BxP, steps: int, *, temperature: float = 0.0, seed: int = 0, mode: str = "vanilla"
) -> np.ndarray:
  """prompt [B, P] int -> tokens [B, P + steps]: the prompt and `steps` generated tokens (greedy by default; sampled
  with temperature > 0), for any B: the batch is padded to a multiple of the mesh's devices with copies of its last
  request, which are dropped again. `generate` has the timings and traffic."""
  prompt_BxP = np.asarray(prompt_BxP)
  require(prompt_BxP.ndim == 2 and prompt_BxP.shape[0] >= 1, "prompt.shape", prompt_BxP.shape, "[B, P] with B >= 1")
  out = generate(
    model, batch_lib.padded(prompt_BxP, model.mesh.size), steps, mode=mode, temperature=temperature, seed=seed
  )
  return np.concatenate([prompt_BxP, out.tokens[: prompt_BxP.shape[0]]], axis=1)
