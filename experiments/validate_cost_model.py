"""Checks the cost models against papers' numbers, one section per paper (`SECTIONS`; config.sections picks):

  smile  moejax.cost.model against SMILE's measurements on AWS P4d nodes (Table 3, Table 1, Fig. 8);
  comet  moejax.cost.overlap: a Mixtral 8x7B layer on 8 H800 (EP 8) and 8 L20 under the sequential, chunked and
         comet schedules, against Comet's hidden-communication shares and single-layer speedups;
  parm   moejax.cost.parm: Algorithm 1's choices and the baseline / S1 / S2 times on Parm's configured layers
         (Table III) and testbeds, against Table IV and its headline speedups;
  lina   moejax.cost.contention: the backward all-to-all against the data-parallel all-reduce (default,
         naive overlap, Lina's prioritised schedule) on Lina's setting, against its Fig. 7 timeline and speedups.
Each section (moejax/study/papers/<paper>.py: the paper's numbers, its setting and the comparison) prints its
comparison and returns a JSON record; all records go to <workdir>/validate_cost_model.json. Runs from any working
directory: the repository's files are found from the repository (`moejax.study.papers.ROOT`).

  python -m experiments.validate_cost_model --workdir=/tmp/validation                  # configs/validate_cost_model.py
  python -m experiments.validate_cost_model --workdir=/tmp/validation --config.sections=parm
"""

import os

from moejax import cli, workdir_guard
from moejax.study.papers import comet, lina, parm, smile
from moejax.validation import require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "validate_cost_model.py")
RESULTS_FILE = "validate_cost_model.json"


def sections(config) -> dict:
  """Section name -> the call that prints its comparison and returns its JSON record; a new paper's check is one
  more entry."""
  return {
    "smile": smile.section,
    "comet": lambda: comet.section(config.comet_rate_json),
    "parm": parm.section,
    "lina": lina.section,
  }


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  checks = sections(config)
  unknown = sorted(set(config.sections) - set(checks))
  require(config.sections and not unknown, "sections", config.sections, f"some of {sorted(checks)}")
  require(
    not config.comet_rate_json or os.path.isfile(config.comet_rate_json),
    "comet_rate_json",
    config.comet_rate_json,
    "'' (datasheet peak x efficiency) or an existing benchmark JSON",
  )
  workdir_guard.claim(workdir, "experiments.validate_cost_model")  # before the checks: never another's workdir
  record = {}
  for name in config.sections:
    print(f"===== {name} =====")
    record[name] = checks[name]()
    print()
  cli.write_json(workdir, RESULTS_FILE, record)


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/validate_cost_model.py).")
  _WORKDIR = cli.define_workdir(f"Directory for {RESULTS_FILE}.")
  cli.run(main)
