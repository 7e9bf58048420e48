"""Test harnesses, public for plug-in authors (aside the layers): the in-process federation driver (a strategy's rounds
without processes) and Flower's own FedAvg with a plain ClientApp (a baseline)."""
