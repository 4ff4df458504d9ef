"""``python -m unimp ...`` runs the ``unimp`` command (:func:`unimp.cli.main`)."""

import sys

from unimp.cli import main

sys.exit(main())
