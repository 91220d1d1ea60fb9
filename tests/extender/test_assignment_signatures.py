"""Ed25519 signatures of shared-GPU assignments: who can sign, what verifies, how keys rotate.

We test these aspects:
- a signature verifies only for the exact assignment, pod UID and node it was made for, with
  the signer's public key: any edited field, another pod or node, another key, or a signature
  moved to another key id fails (property test);
- a node agent holding public keys only cannot produce an assignment that verifies: its keys
  have no signing side, a file or ConfigMap with a private key is refused for an agent, a key
  of its own under the extender's key id does not verify, and the extender refuses to start
  with public keys only;
- rotation: an assignment signed with key A verifies while A and B are both published, and
  once B moves first new assignments are signed with B; the agent's ConfigMap copy reads the
  keys again at once for a key id it lacks (at most every `min_reread_s`), else after its TTL;
- key files say what is wrong with them, naming the file: an old HMAC key, an RSA key, stray
  text, too many keys; the PEM Helm's `genPrivateKey "ed25519"` writes is read;
- `gpupart assignment-keys public` prints the public keys of a private key file;
- a node agent reads the public keys from the extender's ConfigMap or from a file, not both.
"""

from __future__ import annotations

import base64
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupart.cli import main as gpupart
from gpupart.core.api.provenance import (
    MAX_KEYS,
    forgery,
    parse_keys,
    private_pem,
    public_pem,
    sign,
    split_signature,
)
from gpupart.core.api.wire import PodAssignment
from gpupart.core.errors import InvalidInput
from gpupart.keyfile import KeyFile
from gpupart.publickeys import PublishedKeys
from gpupart.signing import PrivateKeys, PublicKeys, private_keys, public_keys
from gpupart_testsupport.objects import write_key_file, write_public_key_file

A, B, OTHER = b"A" * 32, b"B" * 32, b"O" * 32
SIGNER = PrivateKeys((A,))
AGENT = PublicKeys(SIGNER.public_raw())
"""What a node agent holds: A's public key only."""
HELM_PEM = """-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIG/Eb2qkNwPSNZIi3Zdr3ejuI6WK92RCDvG+utcJeUwC
-----END PRIVATE KEY-----
"""
"""The output of `helm template` of `{{ genPrivateKey "ed25519" }}` (helm v4.3.1)."""

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
assignments = st.builds(
    PodAssignment,
    node=names,
    gpu=st.integers(0, 64),
    gpu_uuid=names,
    memory_mib=st.integers(0, 1 << 20),
    compute_percent=st.integers(0, 100),
    pod_uid=names.filter(bool),
)
EDITS = {
    "node": lambda a: replace(a, node=a.node + "x"),
    "gpu": lambda a: replace(a, gpu=a.gpu + 1),
    "gpu_uuid": lambda a: replace(a, gpu_uuid=a.gpu_uuid + "x"),
    "memory_mib": lambda a: replace(a, memory_mib=a.memory_mib + 1),
    "compute_percent": lambda a: replace(a, compute_percent=a.compute_percent + 1),
    "pod_uid": lambda a: replace(a, pod_uid=a.pod_uid + "x"),
}


def check(assignment: PodAssignment, keys: PublicKeys | PublishedKeys) -> str:
    return forgery(assignment, keys, pod_uid=assignment.pod_uid, node=assignment.node)


@given(assignments, st.sampled_from(sorted(EDITS)))
def test_a_signature_verifies_only_for_the_exact_assignment_uid_node_and_key(
    assignment: PodAssignment, edited: str
) -> None:
    signed = sign(assignment, SIGNER)
    key, signature = split_signature(signed.signature)
    assert key == SIGNER.key_id and len(signature) == 64
    assert forgery(signed, AGENT, pod_uid=assignment.pod_uid, node=assignment.node) == ""
    # Any field edited after signing (the UID and node too): no longer the extender's.
    changed = EDITS[edited](signed)
    assert "does not verify" in check(changed, AGENT)
    # Genuine, but shown on another pod or node: refused for that one.
    assert "made for pod UID" in forgery(signed, AGENT, pod_uid="other", node=assignment.node)
    assert "made for node" in forgery(signed, AGENT, pod_uid=assignment.pod_uid, node="elsewhere")
    # Signed with another key: its id is not published; under A's id it does not verify.
    other = sign(assignment, PrivateKeys((OTHER,)))
    assert "not one of the extender's published public keys" in check(other, AGENT)
    _, their_signature = split_signature(other.signature)
    relabelled = f"{SIGNER.key_id}:{base64.b64encode(their_signature).decode()}"
    assert "does not verify" in check(replace(signed, signature=relabelled), AGENT)


def test_unsigned_and_malformed_signatures_are_named() -> None:
    signed = sign(PodAssignment("n", 0, "GPU-0", pod_uid="u"), SIGNER)
    assert "carries no signature" in check(replace(signed, signature=""), AGENT)
    old_hmac = "ab" * 32  # what gpupart wrote before Ed25519
    assert "its signature is unreadable" in check(replace(signed, signature=old_hmac), AGENT)
    truncated = signed.signature[:-8]
    assert "unreadable" in check(replace(signed, signature=truncated), AGENT)
    with pytest.raises(InvalidInput, match="a pod UID is needed"):
        sign(PodAssignment("n", 0, "GPU-0"), SIGNER)


def test_an_agent_with_public_keys_only_cannot_sign(tmp_path: Path) -> None:
    public = write_public_key_file(tmp_path / "public.pem", A)
    agent = KeyFile.public(public).keys()
    assert agent.key_ids() == {SIGNER.key_id}
    assert not hasattr(agent, "sign") and not hasattr(agent, "key_id")
    # Nothing that reads a public-key file yields a signer: the extender's loader refuses it.
    with pytest.raises(InvalidInput, match=r"holds 1 public key\(s\) and no private key"):
        KeyFile.private(public).keys()
    # A private key given to an agent is refused, never used.
    private = write_key_file(tmp_path / "private.pem", A)
    with pytest.raises(InvalidInput) as refused:
        KeyFile.public(private).keys()
    assert str(refused.value) == (
        f"{private}: holds a private key; a node agent must hold the extender's public keys "
        "only (`gpupart assignment-keys public PRIVATE.pem` prints them)"
    )
    mixed = tmp_path / "mixed.pem"
    mixed.write_text(public_pem(SIGNER.public_raw()[0]) + private_pem(B))
    with pytest.raises(InvalidInput, match="holds a private key"):
        public_keys(mixed.read_bytes(), where=str(mixed))


def test_the_extender_refuses_to_start_with_public_keys_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    public = write_public_key_file(tmp_path / "public.pem", A)
    code = gpupart(
        ["extender", f"--kubeconfig={kubeconfig}", f"--assignment-key-file={public}", "--port=0"]
    )
    assert code == 2
    assert capsys.readouterr().err == (
        f"gpupart extender: {public}: holds 1 public key(s) and no private key: the extender "
        "signs assignments and needs the Ed25519 private key (PEM PRIVATE KEY) (setting "
        "assignment_key_file)\n"
    )


def test_rotation_a_then_both_published_then_b_signs(tmp_path: Path) -> None:
    path = write_key_file(tmp_path / "keys", A)
    extender = KeyFile.private(path)
    key_a, key_b = PrivateKeys((A,)).key_id, PrivateKeys((B,)).key_id
    published = {"pem": extender.keys().pem()}
    now = [0.0]
    agent = PublishedKeys(
        lambda: published["pem"], where="ConfigMap x/y", ttl_s=30, clock=lambda: now[0]
    )
    by_a = sign(PodAssignment("n", 0, "GPU-0", 100, pod_uid="u1"), extender.keys())
    assert by_a.signature.startswith(f"{key_a}:") and check(by_a, agent.keys()) == ""
    # Step 1: B added after A. A still signs; both are published and verify.
    write_key_file(path, A, B)
    published["pem"] = extender.keys().pem()
    assert published["pem"] == PublicKeys([SIGNER.public_raw()[0]]).pem() + PrivateKeys((B,)).pem()
    assert sign(by_a, extender.keys()).signature.startswith(f"{key_a}:")
    now[0] = 31.0  # the agent's TTL: it has read both
    assert agent.keys().key_ids() == {key_a, key_b} and check(by_a, agent) == ""
    # Step 2: B moved first: new assignments are signed with B, A's still verify.
    write_key_file(path, B, A)
    published["pem"] = extender.keys().pem()
    by_b = sign(PodAssignment("n", 1, "GPU-1", 200, pod_uid="u2"), extender.keys())
    assert by_b.signature.startswith(f"{key_b}:")
    assert check(by_b, agent) == "" and check(by_a, agent) == ""
    # Step 3: A removed once its pods are gone: what it signed no longer verifies.
    write_key_file(path, B)
    published["pem"] = extender.keys().pem()
    now[0] = 62.0
    assert agent.keys().key_ids() == {key_b}
    assert "not one of the extender's published public keys" in check(by_a, agent)


def test_the_agent_reads_again_at_once_for_a_key_id_it_lacks() -> None:
    reads: list[float] = []
    published = {"pem": SIGNER.pem()}
    now = [0.0]

    def read() -> str:
        reads.append(now[0])
        return published["pem"]

    agent = PublishedKeys(
        read, where="ConfigMap x/y", ttl_s=30, min_reread_s=2, clock=lambda: now[0]
    )
    assert agent.keys().key_ids() == {SIGNER.key_id} and reads == [0.0]
    published["pem"] = PrivateKeys((B, A)).pem()  # the extender rotated: B signs
    now[0] = 1.0
    by_b = sign(PodAssignment("n", 0, "GPU-0", pod_uid="u"), PrivateKeys((B,)))
    # Within min_reread_s of the last read: not read again (a tenant's made-up ids cannot
    # flood the API server), so not yet verified.
    assert "not one of the extender's published" in check(by_b, agent)
    now[0] = 2.5
    assert check(by_b, agent) == "" and reads == [0.0, 2.5]  # read once, at once, not at TTL
    made_up = replace(by_b, signature="0" * 16 + by_b.signature[16:])
    assert check(made_up, agent) != "" and reads == [0.0, 2.5]
    # A failed read keeps the keys last read.
    published["pem"] = "not PEM"
    now[0] = 40.0
    assert check(by_b, agent.keys()) == ""


def test_the_agent_without_published_keys_says_why() -> None:
    agent = PublishedKeys(lambda: "", where="ConfigMap gpupart/keys")
    with pytest.raises(InvalidInput) as none:
        agent.keys()
    assert str(none.value) == (
        "ConfigMap gpupart/keys: holds no public key yet (the extender publishes them when it "
        "starts)"
    )
    leaked = PublishedKeys(SIGNER.pem, where="ConfigMap gpupart/keys")
    assert leaked.keys().key_ids() == {SIGNER.key_id}  # public keys: read
    private = PublishedKeys(lambda: private_pem(A), where="ConfigMap gpupart/keys")
    with pytest.raises(InvalidInput, match="holds a private key"):
        private.keys()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (b"a-64-character-hmac-key-" * 3 + b"\n", "holds no PEM key"),
        (
            b"-----BEGIN RSA PRIVATE KEY-----\nAAAA\n-----END RSA PRIVATE KEY-----\n",
            "PEM block 1 is RSA PRIVATE KEY; only Ed25519 PRIVATE KEY",
        ),
        (
            b"-----BEGIN PRIVATE KEY-----\nMIIBVQIBADANBgkqhkiG9w0BAQEFAASCAT8=\n-----END PRIVATE KEY-----\n",
            "PEM block 1 (PRIVATE KEY) is not an Ed25519 key",
        ),
        (b"-----BEGIN PRIVATE KEY-----\n!!!!\n-----END PRIVATE KEY-----\n", "not base64"),
        (private_pem(A).encode() + b"junk\n", "text outside a PEM block ('junk'...)"),
        (
            b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PUBLIC KEY-----\n",
            "BEGIN PRIVATE KEY ends with END PUBLIC KEY",
        ),
        ("".join(private_pem(bytes([i]) * 32) for i in range(MAX_KEYS + 1)).encode(), "at most 8"),
    ],
)
def test_a_bad_key_file_is_named_with_its_problem(
    tmp_path: Path, text: bytes, problem: str
) -> None:
    path = tmp_path / "keys"
    path.write_bytes(text)
    with pytest.raises(InvalidInput) as error:
        KeyFile.private(path).keys()
    assert str(error.value).startswith(f"{path}: ") and problem in str(error.value)


def test_helms_ed25519_private_key_is_read() -> None:
    keys = private_keys(HELM_PEM.encode(), where="helm")
    material = parse_keys(HELM_PEM.encode(), where="helm")
    assert len(material.private) == 1 and material.public == ()
    assert (
        check(
            sign(PodAssignment("n", 0, "G", pod_uid="u"), keys),
            public_keys(keys.pem().encode(), where="published"),
        )
        == ""
    )
    assert "PRIVATE" not in repr(material) and HELM_PEM.split()[4] not in repr(keys)


def test_the_cli_prints_the_public_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_key_file(tmp_path / "private.pem", A, B)
    assert gpupart(["assignment-keys", "public", str(path)]) == 0
    out = capsys.readouterr().out
    assert out == PrivateKeys((A, B)).pem() and out.count("BEGIN PUBLIC KEY") == 2
    assert public_keys(out.encode(), where="out").key_ids() == PrivateKeys((A, B)).key_ids()
    assert gpupart(["assignment-keys", "public", str(write_public_key_file(tmp_path / "p"))]) == 2
    assert "no private key" in capsys.readouterr().err
    assert gpupart(["assignment-keys", "generate"]) == 0
    assert len(private_keys(capsys.readouterr().out.encode(), where="new").key_ids()) == 1


def test_the_node_agent_reads_the_configmap_or_a_file_not_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpupart.cli import build_parser
    from gpupart_plugin import settings as node_settings

    for var in ("GPUPART_ASSIGNMENT_KEY_FILE", "GPUPART_ASSIGNMENT_PUBLIC_KEYS", "NODE_NAME"):
        monkeypatch.delenv(var, raising=False)

    def read(*flags: str) -> node_settings.NodeSettings:
        args = build_parser("node").parse_args(["node", "--node-name=n", *flags])
        return node_settings.from_args(args)

    chart = read("--assignment-public-keys=gpupart/gp-gpupart-assignment-public-keys")
    assert chart.assignment_public_keys == "gpupart/gp-gpupart-assignment-public-keys"
    own = read("--assignment-key-file=/etc/keys.pem")
    assert (own.assignment_public_keys, str(own.assignment_key_file)) == ("", "/etc/keys.pem")
    with pytest.raises(InvalidInput, match="give it or --assignment-key-file, not both"):
        read("--assignment-public-keys=a/b", "--assignment-key-file=/etc/keys.pem")
    with pytest.raises(InvalidInput, match="'keys' is not NAMESPACE/NAME of a ConfigMap"):
        read("--assignment-public-keys=keys")
