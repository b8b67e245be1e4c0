"""Where the layer runs: the ('node', 'gpu') mesh, multi-process start-up and the local launcher."""
