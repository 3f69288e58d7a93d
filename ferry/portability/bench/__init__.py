"""Comparing hardware: benchmark suites as data, `ferry bench`, and the cost model of `ferry cost`."""
