"""Rehearsing a move: legs run as process trees, the bundle between the two halves, the conditions a figure was
measured under, the record of a rehearsal."""
