"""Deprecated location of the library face: import from :mod:`noloco.optim` instead.

``from noloco.train.algorithms import NoLoCo`` keeps working for one release (0.2) and warns once;
``from noloco.optim import NoLoCo, DiLoCo, DDP, PeriodicAveraging`` is the supported path.
"""

import warnings

from noloco.optim.algorithms import (  # noqa: F401 - re-exported for old user code
    DDP,
    DEFAULT_MAX_NORM_RATIO,
    Algorithm,
    DiLoCo,
    NoLoCo,
    OuterAlgorithm,
    OuterRoundInfo,
    PeriodicAveraging,
    copy_flat_into,
)

warnings.warn(
    "noloco.train.algorithms is deprecated: import NoLoCo, DiLoCo, DDP and PeriodicAveraging from noloco.optim",
    DeprecationWarning,
    stacklevel=2,
)
