"""Deprecated location of the library face: import from :mod:`noloco.optim` instead.

``from noloco.train.algorithms import NoLoCo`` keeps working for one release (0.2) and warns once;
``from noloco.optim import NoLoCo, DiLoCo, DDP, PeriodicAveraging`` is the supported path.
"""

import warnings

from noloco.optim import algorithms as _algorithms

warnings.warn(
    "noloco.train.algorithms is deprecated: import NoLoCo, DiLoCo, DDP and PeriodicAveraging from noloco.optim",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str):
    """Every public name of :mod:`noloco.optim.algorithms`, under its old module."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_algorithms, name)
