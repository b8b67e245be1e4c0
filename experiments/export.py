"""Writes a training run's parameters as a Hugging Face checkpoint: config.json and safetensors, as transformers'
from_pretrained and `moejax.models.from_hf` read them.

  python -m experiments.export --config=configs/export.py --config.run=/tmp/q --workdir=/tmp/q_hf

The run's config is its workdir's config.json (written by the trainer, `moejax.train.resume`); its newest intact
checkpoint is restored on the run's mesh (the parameters and balancing biases: `moejax.infer.load.load_trained`) and
written by `moejax.models.hf_checkpoint.to_hf`. Only the decoder families (configs/decoder.py) have a Hugging Face
form: SMILE's BERT and GPT models (configs/mlm.py, configs/gpt.py) are refused before anything is read, as is a
workdir without config.json. Files get the permissions the umask gives (`to_hf`). The
tokenizer is not written. The files are written into WORKDIR/.partial and moved into WORKDIR at the end, config.json
last: a killed export leaves no directory that looks complete, and run again it writes the same files. The workdir
is the export's own (`moejax.workdir_guard`): the run's workdir, or one
holding another program's outputs or the export of another run, is refused before anything is written.
"""

import glob
import os
import shutil

import ml_collections

from moejax import cli, run_config, workdir_guard
from moejax.runtime import distributed
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "export.py")


def training_config(run: str) -> ml_collections.ConfigDict:
  """The config the run in `run` trains with (its config.json, less the versions and history kept beside it)."""
  from moejax.train import resume

  stored = run_config.read(run) if run else None
  require(stored is not None, "run", run, f"a training workdir with the {run_config.CONFIG_FILE} the trainer writes")
  config = ml_collections.ConfigDict({k: v for k, v in stored.items() if k not in resume.META})
  require(
    "family" in config.model,
    "run",
    run,
    f"a run of a decoder family (configs/decoder.py): its model kind "
    f"{config.model.get('kind')!r} (SMILE's BERT / GPT) has no Hugging Face form",
  )
  return config


PARTIAL = ".partial"  # in the export's directory: the files being written, moved into it once all are


def export(run: str, out: str) -> int:
  """Writes the newest checkpoint of the run in `run` to `out` as a Hugging Face checkpoint; returns its step.

  The files are written into out/PARTIAL (what an earlier, killed export left there is removed first) and then
  moved into `out` one by one (os.replace), config.json last, after any config.json there was removed: a killed
  export never leaves a directory that holds both config.json and weights it did not finish (an export is known by
  those two), and run again it writes the same files."""
  import jax

  from moejax.infer import load
  from moejax.models import hf_checkpoint

  model, _, step = load.load_trained(training_config(run), run)
  partial = os.path.join(out, PARTIAL)
  writer = jax.process_index() == 0
  if writer:
    shutil.rmtree(partial, ignore_errors=True)
  hf_checkpoint.to_hf(model, partial)
  if writer:
    names = sorted(os.listdir(partial), key=lambda name: name == run_config.CONFIG_FILE)  # config.json last
    if os.path.exists(os.path.join(out, run_config.CONFIG_FILE)):
      os.remove(os.path.join(out, run_config.CONFIG_FILE))
    for name in names:
      os.replace(os.path.join(partial, name), os.path.join(out, name))
    os.rmdir(partial)
    for stale in glob.glob(os.path.join(glob.escape(out), f"{workdir_guard.MARKER}.*.tmp")):
      os.remove(stale)  # a marker's temporary left by an export killed while claiming the directory
  return step


def main(argv):
  del argv
  config = _CONFIG.value
  stored = training_config(config.run)  # refused before any device is set up
  # Never into a run's workdir (its config.json is the run's) nor over another run's export.
  workdir_guard.claim(_WORKDIR.value, workdir_guard.EXPORT, {"run": os.path.realpath(config.run)})
  if distributed.initialize() == "single":
    mesh_lib.simulate_cpu_devices(stored.mesh.nodes * stored.mesh.gpus_per_node)
  try:
    step = export(config.run, _WORKDIR.value)
  except mesh_lib.MeshError as e:
    raise ConfigError(str(e)) from e
  print(f"wrote step {step} of {config.run} to {_WORKDIR.value}: {', '.join(sorted(os.listdir(_WORKDIR.value)))}")


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/export.py).")
  _WORKDIR = cli.define_workdir("Directory for the Hugging Face checkpoint.")
  cli.run(main)
