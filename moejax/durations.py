"""A duration as a short readable string, for progress and ETA lines (a training run's metrics, a sweep's points)."""


def duration(seconds: float) -> str:
  """'42s', '3m05s' or '2h07m'."""
  seconds = max(0, round(seconds))
  if seconds < 60:
    return f"{seconds}s"
  if seconds < 3600:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
