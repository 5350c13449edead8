"""`python -m trainplan.train ...` (under torchrun): `trainplan.train.loop.main`, its output
kept from failing the run where the launcher that reads it is gone."""

import sys

from trainplan.proctree import survive_closed_output

survive_closed_output()  # before torch: its loggers keep the sys.stderr they find

from trainplan.train.loop import main  # noqa: E402

sys.exit(main())
