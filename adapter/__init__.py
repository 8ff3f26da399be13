"""DSV41 serving overlay for SGLang 0.5.23: env-gated, pinned wrappers installed by an import hook."""

__version__ = "0.1.0"
