"""Integrations with training frameworks; each imports its framework lazily, only when used."""

from .hf import patch, unpatch

__all__ = ["patch", "unpatch"]
