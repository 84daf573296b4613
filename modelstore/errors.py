"""The one error of getting a model: its files are missing or unreadable, its
weights are bad, or it does not fit (engine/loader.py raises it too)."""


class ModelLoadError(RuntimeError):
    """The model cannot be loaded: missing files, bad weights, or not enough memory."""
