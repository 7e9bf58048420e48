"""Running experiments on one machine (upper layer): local runs (SuperLink, SuperNodes, trainers, link relays as
processes), the demo, the single-datacenter baselines, following a run. The dashboard is handed in by the CLI."""
