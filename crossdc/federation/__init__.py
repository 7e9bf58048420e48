"""The coordinator (middle layer; independent of ``clients``): the Flower ServerApp, one round session shared by
the synchronous and asynchronous loops and the in-process driver (:mod:`~crossdc.federation.session`), the Grid
transport (:mod:`~crossdc.federation.grid_io`), the update gate, adaptive deadlines, checkpoints and resume.
Speaks to the datacenters only through :mod:`crossdc.protocol`."""
