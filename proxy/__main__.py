"""`python -m proxy --config config.yaml`."""

import sys

from proxy.cli import main

sys.exit(main())
