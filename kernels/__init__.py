"""Pallas expert kernels, imported as `moejax.kernels`."""
