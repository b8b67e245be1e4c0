"""ExFlow (Yao et al., "Exploiting Inter-Layer Expert Affinity for Accelerating Mixture-of-Experts Model
Inference"): its headline figures and why the model does not price them.

`moejax.cost.decode` prices a decode step's exchanges from the rows a trained model's decode really moves
(experiments/exflow_traffic.py), but ExFlow reports neither its batch size, prompt and generation lengths, nor its
precision (ExFlow Sec. V-E, Fig. 10), and its Fig. 10 throughputs are normalised; its reductions of cross-GPU routing
come from the routing of its pre-trained GPT-MoE checkpoints, which this project does not have. So every line is 'not
modelled'; they stay in the table so that it lists every headline figure.
"""

from moejax.study.papers import fidelity_row

_WHY = (
  "batch size, prompt / generation lengths and precision not reported (ExFlow Sec. V-E, Fig. 10); routing of its "
  "pre-trained checkpoints not available"
)
HEADLINES = (
  ("inference throughput over DeepSpeed-MoE, MoE-16 on 8 GPUs", 2.2, "ExFlow Abstract / Fig. 10"),
  ("inference throughput over DeepSpeed-MoE, MoE-32", 1.6, "ExFlow Sec. 1 contribution 5 / Fig. 10"),
  ("Alltoall reduction, MoE-64 (fraction)", 0.67, "ExFlow Sec. 1 contribution 5"),
)


def fidelity_rows() -> list[dict]:
  return [fidelity_row("ExFlow", q, v, None, "not modelled", s, note=_WHY) for q, v, s in HEADLINES]
