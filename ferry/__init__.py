"""ferry: a portable training stack for mixture-of-experts language models."""

__version__ = "0.1.0"
