"""The experiment configs: every one exposes every MoEConfig field (less those its experiment derives) and builds;
the command line sets any field, None included; unknown or misspelt fields end in an error that names them."""

import dataclasses
import importlib
import subprocess
import sys

import pytest
from absl import flags

from configs.moe_section import moe_section
from moejax.cli import define_config, define_workdir  # noqa: E402
from moejax.models.config import MOE_FROM_MODEL
from moejax.moe.config import MoEConfig
from moejax.study import points
from moejax.train import config as train_config
from moejax.validation import ConfigError, check_against_mesh
from tests.helpers import ENV, ROOT

LAYER_FIELDS = {f.name for f in dataclasses.fields(MoEConfig)} | {"transport"}  # the old name of path and collective
# Each config file, by the experiment that reads it.
KINDS = {
  "demo": "demo",
  "mlm": "train",
  "gpt": "train",
  "generate": "train",
  "moe_preset": "train",
  "decoder": "family",
  "exflow_traffic": "train",
  "record_traces": "train",
  "scaling_default": "scaling",
  "scaling_smile": "scaling",
  "scaling_measured_cpu": "scaling",
  "scaling_schedules": "scaling",
  "scaling_presets": "scaling",
}
EXPECTED = {
  "demo": LAYER_FIELDS,
  "train": LAYER_FIELDS - set(MOE_FROM_MODEL),
  "family": LAYER_FIELDS - {"d_model"},
  "scaling": LAYER_FIELDS - set(points.SCHEME_FIELDS) | set(points.SWEEP_FIELDS),
}


def get_config(spec: str):
  name, _, arg = spec.partition(":")
  return importlib.import_module(f"configs.{name}").get_config(*([arg] if arg else []))


def build(spec: str, config):
  """What the experiment makes of the config before it touches a device."""
  kind = KINDS[spec.partition(":")[0]]
  if kind == "demo":  # experiments/demo.py's validate
    moe = MoEConfig.from_mapping(config.moe.to_dict(), prefix="moe.")
    check_against_mesh(moe, config.mesh.nodes, config.mesh.gpus_per_node)
    return moe
  if kind in ("train", "family"):
    return train_config.validate(train_config.training_config(config))[1]
  return points.validate(config)


def parse(overrides, monkeypatch, config_file="demo.py", explicit=False):
  """The config an experiment gets from `config_file` (its default, or given as --config) and these overrides."""
  path = str(ROOT / "configs" / config_file)
  argv = ["experiment", *([f"--config={path}"] if explicit else []), *overrides]
  monkeypatch.setattr("sys.argv", argv)  # config_flags reads the overrides from sys.argv
  flag_values = flags.FlagValues()
  holder = define_config(path, "Experiment config file.", flag_values=flag_values)
  flag_values(argv)
  return holder.value


# Config files of the other programs (no sweep or training reads them), each checked by its program's tests.
PROGRAM_CONFIGS = {
  "bench_kernels",
  "tune_kernels",
  "bench_collectives",
  "expert_table",
  "gpu_suite",
  "hf_load",
  "lina_replication",
  "family_remedies",
  "fine_grained",
  "exchange_memory",
  "wire_traffic",
  "compare_sweeps",
  "plot_run",
  "convergence_report",
  "fidelity",
  "validate_cost_model",
  "memory",
  "compile_time",
  "export",
  "pipeline_bubbles",
  "pipeline_cost",
  "validate_program_price",
  "collective_chains",
  "one_host_layer",
  "price_runs",
}


def test_every_config_file_is_checked():
  # convergence.py configures a study whose runs are overrides of gpt.py and mlm.py (test_convergence builds each).
  files = {p.stem for p in (ROOT / "configs").glob("*.py")} - {"__init__", "moe_section", "training", "convergence"}
  assert files == set(KINDS) | PROGRAM_CONFIGS, files ^ (set(KINDS) | PROGRAM_CONFIGS)


DECODERS = [
  f"decoder:{family}{size}"
  for family in ("qwen3_moe", "deepseek_v3", "deepseek_v2", "qwen2_moe", "mixtral")
  for size in ("", ",published")
]


@pytest.mark.parametrize(
  "spec", [*KINDS, "mlm:3.7b", "scaling_presets:qwen3_moe", "scaling_presets:mixtral_8x7b", *DECODERS]
)
def test_configs_expose_every_moe_field_and_build(spec):
  config = get_config(spec)
  assert set(config.moe) == EXPECTED[KINDS[spec.partition(":")[0]]]
  build(spec, config)


def test_dropless_is_none_and_none_comes_from_the_command_line(monkeypatch):
  assert get_config("generate").moe.capacity_factor is None
  config = parse(
    ["--config.moe.capacity_factor=None", "--config.moe.buffer_factor=1.5", "--config.moe.load_balance_coef=0.02"],
    monkeypatch,
    "mlm.py",
  )
  moe = build("mlm", config)
  assert (moe.capacity_factor, moe.buffer_factor, moe.load_balance_coef) == (None, 1.5, 0.02)
  config = parse(["--config.moe.esp_schedule=None", "--config.moe.capacity_factor=1.25"], monkeypatch)
  assert (config.moe.esp_schedule, config.moe.capacity_factor) == (None, 1.25)  # not the string 'None'
  config = parse(["--config.moe.capacity_factor=0"], monkeypatch, "generate.py")
  with pytest.raises(ConfigError, match=r"moe\.capacity_factor=0 .*None \(dropless\)"):
    build("generate", config)


def test_demo_takes_schedule_from_the_command_line(monkeypatch):
  config = parse(["--config.moe.schedule=comet", "--config.moe.num_chunks=2", "--config.steps=1"], monkeypatch)
  moe = build("demo", config)
  assert (moe.schedule, moe.num_chunks, config.steps) == ("comet", 2, 1)


@pytest.mark.parametrize("explicit", [False, True])
def test_misspelt_override_names_the_field(monkeypatch, explicit):
  if explicit:  # --config given: the overrides are checked while app.run parses the flags
    with pytest.raises(flags.IllegalFlagValueError) as error:
      parse(["--config.moe.schedul=comet"], monkeypatch, explicit=True)
    message = str(error.value)
  else:  # the default file: checked when the flag is defined, at import
    with pytest.raises(SystemExit) as error:
      parse(["--config.moe.schedul=comet"], monkeypatch)
    message = str(error.value.code)
  assert "unknown config field moe.schedul (did you mean moe.schedule?)" in message
  with pytest.raises((SystemExit, flags.IllegalFlagValueError), match=r"mo\.top_k \(did you mean moe\?\)"):
    parse(["--config.mo.top_k=1"], monkeypatch, explicit=explicit)


def test_misspelt_override_on_the_command_line_is_one_error_line():
  run = subprocess.run(
    [sys.executable, "-m", "experiments.demo", "--config.moe.schedul=comet"],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert run.returncode == 1
  assert "unknown config field moe.schedul (did you mean moe.schedule?)" in run.stderr
  assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
  "value", ["switch,smile", "switch, smile", "(switch,smile)", "('switch', 'smile')", "[switch,smile]"]
)
def test_a_tuple_field_takes_its_elements_separated_by_commas(monkeypatch, value):
  config = parse(
    [f"--config.schemes={value}", "--config.nodes=1,2", "--config.gpus_per_node=8,"], monkeypatch, "scaling_default.py"
  )
  assert (config.schemes, config.nodes, config.gpus_per_node) == (("switch", "smile"), (1, 2), (8,))
  config = parse(["--config.model.moe_layers=true,False"], monkeypatch, "decoder.py")
  assert config.model.moe_layers == (True, False)
  config = parse(["--config.nodes=(2,)", "--config.scalings="], monkeypatch, "scaling_smile.py", explicit=True)
  assert (config.nodes, config.scalings) == ((2,), ())


def test_a_tuple_field_reads_elements_as_its_default_holds_them(monkeypatch, tmp_path):
  (tmp_path / "tuples.py").write_text(
    "import ml_collections\n\ndef get_config():\n"
    "  return ml_collections.ConfigDict({'rates': (0.5,), 'names': ('a',), 'empty': (), 'mixed': (1, 'a')})\n"
  )
  config = parse(
    ["--config.rates=1,2.5", "--config.names=1,2", "--config.empty=3,x", "--config.mixed=2,'b',c"],
    monkeypatch,
    tmp_path / "tuples.py",
  )
  assert (config.rates, config.names, config.empty, config.mixed) == (
    (1.0, 2.5),
    ("1", "2"),
    ("3", "x"),
    ("2", "b", "c"),
  )
  assert [type(x) for x in config.rates] == [float, float]


@pytest.mark.parametrize(
  "override, message",
  [
    (
      "--config.nodes=1,a",
      "config field nodes takes integers separated by commas, e.g. --config.nodes=1,2,4 (got 'a')",
    ),
    ("--config.nodes=1.5", "(got '1.5')"),
    (
      "--config.model.moe_layers=true,yes",
      "config field model.moe_layers takes booleans (true or false) separated "
      "by commas, e.g. --config.model.moe_layers=true,true,true (got 'yes')",
    ),
  ],
)
def test_a_bad_tuple_element_names_the_field_and_the_form(monkeypatch, override, message):
  config_file = "decoder.py" if "moe_layers" in override else "scaling_default.py"
  with pytest.raises(flags.IllegalFlagValueError) as error:
    parse([override], monkeypatch, config_file)
  assert message in str(error.value)


@pytest.mark.slow
def test_a_bad_tuple_on_the_command_line_is_one_error_line(tmp_path):
  run = subprocess.run(
    [sys.executable, "-m", "experiments.scaling", f"--workdir={tmp_path}", "--config.nodes=1,a"],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert run.returncode == 1
  assert run.stderr.strip().splitlines() == [
    "error: flag --config.nodes=1,a: config field nodes takes integers separated by commas, e.g. "
    "--config.nodes=1,2,4 (got 'a')"
  ]


@pytest.mark.parametrize("required", [True, False])
def test_workdir_is_the_one_other_flag(required):
  flag_values = flags.FlagValues()
  workdir = define_workdir("Where it writes.", required=required, flag_values=flag_values)
  flag_values(["program", "--workdir=/tmp/w"])
  assert workdir.value == "/tmp/w"
  flag_values = flags.FlagValues()
  workdir = define_workdir("Where it writes.", required=required, flag_values=flag_values)
  if required:
    with pytest.raises(flags.IllegalFlagValueError, match="workdir"):
      flag_values(["program"])
  else:
    flag_values(["program"])
    assert workdir.value is None


@pytest.mark.parametrize("spec", ["demo", "mlm", "scaling_default"])
def test_unknown_moe_field_in_a_config_is_named(spec):
  config = get_config(spec)
  config.moe.top_kk = 1
  with pytest.raises(ConfigError, match=r"^unknown config field moe\.top_kk \(did you mean moe\.top_k\?\)$"):
    build(spec, config)


def test_scheme_fields_are_not_sweep_fields():
  config = get_config("scaling_default")
  config.moe.routing = "bilevel"
  with pytest.raises(ConfigError, match="moe.routing='bilevel' .*each scheme sets it"):
    build("scaling_default", config)


def test_moe_section_rejects_unknown_missing_and_derived_fields():
  with pytest.raises(ConfigError, match=r"^unknown config field moe\.schedul \(did you mean moe\.schedule\?\)$"):
    moe_section(num_experts=8, top_k=1, d_model=8, d_ff=8, schedul="comet")
  with pytest.raises(ConfigError, match="moe.num_experts is missing"):
    moe_section(top_k=1, d_model=8, d_ff=8)
  with pytest.raises(ConfigError, match="moe.d_model=8 .*derives it"):
    moe_section(omit=("d_model",), num_experts=8, top_k=1, d_model=8, d_ff=8)
