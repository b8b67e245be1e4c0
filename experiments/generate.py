"""Generates text with a trained GPT-style MoE decoder and reports tokens/s and exchange traffic.

  python -m experiments.generate --workdir=/tmp/gen                              # configs/generate.py
  python -m experiments.generate --workdir=/tmp/gen --config.train_dir=/tmp/gpt \\
      --config.generate.mode=vanilla --config.generate.temperature=0.8

config.train_dir: a training workdir (experiments/train.py) with the same model config; without it the
model is trained first into <workdir>/train (the config's steps; `moejax.train.trained`). Prompts are the first
tokens of corpus documents. Writes generate.json (tokens/s, rows per generated token, the texts) to --workdir.
Without GPUs the mesh is made of simulated CPU devices.
"""

import os
import sys

from moejax import cli, workdir_guard
from moejax.data import corpus as data_lib
from moejax.data.tokenizer import TokenizerError
from moejax.infer import decode, load
from moejax.runtime import distributed
from moejax.runtime import mesh as mesh_lib
from moejax.train import trained
from moejax.validation import ConfigError

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "generate.py")
_CONFIG = cli.define_config(_DEFAULT_CONFIG, "Generation config file (configs/generate.py).")
_WORKDIR = cli.define_workdir("Directory for generate.json (and the brief training run without config.train_dir).")


def run(config, workdir: str) -> dict:
  g = config.generate
  model, tok, step = trained.trained_model(config, workdir)
  cache = load.cache_dir(config, trained.run_dir(config, workdir))
  texts = data_lib.texts(data_lib.corpus_files(config.data.train_files, cache))
  prompts = load.prompts_from(texts, tok, g.batch, g.prompt_len)
  print(f"model from step {step}; generating {g.steps} tokens for {g.batch} requests ({g.mode})", flush=True)
  out = decode.generate(model, prompts, g.steps, mode=g.mode, temperature=g.temperature, seed=g.seed)
  n, m = mesh_lib.axis_sizes(model.mesh)
  result = {
    "mesh": [n, m],
    "mode": g.mode,
    "checkpoint_step": step,
    "batch": g.batch,
    "prompt_len": g.prompt_len,
    "steps": g.steps,
    "temperature": g.temperature,
    "prefill_seconds": out.prefill_seconds,
    "decode_tokens_per_second": out.tokens_per_second,
    "exchange_rows_per_token": out.exchange_rows,
    "allgather_rows_per_token": out.allgather_rows,
    "moe_layers": model.cfg.num_moe_layers,
    "lost_token_choices": out.lost_choices,
    "samples": [
      {"prompt": tok.decode(p.tolist()), "generated": tok.decode(t.tolist())}
      for p, t in zip(prompts[:4], out.tokens[:4])
    ],
  }
  cli.write_json(workdir, "generate.json", result)
  for sample in result["samples"]:
    print(f"--- {sample['prompt']!r}\n    -> {sample['generated']!r}")
  print(
    f"decode: {out.tokens_per_second:.1f} tokens/s on {n}x{m} devices; exchange rows per generated token "
    f"{out.exchange_rows}; all-gather rows per token {out.allgather_rows}",
    flush=True,
  )
  return result


def main(argv):
  del argv
  config = _CONFIG.value
  try:
    # Its file may go beside those of the run it loads (config.train_dir), else into a workdir of its own.
    workdir_guard.claim(_WORKDIR.value, "experiments.generate", beside=[config.train_dir] if config.train_dir else [])
    if distributed.initialize() == "single":
      mesh_lib.simulate_cpu_devices(config.mesh.nodes * config.mesh.gpus_per_node)
    run(config, _WORKDIR.value)
  except (ConfigError, mesh_lib.MeshError, TokenizerError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  cli.run(main)
