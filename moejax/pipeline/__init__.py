"""Pipeline parallelism: schedules as timetables (`schedules`: each device's slots in order; `timetable`: their times
from the dependencies, the bubble counted from them), their price (`cost`), what they keep in flight (`memory`), and
a pipelined loss and gradient run from a timetable (`step`)."""
