"""Studies: scaling sweeps over meshes and schemes, their reports, and measured phase timing."""
