"""fedpriv: federated learning with user-level differential privacy and model personalization.

The core (this package) is pure NumPy and never imports Flower; ``clients/`` and ``strategies/``
wrap it in a Flower ClientApp and ServerApp.
"""

import os

# OpenMP threads (torch's) that wait by sleeping, not spinning: spinning threads slow a deep run
# down where the cores are busy with other work (docs/measurements.md). Read when torch loads
# OpenMP, so it is set here, before any of fedpriv imports torch; a value the user set (say
# OMP_WAIT_POLICY=ACTIVE on an idle machine of one's own) is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
