"""The package's version (one place: ``setup.cfg`` reads it, ``autobatch.__version__`` is it)."""

__version__ = "0.1.0"
