"""The one place that imports mxnet.

``mxnet.model`` imports scikit-learn when it is installed (for an estimator base class the
pipeline never uses), which adds seconds to every role start-up and so to recovery time. Marking
sklearn as absent before the first mxnet import avoids that; it must run before anything else in
the process imports mxnet.
"""
from __future__ import annotations

import sys
from types import ModuleType


def import_mxnet() -> ModuleType:
    if "mxnet" not in sys.modules and "sklearn" not in sys.modules:
        sys.modules["sklearn"] = None  # type: ignore[assignment]
        try:
            import mxnet
        finally:
            del sys.modules["sklearn"]
        return mxnet
    import mxnet

    return mxnet
