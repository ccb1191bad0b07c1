"""The algorithms: ``base`` (the contract between an algorithm and the runtime), ``catalogue``
(the built-ins), ``shared_params`` (keys several families read), and one package per family
(``personalization``, ``meta``, ``exp_mech``) in which ``*_math.py`` files hold the batched math
over users and the other files the registered algorithms and their keys (``params.py``)."""
