"""Surviving failures: the hook the loop calls at fixed points (`core.py`), the hang watchdog, the fault injector,
the Young/Daly checkpoint interval, and the record of restarts and goodput."""
