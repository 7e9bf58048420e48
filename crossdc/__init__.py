"""crossdc: train one model across datacenters joined by a slow, high-latency WAN.

The package, one concern per subpackage; imports run one way, from the top layer down (the import-linter
contract in ``pyproject.toml``, checked by ``tests/test_architecture.py``; siblings on one line are independent
of each other, except the top line's, where the CLI serves the dashboard):

=========================  ==============================================================================
layer                      subpackages
=========================  ==============================================================================
top                        ``dashboard`` (FastAPI app, API, pages, figures), ``cli`` (the ``crossdc`` command)
upper                      ``orchestration`` (local runs, demo, baselines, follow)
middle                     ``clients`` (the datacenter side) | ``federation`` (the coordinator)
middle, below those        ``wan`` (link relay, cost model) | ``deployment`` (TLS, Fleet front, Control API)
lower                      ``experiment`` (config, link profiles, builders, run folders, process helpers)
bottom                     ``strategies`` | ``compression`` | ``workloads`` | ``db``
base                       ``protocol`` (every message key, record encode/decode, the trainer request)
=========================  ==============================================================================

``testing`` stands aside (the in-process driver and Flower's plain baseline, for tests, benchmarks and plug-in
authors); ``parameters`` (typed plug-in parameters) and ``plugins`` (the plug-in registry) import nothing else of
crossdc. No subpackage is called ``platform``: it would shadow the standard library's module.
"""
