"""What a datacenter's ClientApp needs, imported once in its SuperExec's fork server (crossdc.clients.supernode):
Flower's ``flwr_clientapp`` (without the SuperNode's command line) and crossdc's ClientApp, which Flower then finds
already imported. Importing this module is all it does."""

from crossdc.clients import client_app  # noqa: F401 (the app Flower loads by name: ready in every forked ClientApp)
from crossdc.clients.supernode import load_clientapp

load_clientapp()
