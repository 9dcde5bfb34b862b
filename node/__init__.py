"""Stdlib-only modules that run on the nodes; bootstrap's code sync ships them."""
