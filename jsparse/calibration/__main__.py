"""``python -m jsparse.calibration``: see :mod:`jsparse.calibration.cli`."""

from jsparse.calibration.cli import main

raise SystemExit(main())
