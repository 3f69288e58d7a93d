"""The layout fuzzer: drawn combinations of layout, recomputation, model parts and optimizer, each refused by name
or trained and compared with the same computation on one process (`benchmarks/layout_fuzz.py`)."""
