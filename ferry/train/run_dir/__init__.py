"""The run directory: its records (config, `run.json`, metrics) and the lock that keeps one live run in it.
Opening it on every rank and what a run says about itself need the assembled run: `ferry.train.opening` and
`ferry.train.announcements`."""
