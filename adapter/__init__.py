"""DSV41 serving overlay for SGLang 0.5.23: pinned wrappers, each off unless its env key is set, installed by an import hook."""

__version__ = "0.1.0"
