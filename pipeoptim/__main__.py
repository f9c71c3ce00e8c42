"""``python -m pipeoptim ...`` is the ``pipeoptim`` command."""

import sys

from pipeoptim.cli import main

sys.exit(main())
