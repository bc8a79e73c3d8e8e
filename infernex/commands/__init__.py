"""CLI command modules; each defines ``register(app)``. One module per area."""
