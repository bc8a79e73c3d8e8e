"""The composition root: the ``infernex`` CLI, settings, and the one-machine launcher.

Owns: :mod:`infernex.settings` (the one frozen settings object, built here and passed
down), :mod:`infernex.embedded_nats` (the nats-server the project starts itself),
:mod:`infernex.cli` and its command modules under :mod:`infernex.commands`.

May import: everything. Nothing imports from here except tests and ``commands``.
"""

__version__ = "0.1.0"
