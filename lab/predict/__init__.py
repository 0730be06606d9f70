"""Predict a training step on a TPU pod, compile-only: step time, MFU, memory, exposed communication.

spec         model presets and the ``--model`` parser
step         the training step at full size, compiled for a topology with no chips
ops          the compiled, scheduled program priced op by op; the schedule's overlap simulated
depth        a program compiled with K of a scan's L layers, read as the L-layer one (time and memory)
attention    XLA's attention in a step against a flash kernel's estimate of it
xla_estimate XLA:GPU's own cost estimate of the same ops, beside the lab's
calibration  the chip's efficiency constants and the published runs that set them
command      ``lab predict``: the options and the handler
"""
