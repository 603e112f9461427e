"""Command-line entry points (wiring only; nothing imports this package)."""
