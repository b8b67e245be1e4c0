"""Studies: scaling sweeps over meshes and schemes (the scheme table in `schemes`), their reports, measured phase
timing, the routers' convergence report (`convergence`) and the cost model against published papers (`papers`)."""
