"""`gpupart extender` as a real process with client-certificate TLS, and its plain-HTTP health port.

We test these aspects (certificates made here: a CA with a server and a client certificate, and
a second CA with a client certificate of its own):
- a client without a certificate, with one from another CA, or speaking plain HTTP, gets no
  HTTP answer from any verb: the TLS handshake is refused before a request is read;
- with the right client certificate every verb answers;
- the health port answers /healthz, /readyz and /metrics over plain HTTP, and nothing else:
  every verb there is 404.

The API server the extender is given does not exist: its watch fails and retries, which
neither the TLS listener nor the health port depend on (readiness says so: 503).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import ssl
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gpupart_testsupport.polling import wait_for
from gpupart_testsupport.ports import LOOPBACK, free_port
from gpupart_testsupport.processes import Proc, spawn

VERBS = ("filter", "prioritize", "bind", "preempt", "diagnose")
BODIES: dict[str, Any] = {
    "filter": {"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["n1"]},
    "prioritize": {"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["n1"]},
    "bind": {"PodName": "p", "PodNamespace": "default", "PodUID": "u", "Node": "n1"},
    "preempt": {"Pod": {"metadata": {"name": "p"}}, "NodeNameToMetaVictims": {}},
    "diagnose": {"metadata": {"name": "p"}},
}


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(  # type: ignore[no-any-return]
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _authority(name: str) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _issued(ca: tuple[Any, Any], name: str, *, server: bool) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) signed by `ca`: a server's for 127.0.0.1, or a client's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(LOOPBACK))]),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


@dataclass
class Pki:
    ca: Path
    server: tuple[Path, Path]
    client: tuple[Path, Path]
    stranger: tuple[Path, Path]
    """A client certificate from another CA."""


def write_pki(d: Path) -> Pki:
    from cryptography.hazmat.primitives import serialization

    ca = _authority("gpupart-extender-test-ca")
    other = _authority("someone-else-ca")
    files: dict[str, tuple[bytes, bytes]] = {
        "server": _issued(ca, "gpupart-extender", server=True),
        "client": _issued(ca, "kube-scheduler", server=False),
        "stranger": _issued(other, "kube-scheduler", server=False),
    }
    (d / "ca.crt").write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    paths = {}
    for name, (cert, key) in files.items():
        (d / f"{name}.crt").write_bytes(cert)
        (d / f"{name}.key").write_bytes(key)
        (d / f"{name}.key").chmod(0o600)
        paths[name] = (d / f"{name}.crt", d / f"{name}.key")
    return Pki(d / "ca.crt", paths["server"], paths["client"], paths["stranger"])


@dataclass
class Extender:
    proc: Proc
    port: int
    health_port: int
    pki: Pki


def start_extender(d: Path, **settings: Any) -> Iterator[Extender]:
    """A `gpupart extender` process serving HTTPS with client certificates required (the
    certificates of `write_pki` in `d`), with these settings over the defaults."""
    pki = write_pki(d)
    kubeconfig = d / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    # Nothing listens there: the watch fails and retries, the verbs still answer.
                    {"name": "c", "cluster": {"server": f"https://{LOOPBACK}:{free_port()}"}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    port, health_port = free_port(), free_port()
    config = d / "extender.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "host": LOOPBACK,
                "port": port,
                "health_host": LOOPBACK,
                "health_port": health_port,
                "tls_cert_file": str(pki.server[0]),
                "tls_key_file": str(pki.server[1]),
                "tls_client_ca_file": str(pki.ca),
                "kubeconfig": str(kubeconfig),
                **settings,
            }
        )
    )
    proc = spawn(
        "extender", [sys.executable, "-m", "gpupart.cli", "extender", f"--config={config}"], d
    )
    try:
        wait_for(
            lambda: httpx.get(f"http://{LOOPBACK}:{health_port}/healthz", timeout=2).text == "ok",
            60,
            "the extender's health port",
            detail=proc.tail,
        )
        yield Extender(proc, port, health_port, pki)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def extender(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Extender]:
    yield from start_extender(tmp_path_factory.mktemp("extender-tls"))


def tls_answer(port: int, context: ssl.SSLContext, verb: str) -> bytes:
    """What comes back to a POST of `verb` over TLS with `context`: the HTTP bytes, or b""
    when the server refused the handshake (an alert, or the connection closed)."""
    request = (
        f"POST /gpupart/{verb} HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
        f"Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    ).encode()
    with socket.create_connection((LOOPBACK, port), timeout=10) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=LOOPBACK) as tls:
                tls.sendall(request)  # TLS 1.3: the client's side is done before the server checks
                answer = b""
                while chunk := tls.recv(65536):
                    answer += chunk
                return answer
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
            return b""


def client_context(pki: Pki, cert: tuple[Path, Path] | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    return context


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
@pytest.mark.parametrize("verb", VERBS)
def test_a_client_without_the_right_certificate_gets_no_answer(
    extender: Extender, who: str, verb: str
) -> None:
    cert = None if who == "no certificate" else extender.pki.stranger
    assert tls_answer(extender.port, client_context(extender.pki, cert), verb) == b""


def test_plain_http_to_the_verbs_gets_no_http_answer(extender: Extender) -> None:
    with socket.create_connection((LOOPBACK, extender.port), timeout=10) as raw:
        raw.sendall(b"POST /gpupart/filter HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        answer = b""
        try:
            while chunk := raw.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    assert not answer.startswith(b"HTTP/"), answer[:100]


def test_with_the_right_client_certificate_every_verb_answers(extender: Extender) -> None:
    context = client_context(extender.pki, extender.pki.client)
    base = f"https://{LOOPBACK}:{extender.port}/gpupart"
    with httpx.Client(verify=context, timeout=10) as http:
        answers = {verb: http.post(f"{base}/{verb}", json=BODIES[verb]) for verb in VERBS}
        health = http.get(f"https://{LOOPBACK}:{extender.port}/healthz")
    assert {v: a.status_code for v, a in answers.items()} == dict.fromkeys(VERBS, 200), {
        v: a.text for v, a in answers.items()
    }
    assert answers["filter"].json()["FailedNodes"] == {
        "n1": "n1: not known to the gpupart extender (no such Node watched yet)"
    }
    assert "no filter decision for pod default/p" in answers["bind"].json()["Error"]
    assert answers["diagnose"].json()["FailedNodes"] == {}
    assert health.text == "ok"
    # The raw socket of the refusals above, with the right certificate: an HTTP answer (to
    # its empty body), so b"" there means the handshake was refused.
    assert tls_answer(extender.port, context, "filter").startswith(b"HTTP/1.1 400 ")


def test_the_health_port_serves_health_and_nothing_else(extender: Extender) -> None:
    base = f"http://{LOOPBACK}:{extender.health_port}"
    with httpx.Client(timeout=10) as http:
        assert http.get(f"{base}/healthz").text == "ok"
        ready = http.get(f"{base}/readyz")
        assert ready.status_code == 503 and "watch cache not synced" in ready.text
        metrics = http.get(f"{base}/metrics")
        assert metrics.status_code == 200 and "gpupart_extender_decisions_total" in metrics.text
        for verb in VERBS:
            assert http.post(f"{base}/gpupart/{verb}", json=BODIES[verb]).status_code == 404, verb
        assert http.get(f"{base}/openapi.json").status_code == 404
