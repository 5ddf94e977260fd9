"""The rules the tag follows operations by (Note [batch provenance] in ../examples.py), one file
per family; importing this package registers them all (registry.py)."""

from . import elementwise, indexing, linear, reductions, shapes, joins  # noqa: F401
