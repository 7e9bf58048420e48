"""Strategies (bottom layer): one per file on one base (:mod:`~crossdc.strategies.base`), the maths as pure functions
(schedule, aggregation, robust aggregation, staleness), the registry of built-ins and plug-ins."""
