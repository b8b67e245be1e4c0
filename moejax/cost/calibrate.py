"""Least-squares fits of latency and bandwidth terms to measured times.

`fit_terms` fits times ~ features @ coefficients, one column per cost term (messages,
bytes, a constant); `fit_latency_bandwidth` is the classic t = latency + bytes / bandwidth. Both
minimise relative residuals, since timings spanning orders of magnitude carry relative noise (an
absolute fit would let the largest sizes drown the latency), and keep the residual of every point.
A fit with as many points as terms has zero residual by construction and says nothing about the
model; only points left out of the fit test it.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Fit:
  """coefficients [K] by name; residuals_s [P] = measured - fitted; dof = P - K."""

  names: tuple[str, ...]
  coefficients: tuple[float, ...]
  residuals_s: tuple[float, ...]
  relative_residuals: tuple[float, ...]
  dof: int

  @property
  def values(self) -> dict[str, float]:
    return dict(zip(self.names, self.coefficients))

  @property
  def rms_relative(self) -> float:
    return float(np.sqrt(np.mean(np.square(self.relative_residuals))))

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), values=self.values, rms_relative=self.rms_relative)


def fit_terms(features, times, names) -> Fit:
  """Least squares of (features @ c - times) / times, features [points, terms], times [points]; raises if there
  are fewer points than terms."""
  features = np.asarray(features, np.float64)
  times = np.asarray(times, np.float64)
  points, terms = features.shape
  if len(names) != terms or times.shape != (points,):
    raise ValueError(f"features {features.shape}, times {times.shape} and {len(names)} names disagree")
  if points < terms:
    raise ValueError(f"{points} points cannot determine {terms} terms")
  if np.any(times <= 0):
    raise ValueError("times must be positive")
  weighted = features / times[:, None]
  # Unit-norm columns, so that seconds per byte and seconds per message share one conditioning.
  scale = np.linalg.norm(weighted, axis=0)
  scale[scale == 0] = 1.0
  solution, *_ = np.linalg.lstsq(weighted / scale, np.ones_like(times), rcond=None)
  coefficients = solution / scale
  residuals = times - features @ coefficients
  return Fit(
    names=tuple(names),
    coefficients=tuple(map(float, coefficients)),
    residuals_s=tuple(map(float, residuals)),
    relative_residuals=tuple(map(float, residuals / times)),
    dof=points - terms,
  )


@dataclasses.dataclass(frozen=True)
class LatencyBandwidth:
  """t = latency_s + bytes / bandwidth (bytes/s; inf when the fitted slope is not positive)."""

  latency_s: float
  bandwidth: float
  fit: Fit

  @property
  def physical(self) -> bool:
    return bool(self.latency_s >= 0 and np.isfinite(self.bandwidth))

  def as_dict(self) -> dict:
    return dict(latency_s=self.latency_s, bandwidth=self.bandwidth, physical=self.physical, fit=self.fit.as_dict())


def fit_latency_bandwidth(sizes_bytes, times_s) -> LatencyBandwidth:
  """Fits t = latency + size / bandwidth to (size, time) points."""
  sizes = np.asarray(sizes_bytes, np.float64)
  fit = fit_terms(np.stack([np.ones_like(sizes), sizes], axis=1), times_s, ("latency_s", "seconds_per_byte"))
  latency, slope = fit.coefficients
  return LatencyBandwidth(latency_s=latency, bandwidth=1.0 / slope if slope > 0 else float("inf"), fit=fit)
