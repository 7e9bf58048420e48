"""Codecs (bottom layer): top-k with error feedback, int8, QSGD, PowerSGD; codec pipelines, the compressed wire
format, the uplink and downlink, exact byte accounting."""
