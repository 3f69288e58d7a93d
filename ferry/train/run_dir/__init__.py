"""The run directory: its records (config, `run.json`, metrics), the lock that keeps one live run in it, its
opening on every rank, and what a run says about itself."""
