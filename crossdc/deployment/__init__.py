"""Production deployment (below ``clients`` and ``federation``): TLS certificates, the Fleet API front, the SuperLink
Control API client, the background uvicorn helper."""
