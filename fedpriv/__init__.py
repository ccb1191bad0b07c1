"""fedpriv: federated learning with user-level differential privacy and model personalization.

The core (this package) is pure NumPy and never imports Flower; ``clients/`` and ``strategies/``
wrap it in a Flower ClientApp and ServerApp.
"""

import os

# OpenMP threads (torch's) that wait by sleeping, not spinning: on a machine whose cores are
# busy with other work, spinning threads of a 2-thread torch ran a deep run 1.4-1.6x slower
# than one thread (5x in a review); sleeping ones ran it as fast as one thread. Read when torch
# loads OpenMP, so it is set here, before any of fedpriv imports torch; a value the user set
# (OMP_WAIT_POLICY=ACTIVE on a machine of one's own: ~10% faster when idle) is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
