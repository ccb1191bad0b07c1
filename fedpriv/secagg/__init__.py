"""Secure aggregation (``aggregation = "secure"``): nodes mask their noisy shares so the server
learns only their sum. ``fedpriv.secagg.crypto``: primitives and masks; ``fedpriv.secagg.node``:
a node's plan check and stages; ``fedpriv.server.secagg``: the server's side."""
