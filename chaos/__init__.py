"""Fault scenarios as data, and the runner that checks the invariants after them."""
