"""Training the lab's model: the step, the loop around it, and what it measures.

`step` builds one jitted training step for a `Layout` (the strategy's rules on
the mesh); `run` is the loop of `lab train` (progress, log, checkpoints, the
page); `data` the synthetic input pipeline (latency, jitter, prefetch);
`checkpoint` orbax saves and restores that any mesh can read; `series` reads a
step-time series (periodic, random, trend); `profiling` joins a
`jax.profiler` trace to the compiled HLO.
"""
