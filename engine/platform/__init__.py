"""What every layer of the engine stands on (engine/__init__.py)."""
