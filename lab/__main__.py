"""``python -m lab`` is the ``lab`` command (through `lab.entry`, which answers Ctrl-C from the first moment)."""

from lab.entry import main

raise SystemExit(main())
