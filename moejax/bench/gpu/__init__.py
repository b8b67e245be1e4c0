"""The GPU benchmark suite's steps (experiments/gpu_suite.py runs one per process): `record` (<workdir>/<step>.json and
what every step shares), `shapes` (the models timed), then one module per step: `env`, `ceilings`, `kernels_step`,
`layer`, `chunking`, `train_step`, `attention`, `decoder_step`, `compile_time`, each with its
`step_<name>(config, rec)` (config: configs/gpu_suite.py's)."""
