"""Bad input gets one clear line naming the value and the fix, before anything is compiled (issue 61): a data file
with no documents, a workdir that is a file, --config given twice, and a moe.num_nodes that is not the mesh's."""

import subprocess
import sys

import pytest
from absl import flags

from configs import mlm
from moejax import cli, workdir_guard
from moejax.data import corpus, sources
from moejax.models.config import from_sections
from moejax.validation import ConfigError
from tests.helpers import ROOT, cpu_env


def _last_error(*args) -> str:
  """The one line a program's refusal ends in (exit status 1, no traceback)."""
  done = subprocess.run(
    [sys.executable, "-m", *map(str, args)], cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=60
  )
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and done.stderr.strip().splitlines()[-1] == errors[0], done.stderr[-2000:]
  return errors[0]


NO_DOCUMENTS = {
  "empty.jsonl": ("", "is empty"),
  "plain.jsonl": ("some text\nnot JSON at all\n", "has 2 record(s), none with a non-blank string text"),
  "blank.json": ('{"text": "  "}\n{"url": "x"}\n\n', "has 3 record(s), none with a non-blank string text"),
}


@pytest.mark.parametrize("name", sorted(NO_DOCUMENTS))
def test_a_data_file_without_documents_is_refused_naming_it(tmp_path, name):
  """Before this, the file passed the cheap checks and the tokenizer failed in SentencePiece (`RuntimeError ...
  !sentences_.empty()`)."""
  good, bad = tmp_path / "good.jsonl", tmp_path / name
  good.write_text('{"text": "a document"}\n')
  bad.write_text(NO_DOCUMENTS[name][0])
  sources.check_files([str(good)])
  with pytest.raises(ConfigError) as error:
    sources.check_files([str(good), str(bad)])
  assert str(error.value).startswith(f"data file {bad} {NO_DOCUMENTS[name][1]}: give C4-style JSON lines")
  assert "\n" not in str(error.value) and error.value.field == "data.train_files"


def test_the_tokenizer_refuses_a_corpus_without_documents(tmp_path):
  """A program that trains a tokenizer without the files' checks (inference, traces) gets a line, not
  SentencePiece's RuntimeError."""
  (tmp_path / "empty.jsonl").write_text("")
  config = mlm.get_config()
  with pytest.raises(ConfigError, match=r"^config field data.train_files='.*empty.jsonl' is not allowed: files"):
    corpus.load_tokenizer(config, [str(tmp_path / "empty.jsonl")], str(tmp_path / "cache"))


def _workdir_flag(argv):
  values = flags.FlagValues()
  cli.define_workdir("a workdir", flag_values=values)
  return values(["program", *argv])


def test_a_workdir_that_is_a_file_is_refused_as_the_flag_is_parsed(tmp_path):
  """cli.define_workdir (every program's --workdir) and workdir_guard (a workdir given as the argument): one line,
  never os.makedirs' FileExistsError."""
  afile = tmp_path / "results.json"
  afile.write_text("{}")
  reason = "an existing file, not a directory: name a new or existing directory"
  with pytest.raises(flags.IllegalFlagValueError, match=f"^flag --workdir={afile}: {reason}$"):
    _workdir_flag([f"--workdir={afile}"])
  with pytest.raises(flags.IllegalFlagValueError, match=f"^flag --workdir={afile}/run: {afile} is {reason}$"):
    _workdir_flag([f"--workdir={afile}/run"])
  _workdir_flag([f"--workdir={tmp_path}/new/run"])  # a directory still to make is fine
  with pytest.raises(ConfigError, match=f"^--workdir={afile}: {reason}$"):
    workdir_guard.claim(str(afile), "experiments.fidelity")
  assert afile.read_text() == "{}"


@pytest.mark.slow
def test_programs_refuse_a_workdir_that_is_a_file_in_one_line(tmp_path):
  afile = tmp_path / "afile"
  afile.write_text("")
  reason = "an existing file, not a directory: name a new or existing directory"
  assert _last_error("experiments.exchange_memory", f"--workdir={afile}") == f"error: flag --workdir={afile}: {reason}"
  assert _last_error("experiments.plot_run", afile) == f"error: --workdir={afile}: {reason}"


def test_config_given_twice_is_one_line_saying_so(tmp_path):
  """Before this: absl's `The flag 'config.nodes' is defined twice. First from absl.flags._flag, ...`."""
  line = _last_error(
    "experiments.exchange_memory",
    "--config=configs/exchange_memory.py",
    "--config=configs/exchange_memory.py",
    "--config.nodes=2",
    f"--workdir={tmp_path}",
  )
  assert line == (
    "error: --config was given twice (--config=configs/exchange_memory.py, --config=configs/exchange_memory.py): "
    "give it once, set fields with --config.FIELD=VALUE"
  )
  assert list(tmp_path.iterdir()) == []


def test_num_nodes_with_flat_routing_is_recorded_as_the_meshs_node_count():
  """topk reads no node count, but a run records moe.num_nodes: a stale copy (mesh.nodes changed alone) was accepted
  and recorded as 2 nodes on a 1-node mesh. It now becomes the mesh's count, in the config a run records; a routing
  that chooses nodes still refuses a count other than the mesh's."""
  config = mlm.get_config()
  config.mesh.nodes = 1
  assert config.moe.routing == "topk" and config.moe.num_nodes == 2
  _, moe_cfg = from_sections(config)
  assert moe_cfg.num_nodes == 1 and config.moe.num_nodes == 1
  config.moe.update(routing="bilevel", num_nodes=2)
  with pytest.raises(ConfigError, match=r"num_nodes=2 is not allowed: the mesh's node count 1"):
    from_sections(config)


def test_a_trainer_with_more_token_ids_than_embedding_rows_is_refused(devices):
  """A Trainer built in Python (a notebook) from token ids past the model's vocabulary: refused naming
  model.vocab_size and the ids, before anything compiles (those ids would read no embedding row: a NaN loss)."""
  from configs import decoder
  from moejax.runtime import mesh as mesh_lib
  from moejax.train import config as config_lib
  from moejax.train import objective
  from moejax.train import trainer as train

  config = decoder.get_config("qwen3_moe")
  tok = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=298, num_ids=300)
  with pytest.raises(ConfigError, match=r"model.vocab_size=256 .*at least the tokenizer's 300 ids"):
    train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(2, 4), tok)
