"""The ``model`` config section's one check: the source, its weights, the preset and the memory bound.

The config runs it before any work starts (a bad value is one line naming the key); for ``model.source=hf`` it
looks for the model's folder and its ``config.json``, and loads nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from noloco.models.llama import PRESETS

SOURCES = ("noloco", "hf")


def check_model_settings(model: Mapping) -> None:
    """ValueError, naming the key, for the first value of ``model`` (the config's ``model`` section) refused."""

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise ValueError(message)

    require(model["source"] in SOURCES, f"model.source={model['source']!r} is not one of {', '.join(SOURCES)}")
    weights = model["hf_weights"]
    require(weights in ("auto", True, False), f"model.hf_weights must be auto, true or false, got {weights!r}")
    if model["source"] == "hf":
        from noloco.models.hf import model_folder

        model_folder(model["hf_path"])  # ModelError (a ValueError): no folder, or no config.json in it
    limit = model["max_memory_gb"]
    number = isinstance(limit, (int, float)) and not isinstance(limit, bool)
    require(limit == "auto" or (number and 0 < limit < math.inf),
            f"model.max_memory_gb must be auto or a number of GB > 0, got {limit!r}")  # fmt: skip
    require(model["preset"] in PRESETS, f"model.preset={model['preset']!r} is not one of {sorted(PRESETS)}")
