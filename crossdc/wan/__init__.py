"""The WAN (below ``clients`` and ``federation``): the link relay that emulates a link and its ledger of what crossed
it, the cost model and planner (``crossdc plan``)."""
