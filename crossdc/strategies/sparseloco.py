"""SparseLoCo (Sarfi et al., 2025): DiLoCo whose datacenters send a chunked top-k of a decaying error-feedback
buffer in 2-bit values, and whose server steps on the average of what they sent, without outer momentum.

Client contract: the base's (:mod:`crossdc.strategies.base`), with the uplink codecs of ``[compression] codecs``
doing SparseLoCo's client half: a chunked top-k (``chunk-topk``) whose error-feedback residual decays,
e ← β·e + Δ before each round's selection and e ← e − what was sent after it (the values' rounding included),
and optionally a values codec (``int2`` for the paper's 2 bits, with ``block`` = k for one scale per chunk).
The recommended spelling is ``codecs = ["chunk-topk:64:decay=0.95", "int2"]``; a run without a chunked top-k is
refused before it starts. The inner optimizer is AdamW, as for DiLoCo.

Server: x ← x + outer_lr · mean_i(ŷ_i − x), the example-weighted mean of the decoded (sparse, quantised) updates
— DiLoCo's outer SGD with momentum 0, since the decaying residual on each datacenter plays the role of DiLoCo's outer
momentum. The outer learning rate may follow DiLoCo's outer schedule. Defaults: outer lr 1, no momentum (the paper's).
``outer_momentum`` > 0 adds DiLoCo's outer Nesterov momentum on that mean (with its warm-up,
``outer_momentum_warmup_rounds``), a variant beyond the paper for experiments (measured worse on the WAN benchmark's
setting, see docs/strategies.md).
"""

from __future__ import annotations

from crossdc.strategies.base import Parameter, RunInfo, StrategyError
from crossdc.strategies.diloco import DiLoCo

#: the structure codec SparseLoCo's datacenters must send with
CHUNKED_TOPK = "chunk-topk"


class SparseLoCo(DiLoCo):
    """DiLoCo without outer momentum, its datacenters sending a decaying error-feedback buffer's chunked top-k."""

    name = "sparseloco"
    parameters = {
        **DiLoCo.parameters,
        "outer_lr": Parameter(float, 1.0, "outer (server) learning rate on the mean of the sent updates", low=0.0),
        "outer_momentum": Parameter(float, 0.0, "outer Nesterov momentum μ on the mean of the sent updates (0, the "
                                    "paper's: the datacenters' error feedback stands in for it)", low=0.0, high=0.999),
    }

    def check_run(self, run: RunInfo) -> None:
        codecs = [spec.split(":", 1)[0].strip() for spec in run.codecs]
        if CHUNKED_TOPK not in codecs:
            raise StrategyError(f"strategy '{self.name}' needs a chunked top-k uplink: [compression] codecs = "
                                f"[\"chunk-topk:64:decay=0.95\", \"int2\"] (got {list(run.codecs) or 'none'})")
        super().check_run(run)
