"""The plugin author kit: fixtures, fake distributions and conformance suites.

Subclass a conformance suite in your plugin's tests to check it honours the contract::

    from specforge_core.testing import FeatureStoreConformance

    class TestMyStore(FeatureStoreConformance):
        def make_store(self, tmp_path):
            return MyStore(MyOptions(), BuildContext(run_id="t"))

The fixtures ``fake_site`` and ``plugin_manager`` are registered with pytest
automatically when specforge-core is installed.
"""

from .control_plane_suite import ControlPlaneConformance
from .distributions import FakeSite
from .feature_store_suite import FeatureStoreConformance

__all__ = ["ControlPlaneConformance", "FakeSite", "FeatureStoreConformance"]
