"""The plugin author kit: fixtures, fake distributions and conformance suites.

Subclass a conformance suite in your plugin's tests to check it honours the contract::

    from specforge_core.testing import FeatureStoreConformance

    class TestMyStore(FeatureStoreConformance):
        def make_store(self, tmp_path):
            return MyStore(MyOptions(), BuildContext(run_id="t"))

The fixtures ``fake_site`` and ``plugin_manager`` are registered with pytest
automatically when specforge-core is installed. The suites are imported on first use, so
importing this package (as pytest does for the fixtures) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from .distributions import FakeSite

_LAZY = {
    "FeatureStoreConformance": ".feature_store_suite",
    "ControlPlaneConformance": ".control_plane_suite",
    "TargetEngineConformance": ".target_engine_suite",
    "StrategyConformance": ".strategy_suite",
    "ReferenceTarget": ".reference_target",
    "run_specforge": ".cli",
    "install_crash_hook": ".cli",
}

__all__ = ["ControlPlaneConformance", "FakeSite", "FeatureStoreConformance", "ReferenceTarget", "StrategyConformance",
           "TargetEngineConformance", "install_crash_hook", "run_specforge"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
