"""The postgres control plane passes the whole ControlPlaneConformance suite against a real server."""

from __future__ import annotations

import pytest

from specforge_core.testing.control_plane_suite import ControlPlaneConformance

from specforge_plugin_postgres.testing import open_plane, schema_of


class TestPostgresControlPlane(ControlPlaneConformance):
    dedups, durable, cross_process = True, True, True

    @pytest.fixture(autouse=True)
    def _server(self, postgres):
        self.server = postgres

    def make_control_plane(self, tmp_path, role="colocated", **channel_options):
        return open_plane(self.server, schema_of(tmp_path), role=role, **channel_options)
