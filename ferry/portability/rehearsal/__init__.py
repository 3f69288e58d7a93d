"""Rehearsing a move: legs run as process trees, the bundle between the halves, the conditions a figure was measured under, the record of a rehearsal."""
