"""``results.json``: every experiment's rows plus the run's settings, one file per bench run."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phasesched.experiments.context import jsonable

__all__ = ["write_results_json"]


def write_results_json(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` as indented JSON, numpy values converted and ``nan`` written as ``null``.

    Strict JSON (no ``NaN`` literals) so any JSON reader, not only Python's, can load it.

    Returns:
        The path written.
    """
    path = Path(path)
    text = json.dumps(jsonable(payload), indent=2, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")
    return path
