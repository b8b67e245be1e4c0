"""Checks the cost models against papers' numbers, one section per paper (`SECTIONS`; --sections picks):

  smile  moejax.cost.model against SMILE's measurements on AWS P4d nodes (Table 3, Table 1, Fig. 8);
  comet  moejax.cost.overlap: a Mixtral 8x7B layer on 8 H800 (EP 8) and 8 L20 under the sequential, chunked and
         comet schedules, against Comet's hidden-communication shares and single-layer speedups;
  parm   moejax.cost.parm: Algorithm 1's choices and the baseline / S1 / S2 times on Parm's configured layers
         (Table III) and testbeds, against Table IV and its headline speedups;
  lina   moejax.cost.contention: the backward all-to-all against the data-parallel all-reduce (default,
         naive overlap, Lina's prioritised schedule) on Lina's setting, against its Fig. 7 timeline and speedups.
Each section (experiments/validation/<paper>.py: the paper's numbers, its setting and the comparison) prints its
comparison and returns a JSON record; all records go to --out. Runs from any working directory: the repository's
files are found from the repository (`experiments.validation.ROOT`).

  python -m experiments.validate_cost_model --out /tmp/validate_cost_model.json
  python -m experiments.validate_cost_model --out /tmp/parm.json --sections parm
"""

import json

from absl import app, flags

from experiments.validation import comet, lina, parm, smile

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Path of the JSON results file.", required=True)
flags.DEFINE_list("sections", ["smile", "comet", "parm", "lina"], "Papers to check: smile, comet, parm, lina.")
flags.DEFINE_string("comet_rate_json", str(comet.RATE_JSON),
                    "Benchmark JSON whose measured TFLOP/s prices the H800's expert GEMMs ('' = datasheet peak x "
                    "efficiency; default: the repository's H100 results).")

# Each section prints its comparison and returns its JSON record; a new paper's check is one more entry.
SECTIONS = {"smile": smile.section, "comet": lambda: comet.section(FLAGS.comet_rate_json), "parm": parm.section,
            "lina": lina.section}


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.sections) - set(SECTIONS))
  if unknown:
    raise app.UsageError(f"--sections {unknown} unknown; sections: {sorted(SECTIONS)}")
  record = {}
  for name in FLAGS.sections:
    print(f"===== {name} =====")
    record[name] = SECTIONS[name]()
    print()
  with open(FLAGS.out, "w") as f:
    json.dump(record, f, indent=1)
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
