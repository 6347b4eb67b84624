"""The routes a copy can take, one module each (see ``_base.py`` for the interface)."""
