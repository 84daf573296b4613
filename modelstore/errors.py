"""What can go wrong getting a model: the default model cannot be provided (the
message says what to do), or a model's files are missing or unreadable, its
weights bad, or it does not fit (engine/weights/loader.py raises that one too)."""


class ModelLoadError(RuntimeError):
    """The model cannot be loaded: missing files, bad weights, or not enough memory."""


class DefaultModelError(RuntimeError):
    """The default model could not be provided; the message says what to do."""
