"""Pipeline parallelism over the `stage` axis.

`schedules` holds the schedules as data (GPipe, 1F1B, interleaved, zero
bubble) and their simulator; `spmd` the GPipe loop `lab train` runs (one SPMD
program, a permute per tick); `loop` executes any schedule by hand; `stages`
splits a model into stages; `timing` times stages on emulated devices;
`render` draws a schedule as a grid, a trace or a figure.
"""
