"""Targets: the machines a program compiles and runs on, and what each of them can do.

One package for everything the lab knows about a machine, in one direction::

    hardware   chip profiles: peak FLOP/s, HBM, the links (ICI, NVLink, DCN, InfiniBand), each figure sourced
      |
    gpu        compile-only NVIDIA clusters: a target config written from the chip's public specification
    native     JAX's native side in one process: its C++ log and the aborts of a distributed run
    libtpu     libtpu's start-up flags (``LIBTPU_INIT_ARGS``), checked before any compile
      |
    devices    a target string (``cpu:8``, ``tpu:v5e:4x4``, ``gpu:h100:4x8``) -> its devices
      |
    topology   where each collective's devices sit on that machine, and what moving bytes there costs

The modules are imported by their own names (``from lab.targets.devices
import devices_for``); this file only shows the shape.
"""
