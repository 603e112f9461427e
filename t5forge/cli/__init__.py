"""Command-line entry points (wiring only; nothing imports this package).

Importing it installs the console handler of the "t5forge" logger (`console.py`): what
the library logs is what a command prints.
"""
from t5forge.cli import console

console.install()
