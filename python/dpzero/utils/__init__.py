"""Opacus's utilities under their Opacus paths, for scripts switched by their imports."""
