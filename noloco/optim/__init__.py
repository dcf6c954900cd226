"""Outer optimizers: pure tensor math of the outer step (DESIGN §3.1)."""

from noloco.optim.base import OuterRule
from noloco.optim.diloco import AveragingRule, DiLoCoRule
from noloco.optim.noloco import NoLoCoRule

__all__ = ["AveragingRule", "DiLoCoRule", "NoLoCoRule", "OuterRule"]
