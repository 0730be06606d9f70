"""The explanation of a user's program: load it, compile it, and say what it communicates and why.

    program   ``FILE.py:NAME`` or ``package.module:NAME``: load the user's builder and call it with a mesh
      |
    explain   every collective of the compiled program: its line, its reason, its cost (`Explanation`)

``lab inspect --fn`` and ``lab.explain`` are the two ways in; the modules are
imported by their own names (``from lab.explanation.explain import explain``).
"""
