"""The experiment (lower layer): the TOML config and its validation, link profiles as plain data, builders of the
strategy, workload and initial model, run folders, process helpers (spawn, reap, environment)."""
