"""Pipeline parallelism: schedules as timetables (`schedules`: each device's slots in order; `timetable`: their times
from the dependencies, the bubble counted from them), their price (`cost`) and what they keep in flight (`memory`)."""
