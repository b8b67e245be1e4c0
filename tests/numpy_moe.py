"""The MoE layer's semantics as a float64 NumPy loop over tokens: an independent check of the reference."""

import math

import numpy as np

# gelu is the tanh approximation throughout moejax (kernels.activations).
ACT = {
  "gelu": lambda h: 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3))),
  "relu": lambda h: np.maximum(h, 0),
  "silu": lambda h: h / (1 + np.exp(-h)),
}


def moe_numpy(params, x, cfg, dispatch_groups=1):
  """x [T, d] -> (y [T, d], dropped count, expert counts [E]); all float64."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items() if not k.endswith("router")}
  x = np.asarray(x, np.float64)
  tokens, num_experts = x.shape[0], cfg.num_experts

  def softmax_top(name, k):
    logits = x @ np.asarray(params[name]["kernel"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    return top, np.take_along_axis(probs, top, -1)

  if cfg.routing == "bilevel":  # expert j of node i, weight p_i * q_j, node-major choice order
    nodes, p_top = softmax_top("node_router", cfg.node_top_k)
    local, q_top = softmax_top("local_router", cfg.top_k)
    ids = (nodes[:, :, None] * (num_experts // cfg.num_nodes) + local[:, None, :]).reshape(tokens, -1)
    weights = (p_top[:, :, None] * q_top[:, None, :]).reshape(tokens, -1)
  else:
    ids, weights = softmax_top("router", cfg.top_k)
  k = ids.shape[1]
  if cfg.renormalize:
    weights /= weights.sum(-1, keepdims=True)
  keep = np.ones((tokens, k), bool)
  if cfg.capacity_factor is not None:
    group_tokens = tokens // dispatch_groups
    capacity = math.ceil(cfg.capacity_factor * group_tokens * k / num_experts)
    for g in range(dispatch_groups):
      used = np.zeros(num_experts, int)
      for c in range(k):  # Every first choice before any second choice.
        for t in range(g * group_tokens, (g + 1) * group_tokens):
          e = ids[t, c]
          keep[t, c] = used[e] < capacity
          used[e] += 1
  act = ACT[cfg.activation]
  y = np.zeros_like(x)
  counts = np.zeros(num_experts, int)
  for t in range(tokens):
    for c in range(k):
      if not keep[t, c]:
        continue
      e = ids[t, c]
      counts[e] += 1
      h = x[t] @ p["w_in"][e]
      h = act(x[t] @ p["w_gate"][e]) * h if cfg.gated else act(h)
      y[t] += weights[t, c] * (h @ p["w_out"][e])
  return y, int((~keep).sum()), counts
