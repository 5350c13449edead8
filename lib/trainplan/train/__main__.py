"""`python -m trainplan.train ...` (under torchrun): `trainplan.train.loop.main`."""

import sys

from trainplan.train.loop import main

sys.exit(main())
