"""The package's version, in one place: the distribution's metadata and ``--version`` read it from here."""

__version__ = "0.1.0"
