"""Each compute op of a compiled program timed as a program of its own, with every device of the mesh running it at
once: a device's time for exactly that op (its shapes, fusion and layout), where the category rates of
`moejax.study.compute_calibration` time one op per category and carry its rate to every shape.

  timer = OpTimer(mesh)
  seconds = timer.op_seconds(compiled.as_text(), repeats, launch_s)   # {op name: seconds per run}
  program_price.price_measured(compiled, mesh, terms, op_seconds=seconds)

Each op's module (`moejax.cost.op_modules`) is compiled as one replica per device of the mesh (no collective: the
replicas run side by side, as the program's devices do), on arguments drawn once per module (floats uniform in
[-1, 1), integers in [0, 8): an index in bounds of any dimension of 8 or more, so a gather or scatter reads and writes
rows instead of dropping them), and timed with `interleaved_timing` after a barrier, beside an empty module (one tiny
op): an op's seconds are its module's median less the empty one's, plus `launch_s` (the launch the empty module's op
also paid). A module times once per timer: programs that share ops (a sweep's points) time them once.

A module XLA will not compile is not timed: `failed` names it and the op keeps its category's price. Reading and
compiling a module uses jaxlib's HLO text parser and PjRt's compile of a StableHLO module (`_compile`): an interface
below jax's public one, checked by tests/test_op_timing.py on the jax it runs.
"""

import logging
import re

import jax
import numpy as np
from jax._src import compiler
from jax._src.lib import xla_client
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxlib import _hlo  # pylint: disable=no-name-in-module

from moejax.cost import op_modules
from moejax.study import compute_calibration, interleaved_timing

INDEX_RANGE = 8  # integer arguments are drawn in [0, INDEX_RANGE): in bounds of any index dimension that large
EMPTY = "HloModule empty\n\nENTRY %main {\n  %x = f32[8]{0} parameter(0)\n  ROOT %y = f32[8]{0} negate(%x)\n}\n"
_PARAMETER = re.compile(r"= ([a-z]+\d*)\[([\d,]*)\]\S* parameter\((\d+)\)")
_DTYPES = {
  "pred": np.bool_, "s8": np.int8, "s16": np.int16, "s32": np.int32, "s64": np.int64, "u8": np.uint8,
  "u16": np.uint16, "u32": np.uint32, "u64": np.uint64, "f16": np.float16, "bf16": jax.numpy.bfloat16,
  "f32": np.float32, "f64": np.float64,
}  # fmt: skip


class OpTimer:
  """Times op modules on `mesh` (module docstring), each once: `seconds` {module: median seconds less the empty
  module's}, `failed` {module: why it was not timed}."""

  def __init__(self, mesh, seed: int = 0):
    self.mesh, self.rng = mesh, np.random.default_rng(seed)
    self.seconds, self.failed = {}, {}
    self.barrier = compute_calibration.barrier(mesh)

  def op_seconds(self, hlo: str, repeats: int, launch_s: float) -> dict[str, float]:
    """{op name: seconds per run} of every op of the HLO module `hlo` whose module times (module docstring)."""
    modules = op_modules.standalone_modules(hlo)
    self.time(list(op_modules.distinct(modules)), repeats)
    return {name: self.seconds[m] + launch_s for name, m in modules.items() if m in self.seconds}

  def time(self, modules: list[tuple[str, bool]], repeats: int) -> None:
    """Compiles and times those of `modules` (`op_modules.standalone_modules`' values) not timed before, with the
    empty module, in `repeats` interleaved rounds."""
    fresh = [m for m in modules if m not in self.seconds and m not in self.failed]
    if not fresh:
      return
    programs, timed = [self._program((EMPTY, False))], []
    for module in fresh:
      try:
        programs.append(self._program(module))
        timed.append(module)
      except Exception as e:  # pylint: disable=broad-except  # XLA refuses it: the op keeps its category's price
        self.failed[module] = f"{type(e).__name__}: {' / '.join(str(e).split(chr(10)))[:400]}"
    medians = interleaved_timing.medians(programs, repeats)
    for module, seconds in zip(timed, medians[1:]):
      self.seconds[module] = max(0.0, seconds - medians[0])
    if self.failed:
      example = next(iter(self.failed.values()))
      logging.info("%d op modules not timed (priced by their category), e.g. %s", len(self.failed), example)

  def _program(self, module: tuple[str, bool]):
    """(fn, args, barrier) of one module, replicated over the mesh's devices, for `interleaved_timing`."""
    text, optimise = module
    executable = _compile(text, optimise, list(self.mesh.devices.flat))
    args = [jax.device_put(a, NamedSharding(self.mesh, P())) for a in self.arguments(text)]
    return (lambda *a: executable.execute_sharded(list(a)).disassemble_into_single_device_arrays()), args, self.barrier

  def arguments(self, text: str) -> list[np.ndarray]:
    """Random host arrays for the parameters of a module's entry computation, in parameter order (module
    docstring)."""
    entry = text[text.index("ENTRY") :]
    found = sorted(_PARAMETER.findall(entry), key=lambda p: int(p[2]))
    out = []
    for dtype, dims, _ in found:
      shape, kind = tuple(int(d) for d in dims.split(",") if d), _DTYPES[dtype]
      if dtype == "pred":
        out.append(self.rng.integers(0, 2, shape).astype(bool))
      elif np.issubdtype(np.dtype(kind), np.integer):
        out.append(self.rng.integers(0, INDEX_RANGE, shape).astype(kind))
      else:
        out.append(self.rng.uniform(-1.0, 1.0, shape).astype(kind))
    return out


def _compile(text: str, optimise: bool, devices: list):
  """A loaded executable of the HLO module `text`, one replica per device of `devices`; without XLA's passes unless
  `optimise` (the module is already optimised: the op as the program runs it)."""
  proto = _hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()
  stablehlo = xla_client._xla.mlir.hlo_to_stablehlo(proto)  # pylint: disable=protected-access
  backend = devices[0].client
  options = compiler.get_compile_options(
    num_replicas=len(devices),
    num_partitions=1,
    device_assignment=np.array(devices).reshape(-1, 1),
    backend=backend,
    env_options_overrides=None if optimise else {"xla_disable_all_hlo_passes": True},
  )
  options.executable_build_options.use_spmd_partitioning = False
  return backend.compile_and_load(stablehlo, xla_client.DeviceList(tuple(devices)), options)
