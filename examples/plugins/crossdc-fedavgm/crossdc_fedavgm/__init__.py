"""Example crossdc plug-in: FedAvgM (a Strategy) and two moons (a Workload), registered by entry points."""
