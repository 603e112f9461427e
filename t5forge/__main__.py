"""`python -m t5forge <command> ...`."""
from t5forge.cli.main import main

if __name__ == "__main__":
  main()
