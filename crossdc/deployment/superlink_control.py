"""A thin adapter over the Flower SuperLink's Control API for SuperNode registration and run status (flwr 1.42).

With ``flower-superlink --enable-supernode-auth`` (which Flower allows only over TLS) a SuperNode may connect
only with a private key whose public key was registered through the Control API (what ``flwr supernode
register`` does); unregistering the node refuses it from its next request on. The Control API authenticates
nobody in Flower's open-source build, so only crossdc's authenticated API calls this adapter, over the
SuperLink's private address (see :mod:`crossdc.deployment.fleet_front`).

Promises: :meth:`SuperLinkControl.register` answers the node id Flower gave the key; every failure of the
SuperLink (unreachable, refused, a key already in use) is a :class:`ControlError` with one line saying what.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

#: the curves Flower accepts for SuperNode keys (flwr.supercore.primitives.asymmetric.uses_nist_ec_curve)
NIST_CURVES = (ec.SECP256R1, ec.SECP384R1, ec.SECP521R1)


class ControlError(RuntimeError):
    """The SuperLink's Control API did not do what was asked."""


class PublicKeyError(ValueError):
    """A datacenter's public key is not one a SuperLink accepts."""


def check_public_key(pem: str) -> str:
    """`pem` normalised (PEM SubjectPublicKeyInfo) if it is an EC public key on a NIST curve; else PublicKeyError."""
    try:
        key = serialization.load_pem_public_key(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError, TypeError, UnsupportedAlgorithm) as err:
        raise PublicKeyError(f"not a PEM public key: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, NIST_CURVES):
        raise PublicKeyError("the key must be an elliptic-curve key on P-256, P-384 or P-521 (`crossdc enroll` makes P-384)")
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode("ascii")


class SuperLinkControl:
    """Registration of SuperNode keys at one SuperLink, over its private Control API address ``host:port``."""

    def __init__(self, address: str, root_certificates: Path | None, insecure: bool = False) -> None:
        from flwr.supercore.control import ControlHttpClient
        from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor

        if not insecure and root_certificates is None:
            raise ControlError("the SuperLink's Control API needs the CA of its certificate (or insecure on loopback)")
        self.address = address
        certificates = root_certificates.read_bytes() if root_certificates is not None else None
        self._client = ControlHttpClient.from_server_address(address, insecure=insecure, root_certificates=certificates,
                                                             interceptors=[RuntimeVersionHttpInterceptor("crossdc")])

    def _call(self, what: str, method: Any, request: Any) -> Any:
        try:
            return method(request)
        except Exception as err:  # httpx errors, Flower's protobuf-over-HTTP errors: one line for the caller
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ControlError(f"SuperLink {self.address}: {what} failed: {message}") from err

    def register(self, public_key_pem: str, name: str) -> int:
        """Register a SuperNode key; returns the node id the SuperLink gave it."""
        from flwr.proto.control_pb2 import RegisterNodeRequest

        answer = self._call("registering the node", self._client.RegisterNode,
                            RegisterNodeRequest(public_key=public_key_pem.encode("ascii"), name=name))
        if not answer.node_id:
            raise ControlError(f"SuperLink {self.address}: the node was not registered (no node id came back)")
        return int(answer.node_id)

    def unregister(self, node_id: int) -> None:
        """Unregister a node: its SuperNode is refused from its next request on."""
        from flwr.proto.control_pb2 import UnregisterNodeRequest

        self._call("unregistering the node", self._client.UnregisterNode, UnregisterNodeRequest(node_id=node_id))

    def nodes(self) -> dict[int, str]:
        """Every node the SuperLink knows: node id → status (registered, online, offline, unregistered)."""
        from flwr.proto.control_pb2 import ListNodesRequest

        answer = self._call("listing the nodes", self._client.ListNodes, ListNodesRequest())
        return {int(info.node_id): str(info.status) for info in answer.nodes_info}

    def run_status(self, run_id: int) -> tuple[str, str]:
        """(status, details) of a Flower run as the SuperLink reports it, in ``flwr ls``'s words: e.g. ``running``,
        ``finished:completed``, ``finished:failed`` with what failed."""
        from flwr.proto.control_pb2 import ListRunsRequest

        answer = self._call("reading the run's status", self._client.ListRuns, ListRunsRequest(run_id=run_id))
        run = answer.run_dict.get(run_id)
        if run is None:
            raise ControlError(f"SuperLink {self.address}: no run {run_id}")
        status = run.status
        text = f"{status.status}:{status.sub_status}" if status.sub_status else status.status
        return str(text), str(status.details)

    def stop_run(self, run_id: int) -> None:
        """Stop a Flower run: the SuperLink marks it ``finished:stopped`` and refuses its ServerApp's next call, so
        the ServerApp ends (its SuperNodes stay, ready for the next run). ControlError if the SuperLink did not stop it
        (no such run, already finished, unreachable)."""
        from flwr.proto.control_pb2 import StopRunRequest

        answer = self._call("stopping the run", self._client.StopRun, StopRunRequest(run_id=run_id))
        if not answer.success:
            raise ControlError(f"SuperLink {self.address}: run {run_id} was not stopped")

    def close(self) -> None:
        self._client.close()
