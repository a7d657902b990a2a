"""ControlPlaneConformance: placeholder, filled by the control-plane work."""


class ControlPlaneConformance:
    """Subclass and override ``make_control_plane`` to run the control plane contract tests."""
