"""The datacenter side (middle layer; independent of ``federation``): the thin Flower ClientApp, the persistent
trainer and its DDP worker group, local training, the durable state store, the production node service and
enrollment. Speaks to the coordinator only through :mod:`crossdc.protocol`."""
