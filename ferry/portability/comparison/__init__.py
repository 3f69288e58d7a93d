"""Judging two runs: the tolerance profiles, the verdict, and the environments a move is between."""
