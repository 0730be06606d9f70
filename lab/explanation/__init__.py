"""The explanation of a user's program: load it, compile it, and say what it communicates and why.

    program   ``FILE.py:NAME`` or ``package.module:NAME``: load the user's builder and call it with a mesh
      |
    explain   every collective of the compiled program: its line, its reason, its cost (`Explanation`), from
      |         what the compiler recorded of its choices:
    origins   Shardy's record of where each layout came from (`Propagation`), read at the compile;
    causes    the op or annotation that decided each collective, from that record and the op names;
    partitioner  the values XLA's partitioner gathered whole to reshard, from what it wrote to stderr

``lab inspect --fn`` and ``lab.explain`` are the two ways in; the modules are
imported by their own names (``from lab.explanation.explain import explain``).
"""
