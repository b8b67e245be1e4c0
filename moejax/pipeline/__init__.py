"""Pipeline parallelism: schedules as objects and timetables (`schedules`: one `Schedule` per pipeline.schedule, its
slots in `orders`; `timetable`: their times from the dependencies, the bubble counted from them), their price
(`cost`), what they keep in flight (`memory`), and a pipelined loss and gradient run from a timetable (`ticks`,
`step`; the decoder's stages in `staging`, `decoder`)."""
