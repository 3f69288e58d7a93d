"""Portable implementations: pure PyTorch, the same code on every device.

They define what each op computes; every vendor implementation is tested against them.
"""
