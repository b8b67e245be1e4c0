"""Errors on a bad flag or config path: one line on stderr naming the field or file, no traceback, fields named
as the config spells them (moe.<field>, mesh.<field>), misspelt fields with their nearest matches only."""

import dataclasses
import subprocess
import sys

import pytest

from configs import demo, mlm
from moejax.models.config import from_sections
from moejax.moe.config import MoEConfig
from moejax.train import config as train_config
from moejax.validation import ConfigError, check_against_mesh, prefixed, unknown_field_message
from tests.helpers import ENV, ROOT

WORKDIR = "--workdir=/nonexistent/never_written"  # every case fails before the workdir is touched


def last_line(module: str, *args: str) -> str:
  """The last non-empty stderr line of `python -m experiments.<module> args`, which must fail without a
  traceback."""
  run = subprocess.run(
    [sys.executable, "-m", f"experiments.{module}", *args],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert run.returncode != 0, run.stdout
  assert "Traceback" not in run.stderr, run.stderr
  lines = [line for line in run.stderr.splitlines() if line.strip()]
  assert lines and lines[-1].startswith("error: "), run.stderr
  return lines[-1]


@pytest.mark.parametrize("module", ["demo", "scaling", "train", "generate"])
@pytest.mark.sampled(1)
def test_missing_config_file_is_one_line_naming_it(module):
  line = last_line(module, "--config=configs/nope.py", WORKDIR)
  assert "config file configs/nope.py does not exist" in line


@pytest.mark.slow
def test_config_argument_error_is_one_line_with_its_message():
  line = last_line("train", "--config=configs/mlm.py:huge", WORKDIR)
  assert "configs/mlm.py:huge" in line and "unknown size 'huge'; choose tiny or one of" in line


def test_broken_config_file_is_one_line_naming_its_line(tmp_path):
  path = tmp_path / "broken.py"
  path.write_text("def get_config():\n  return undefined_name\n")
  line = last_line("demo", f"--config={path}")
  assert f"config file {path} could not be loaded (line 2): NameError: name 'undefined_name'" in line


@pytest.mark.parametrize("explicit", [False, True])
def test_misspelt_field_lists_the_nearest_matches_only(explicit):
  args = ["--config=configs/demo.py"] if explicit else []
  line = last_line("demo", *args, "--config.moe.tranport=ragged")
  assert line.endswith("unknown config field moe.tranport (did you mean moe.transport?)")
  assert "routing" not in line  # not the whole section


@pytest.mark.slow
def test_every_program_names_a_moe_field_with_its_section(tmp_path):
  """The demo's layer checks used to name MoEConfig's field (`collective='ragged'`), the trainer the config's."""
  lines = {
    module: last_line(module, "--config.moe.collective=ragged", f"--workdir={tmp_path / module}")
    for module in ("demo", "train")
  }
  assert lines["demo"] == lines["train"], lines
  assert lines["demo"].startswith("error: config field moe.collective='ragged' is not allowed: not 'ragged' on cpu")
  assert "use moe.collective='padded'" in lines["demo"]


@pytest.mark.slow
def test_a_missing_checkpoint_directory_is_named(tmp_path):
  line = last_line("train", f"--config=configs/decoder.py:hf={tmp_path / 'none'}", WORKDIR)
  assert line.endswith(f": the checkpoint directory {tmp_path / 'none'} does not exist"), line
  assert "could not be loaded" not in line
  line = last_line("train", f"--config=configs/decoder.py:hf={tmp_path}", WORKDIR)
  assert line.endswith(f": {tmp_path} has no config.json: not a Hugging Face checkpoint directory"), line


@pytest.mark.slow
def test_scaling_global_batch_names_the_value_that_fits():
  line = last_line("scaling", "--config.gpus_per_node=(8,)", WORKDIR)
  assert "global_batch=512" in line and "mesh 4x8" in line and "--config.global_batch=1024 fits" in line


@pytest.mark.slow
def test_a_section_the_config_lacks_points_to_the_field_it_holds():
  line = last_line("scaling", "--config.mesh.gpus_per_node=(8,)", WORKDIR)
  assert line.endswith("unknown config field mesh.gpus_per_node (did you mean gpus_per_node?)")


def test_demo_never_resizes_the_mesh_from_the_moe_section():
  line = last_line(
    "demo",
    "--config.moe.routing=bilevel",
    "--config.moe.path=node_first",
    "--config.moe.top_k=1",
    "--config.moe.num_nodes=4",
  )
  assert "moe.num_nodes=4" in line and "mesh.nodes=2" in line


def test_configs_copy_the_node_count_instead_of_referencing_it():
  for config in (demo.get_config(), mlm.get_config(), mlm.get_config("3.7b")):
    assert config.moe.num_nodes == config.mesh.nodes
    config.moe.num_nodes = 4
    assert config.mesh.nodes != 4  # a reference would have resized the mesh


def test_trainer_names_both_mesh_and_moe_fields():
  config = mlm.get_config()
  config.moe.update(routing="bilevel", num_nodes=1)
  with pytest.raises(ConfigError, match=r"moe\.num_nodes=1 .*mesh\.nodes=2"):
    from_sections(config)
  config = mlm.get_config()
  config.moe.update(esp_schedule="auto", esp_cost="nowhere")
  with pytest.raises(ConfigError, match=r"^config field moe\.esp_cost: esp_cost='nowhere'") as error:
    from_sections(config)
  assert error.value.field == "moe.esp_cost"


def test_moe_errors_carry_the_prefix_once():
  cfg = MoEConfig(num_experts=6, top_k=1, d_model=8, d_ff=8)
  with pytest.raises(ConfigError, match=r"^config field moe\.num_experts=6 .*mesh\.gpus_per_node=4$"):
    check_against_mesh(cfg, 2, 4)
  with pytest.raises(ConfigError, match=r"^config field moe\.top_k=0 ") as error:
    prefixed("moe.", prefixed, "moe.", MoEConfig, num_experts=6, top_k=0, d_model=8, d_ff=8)
  assert error.value.field == "moe.top_k"


def test_from_mapping_names_unknown_fields_with_their_nearest_matches():
  fields = {"num_experts": 8, "top_k": 1, "d_model": 8, "d_ff": 8, "capacity": 1.0, "xyzzy": 1}
  with pytest.raises(ConfigError) as error:
    MoEConfig.from_mapping(fields, prefix="moe.")
  count = len(dataclasses.fields(MoEConfig)) + 1  # and transport, the old name of path and collective
  assert str(error.value) == (
    "unknown config fields moe.capacity (did you mean moe.capacity_factor?); "
    f"moe.xyzzy (no close match among the {count} fields of moe)"
  )
  assert error.value.field == "moe.capacity"


def test_unknown_field_message_keeps_only_close_matches():
  known = ["schedule", "esp_schedule", "load_balance_coef", "local_balance_coef", "top_k"]
  assert unknown_field_message(["schedul"], known, "moe.") == (
    "unknown config field moe.schedul (did you mean moe.schedule?)"
  )
  assert "moe.load_balance_coef or moe.local_balance_coef" in unknown_field_message(["balance_coef"], known, "moe.")
  assert unknown_field_message(["x"], known) == (
    "unknown config field x (no close match among the 5 fields of the config)"
  )


def test_training_sections_name_misspelt_fields_with_their_nearest_matches():
  config = mlm.get_config()
  config.optim.learning_rat = 1.0
  with pytest.raises(
    ConfigError,
    match=r"^unknown config field optim\.learning_rat \(did you mean "
    r"optim\.learning_rate\?\)$",
  ):
    train_config.checked(config)
