"""specforge core: hookspecs, plugin manager, contracts, runtime planes and the CLI.

Importing this package is cheap on purpose: it pulls in pluggy and nothing heavy.
torch and every plugin's implementation modules are imported only when a component
is actually built.
"""

import pluggy

__version__ = "0.1.0"

#: Marker for hook implementations in plugins: ``@hookimpl def specforge_strategies(): ...``
hookimpl = pluggy.HookimplMarker("specforge")

__all__ = ["__version__", "hookimpl"]
