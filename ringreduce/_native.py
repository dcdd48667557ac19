"""Loads ringreduce._C and checks it was built against the torch that is running."""

from __future__ import annotations

import torch

try:
    from ringreduce import _C  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "ringreduce's native extension is missing or failed to load "
        f"({exc}). Build it with `pip install --no-build-isolation .` in an environment that has torch."
    ) from exc

_built = _C.native_info["torch_built"]
if _built.split("+")[0] != torch.__version__.split("+")[0]:
    raise ImportError(
        f"ringreduce was built against torch {_built} but torch {torch.__version__} is running; "
        "rebuild it with `pip install --no-build-isolation --force-reinstall --no-deps .`"
    )

C = _C
