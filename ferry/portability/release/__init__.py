"""Releases: building one, its model card, verifying, replaying a stage, branching from one, seed runs."""
