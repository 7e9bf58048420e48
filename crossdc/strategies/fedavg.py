"""FedAvg with a warm-up schedule for the number of local steps τ.

McMahan et al., 2017: each datacenter runs τ local steps from the global
weights; the server replaces the global weights by the example-weighted mean
of the datacenters' weights (equivalently: adds the weighted mean update).
τ follows the base's schedule (``tau = { start, end, warmup_rounds, kind }``).

Client contract: exactly the base's (:mod:`crossdc.strategies.base`); nothing more.
"""

from __future__ import annotations

from crossdc.strategies.base import Strategy


class FedAvgTau(Strategy):
    """FedAvg whose local step count τ warms up from `tau.start` to `tau.end`."""

    name = "fedavg"
    parameters = {}
