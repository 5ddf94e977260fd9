"""Which tensors hold the examples, and which DP layer calls see them row by row (Note [batch
provenance] in examples.py): the tag (examples.py), the rules it follows operations by
(rules/, registry.py) and the root forward's probe and verdicts (probe.py)."""

from . import rules  # noqa: F401  (registers every rule)
