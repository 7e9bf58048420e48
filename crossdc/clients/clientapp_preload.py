"""What a datacenter's ClientApp needs, imported once in its SuperExec's fork server (crossdc.clients.supernode):
Flower's ``flwr_clientapp`` (without the SuperNode's command line) and crossdc's ClientApp, which Flower then finds
already imported. Importing this module is all it does; in the fork server (its environment names the SuperExec that
started it) it first makes the server die with that SuperExec, at once rather than when it notices on its own."""

import os

from crossdc.clients.supernode import FORKSERVER_PARENT_ENV, load_clientapp
from crossdc.experiment.processes import die_with_parent_now

if os.environ.get(FORKSERVER_PARENT_ENV, "").isdigit():  # before the ClientApp's imports, which take a while
    die_with_parent_now(int(os.environ[FORKSERVER_PARENT_ENV]))

from crossdc.clients import client_app  # noqa: E402, F401 (the app Flower loads by name: ready in every forked ClientApp)

load_clientapp()
