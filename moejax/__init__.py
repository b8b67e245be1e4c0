"""moejax: communication-efficient Mixture-of-Experts on ('node', 'gpu') device meshes."""

import pathlib as _pathlib

# Run from a source tree (PYTHONPATH=. or an editable install), the kernels sit in the top-level
# `kernels/` folder; adding the repository root to this package's search path makes them importable
# as `moejax.kernels`, the same name an installed wheel gives them.
_source_root = _pathlib.Path(__file__).resolve().parent.parent
if not (_pathlib.Path(__file__).parent / "kernels").is_dir() and (_source_root / "kernels" / "__init__.py").is_file():
  __path__.append(str(_source_root))

__version__ = "0.1.0"
