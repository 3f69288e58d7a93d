"""The portability history and the report made from it."""
