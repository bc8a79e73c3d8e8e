"""Strategy plugins: filters narrow the backends, scorers give each a score in [0,1], a picker
chooses, a profile handler decides the stages (aggregated, or prefill then decode).

Every plugin is a small pure object built by the registry from ``type`` + ``parameters``
(a pydantic model per type). Plugins read snapshots (``BackendState``, ``Ctx``) and never do I/O.
Importing this package registers the built-in plugins.
"""

from router.plugins.base import REGISTRY, Ctx, Plugin, build_plugin, plugin_types
from router.plugins import filters, handlers, pickers, scorers  # noqa: F401  (register built-ins)

__all__ = ["REGISTRY", "Ctx", "Plugin", "build_plugin", "plugin_types"]
