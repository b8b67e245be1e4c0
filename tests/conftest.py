"""Shared fixtures: every test process sees 8 simulated CPU devices (2 nodes x 4 GPUs at most)."""

import os
import re
import subprocess
import sys

# Tests compile hundreds of small programs and run each once: XLA's CPU backend optimisations and fusion
# emitters cost more compile time than they save at run time (the suite takes half as long without them).
# One LLVM module per program, compiled on the calling thread (as fast here): two cold runs of 2026-11-28 each lost a
# worker to a segfault inside XLA's compile (and serialise) of a program, which parallel codegen may race in.
FAST_COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_cpu_use_fusion_emitters=false",
  "--xla_cpu_parallel_codegen_split_count=1",
)


def known_xla_flags(flags) -> list[str]:
  """The `flags` this jaxlib's XLA accepts. XLA aborts the process on an unknown flag, and the fusion
  emitters' flag is gone from jaxlib 0.11.1 on, so they are tried in a subprocess that starts the backend: all at
  once, then each alone if that fails."""

  def accepted(tried):
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env={**os.environ, "XLA_FLAGS": " ".join(tried)}, capture_output=True).returncode == 0

  flags = list(flags)
  return flags if accepted(flags) else [flag for flag in flags if accepted([flag])]


# Set before JAX starts its backend. Probed once per session: xdist workers and the subprocesses tests
# start inherit the environment.
if "MOEJAX_TEST_XLA_FLAGS" not in os.environ:
  os.environ["MOEJAX_TEST_XLA_FLAGS"] = " ".join(known_xla_flags(FAST_COMPILE_FLAGS))
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {os.environ['MOEJAX_TEST_XLA_FLAGS']}".strip()

# XLA's persistent compilation cache, shared by the xdist workers, the subprocesses tests start (but for the processes
# of a local multi-process job: moejax.runtime.distributed.initialize turns it off there) and later runs: many
# tests build the same small programs (the same layer at the same shapes) and each would compile them again. Keyed by
# the program, jax's version and the flags, so a stale entry is never used.
# A folder given in JAX_COMPILATION_CACHE_DIR is used instead, still for every program (jax's defaults keep only those
# that took a second or more to compile).
# Only where this jaxlib runs what it loads (moejax.runtime.compile_cache: with jaxlib 0.10.2, the newest on Python
# 3.11, training steps loaded from the cache deadlocked, and CI's end-to-end tier lost its workers).
from moejax.runtime import compile_cache  # noqa: E402 (imports no jax)

if "JAX_COMPILATION_CACHE_DIR" not in os.environ and compile_cache.safe():
  import tempfile  # noqa: E402

  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"moejax-tests-xla-cache-{os.getuid()}")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# Concurrent writers are safe without a lock: an entry is compressed with a checksum, so a half-written one read by
# another worker fails to decompress and jax compiles the program instead (tests/test_compile_cache.py). (jax's own
# lock comes with a size limit, and then every write scans every entry: quadratic in the suite's thousands.)

import gc  # noqa: E402

import jax  # noqa: E402
import pytest

from moejax.runtime import mesh as mesh_lib  # noqa: E402
from tests import crash_rerun  # noqa: E402
from tests.fast_tier import mark_over_budget_slow  # noqa: E402

# crash_rerun's hooks, as this module's (a conftest below the root cannot name plugins)
pytest_handlecrashitem = crash_rerun.pytest_handlecrashitem
pytest_report_teststatus = crash_rerun.pytest_report_teststatus
pytest_sessionfinish = crash_rerun.pytest_sessionfinish
pytest_terminal_summary = crash_rerun.pytest_terminal_summary

NUM_DEVICES = 8
mesh_lib.simulate_cpu_devices(NUM_DEVICES)

# Tracing and lowering make millions of short-lived objects beside a large heap of long-lived ones (jax, flax, the
# programs kept in jax's caches); CPython's default thresholds then spend 10-15% of a test in the cycle collector.
# Collections are rarer, and what the imports made is frozen out of them.
gc.set_threshold(100_000, 50, 100)
gc.freeze()


def memory_mappings() -> tuple[int, int]:
  """(this process's memory mappings, the kernel's limit on them); (0, 0) where /proc does not say."""
  try:
    with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
      return sum(1 for _ in maps), int(limit.read())
  except OSError:
    return 0, 0


_tests_since_mappings_read = 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
  """Drops every program jax's caches keep once this worker holds a quarter of the kernel's limit on memory mappings
  at a module's end (its fixtures finalised), or half of it within a module. A compiled CPU program keeps its
  JIT-loaded code mapped for as long as it lives, and jax's caches keep them all: workers of a whole-suite run reached
  the limit (65,530 by default) and XLA's next compile failed to map memory ('LLVM compilation error: Cannot allocate
  memory'), killing the worker (the crashes of docs/testing.md). Programs a later test needs come back from the
  persistent compilation cache; clearing after every module cost the fast subset a few percent. Within a module the
  count is read every 10th test (reading 45,000 mappings takes 40 ms)."""
  global _tests_since_mappings_read
  yield
  _tests_since_mappings_read += 1
  module_ends = nextitem is None or nextitem.module is not item.module
  if not module_ends and _tests_since_mappings_read < 10:
    return
  _tests_since_mappings_read = 0
  used, limit = memory_mappings()
  if used > (limit // 4 if module_ends else limit // 2):
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def devices():
  assert jax.device_count() == NUM_DEVICES, jax.devices()
  return jax.devices()


@pytest.fixture(scope="session")
def mesh_2x4(devices):
  return mesh_lib.make_mesh(2, 4)


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
  """A directory shared by all workers of this test session, with the data cache inside."""
  base = tmp_path_factory.getbasetemp()
  path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "train-shared"
  (path / "cache").mkdir(parents=True, exist_ok=True)
  return path


# The end-to-end tier: the slow tests of these modules (learning runs: the trainer's steps over several updates, FSDP,
# pipelines and two-batch steps against their plain runs, pipelined steps' memory compiled at several stage counts,
# fine-tuning and the programs run from their command lines (the gradient sync's program, its HLO dumped);
# multi-process jobs, the GPU suite's smoke run, the notebook, whole sweeps, inference) and the slow generation runs
# of every module (a test function named for generating or decoding: greedy, sampled and ExFlow's decode against
# transformers' tokens or the full forward), a whole model's step run two ways (pipelined against the plain step,
# `..._pipelined_as_unpipelined`; scanned against unrolled layers, `..._scanned_equals_unrolled`; the chunked loss
# against the unchunked, `..._equals_the_unchunked_path`; the scanned step lowered at two depths, `..._flat_in_depth`),
# its learning runs (`..._trains_...`, an exported run), its whole command-line runs (E2E_FUNCTION) and the tests
# reading a fixture that runs a whole program (E2E_FIXTURES) are also marked `e2e`. README's test command deselects them (-m 'not e2e') to keep the suite within minutes;
# .ci/run runs them after it.
E2E_MODULES = (
  "test_bench_programs",
  "test_convergence",
  "test_decoder_training",
  "test_deepseek_v4_training",
  "test_expert_bias",
  "test_fault_kill",
  "test_fsdp",
  "test_gpu_suite",
  "test_grad_sync",
  "test_grain_resume",
  "test_heldout",
  "test_hosts",
  "test_infer",
  "test_init_from",
  "test_launch",
  "test_multiprocess_layer",
  "test_nonfinite_steps",
  "test_notebook",
  "test_pipeline_decoder",
  "test_pipeline_memory",
  "test_pipeline_processes",
  "test_pipeline_resume",
  "test_point_models",
  "test_precision",
  "test_published_configs",
  "test_readme_snippet",
  "test_record_traces",
  "test_replan",
  "test_run_config",
  "test_scaling",
  "test_train",
  "test_two_batch",
  "test_workdir_guard",
)
# generation runs (a decode through the caches, ExFlow's against the vanilla one), a fine-tuning run from the command
# line, a model's step run two ways, learning runs (a training run exported), and the programs whose command line a test
# runs whole (a study, a table and its png)
E2E_FUNCTION = re.compile(
  r"generat|decodes?_|exflow_equals|fine_tunes|pipelined_as_unpipelined|scanned_equals_unrolled"
  r"|equals_the_unchunked|flat_in_depth|trains_|exported_run|^test_command|validation_command|study_on_the"
)
# module fixtures that run a whole program once for their tests: the memory planner's plans of a 5-layer model (five
# compiles of its training step) and the wire-traffic study's quick run (16 meshes and routings)
E2E_FIXTURES = frozenset({"memory_plans", "wire_traffic_run"})


def end_to_end(item) -> bool:
  """Whether a slow test is in the end-to-end tier (above)."""
  module = item.module.__name__.rsplit(".", 1)[-1]
  return (
    module in E2E_MODULES
    or bool(E2E_FUNCTION.search(item.function.__name__))
    or not E2E_FIXTURES.isdisjoint(item.fixturenames)
  )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
  """Marks all but `n` evenly spaced cases of each `@pytest.mark.sampled(n)` test slow (so `-m 'not slow'` runs a
  sample of a matrix and the whole suite all of it), the tests over the fast tier's time budget slow
  (tests/fast_tier.py), the slow tests of E2E_MODULES e2e, and puts the `xdist_group` modules (long, one worker each)
  first, so the short tests fill in around them instead of waiting behind them at the end."""
  items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)  # stable: keeps the order inside
  by_function = {}
  for item in items:
    if item.get_closest_marker("sampled") is not None:
      by_function.setdefault(item.function, []).append(item)
  for cases in by_function.values():
    keep = cases[0].get_closest_marker("sampled").args[0]
    fast = {round(i * (len(cases) - 1) / max(keep - 1, 1)) for i in range(keep)}
    for i, item in enumerate(cases):
      if i not in fast:
        item.add_marker(pytest.mark.slow)
  mark_over_budget_slow(items)
  for item in items:
    if item.get_closest_marker("slow") is not None and end_to_end(item):
      item.add_marker(pytest.mark.e2e)
