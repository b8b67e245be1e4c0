"""A program of a 2-process job whose process 0 meets a ConfigError after the job has started (as the trainer's
workdir check can, when the processes see the workdir differently) while process 1 waits in a collective for it:
`moejax.cli.run`'s one error line, and the job stopped without process 1's collective timing out."""

from moejax import cli
from moejax.runtime import distributed
from moejax.validation import ConfigError


def main(argv):
  del argv
  distributed.initialize()
  import jax
  from jax.experimental import multihost_utils

  if jax.process_index() == 0:
    raise ConfigError("--workdir=/x: refused on process 0 only", "workdir", "/x")
  multihost_utils.process_allgather(jax.numpy.ones(1))  # waits for process 0, which never comes
  print("RESULT process 1 passed the collective", flush=True)


if __name__ == "__main__":
  cli.run(main)
