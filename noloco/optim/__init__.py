"""Outer optimizers: the pure rules of the outer step, and the library face users import.

Rules (pure tensor math, docs/design.md §3.1): :class:`NoLoCoRule`, :class:`DiLoCoRule`,
:class:`AveragingRule`. The algorithms wrap a model, its inner optimizer and a transport (or group
source) and run inside anyone's loop::

    from noloco.optim import NoLoCo, DiLoCo, DDP, PeriodicAveraging
"""

from noloco.optim.algorithms import (
    ALGORITHMS,
    DDP,
    DEFAULT_MAX_NORM_RATIO,
    Algorithm,
    DiLoCo,
    NoLoCo,
    OuterAlgorithm,
    OuterRoundInfo,
    OuterState,
    PeriodicAveraging,
    slow_term_settings,
)
from noloco.optim.base import OuterRule
from noloco.optim.diloco import AveragingRule, DiLoCoRule
from noloco.optim.noloco import NoLoCoRule

__all__ = [
    "ALGORITHMS",
    "DDP",
    "DEFAULT_MAX_NORM_RATIO",
    "Algorithm",
    "AveragingRule",
    "DiLoCo",
    "DiLoCoRule",
    "NoLoCo",
    "NoLoCoRule",
    "OuterAlgorithm",
    "OuterRoundInfo",
    "OuterRule",
    "OuterState",
    "PeriodicAveraging",
    "slow_term_settings",
]
