"""fedpriv: federated learning with user-level differential privacy and model personalization.

The core (this package) is pure NumPy and never imports Flower; ``clients/`` and ``strategies/``
wrap it in a Flower ClientApp and ServerApp.
"""

__version__ = "0.1.0"
