"""TLS on both front ends: a CA and a server certificate made here with `cryptography`,
`jaxserve serve --ssl-certfile --ssl-keyfile --grpc-port` as a subprocess on a tiny model, the
official `openai` client given the CA (and refused without it), and a gRPC round trip with
jaxserve.entrypoints.client over TLS. Plus the flag checks that fail at start."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import grpc
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.entrypoints.client import Client
from jaxserve.errors import ConfigError
from jaxserve.entrypoints.process import ServerProcess
from jaxserve.entrypoints.tls import TlsConfig
from tests.test_cli import ROOT, tiny_gguf

TINY = "tiny"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """A self-signed CA, and a certificate it signed for 127.0.0.1 and localhost."""
    d = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5),
                 not_valid_after=now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder(subject_name=_name("jaxserve test CA"),
                                  issuer_name=_name("jaxserve test CA"),
                                  public_key=ca_key.public_key(),
                                  serial_number=x509.random_serial_number(), **valid)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder(subject_name=_name("127.0.0.1"), issuer_name=ca.subject,
                                    public_key=key.public_key(),
                                    serial_number=x509.random_serial_number(), **valid)
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key",
             "other_key": d / "other.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(_pem_key(key))
    paths["other_key"].write_bytes(_pem_key(ec.generate_private_key(ec.SECP256R1())))
    return paths


def test_tls_flags_are_checked_at_start(certs, tmp_path):
    assert TlsConfig.from_args(None, None) is None
    with pytest.raises(ConfigError, match="needs both --ssl-certfile and --ssl-keyfile"):
        TlsConfig.from_args(certs["cert"], None)
    with pytest.raises(ConfigError, match=f"no such file {tmp_path / 'nope.pem'}"):
        TlsConfig.from_args(tmp_path / "nope.pem", certs["key"])
    with pytest.raises(ConfigError, match="cannot load the certificate .*server.pem with the key "
                                          ".*other.key"):
        TlsConfig.from_args(certs["cert"], certs["other_key"])
    assert TlsConfig.from_args(certs["cert"], certs["key"]).ssl_context() is not None


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_tokenizer_fields):
    return tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields)


def test_serve_over_tls_http_and_grpc(certs, tiny_path, tmp_path):
    # One 8-token sequence per step: few programs to compile.
    log_path = tmp_path / "stderr.log"
    with log_path.open("w") as stderr:
        server = ServerProcess(
            ["--model", str(tiny_path), "--served-model-name", TINY, "--port", "0",
             "--grpc-port", "0", "--no-rag", "--max-num-seqs", "1", "--max-num-batched-tokens",
             "8", "--min-token-bucket", "8", "--max-model-len", "128", "--num-pages", "16",
             "--ssl-certfile", str(certs["cert"]), "--ssl-keyfile", str(certs["key"])],
            stderr, cwd=ROOT, ready_timeout_s=300)
        try:
            target = next(line.split(" on ", 1)[1].strip() for line in server.startup_lines
                          if line.startswith("jaxserve: gRPC on "))
            assert server.url.startswith("https://127.0.0.1:")
            text = _round_trips(server.url, target, certs["ca"])
            assert server.stop() == 0
        finally:
            server.kill()
    log = log_path.read_text()
    assert "Traceback" not in log, log[-3000:]


def _round_trips(url: str, target: str, ca_path: Path) -> str:
    """HTTPS with the openai client (refused without the CA), then gRPC over TLS: the same greedy
    text from both. Returns it."""
    greedy = dict(max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    ca = ssl.create_default_context(cafile=ca_path)
    with openai.DefaultHttpxClient(verify=ca) as http:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, http_client=http)
        stream = client.completions.create(model=TINY, prompt=[42], stream=True, **greedy)
        text = "".join(c.choices[0].text for c in stream if c.choices)
        r = client.completions.create(model=TINY, prompt=[42], **greedy)
        assert r.choices[0].text == text and r.usage.completion_tokens == 4
    untrusting = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIConnectionError):  # refused at the handshake
        untrusting.models.list()
    with Client(target, root_certificates=ca_path.read_bytes()) as grpc_client:
        health = health_pb2_grpc.HealthStub(grpc_client.channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == \
            health_pb2.HealthCheckResponse.SERVING
        joined = grpc_client.complete(TINY, [42], max_tokens=4, temperature=0, ignore_eos=True,
                                      timeout=60)
    assert joined.text == text
    with Client(target) as plain, pytest.raises(grpc.RpcError) as e:
        plain.list_models()  # plain text to a TLS port
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    return text
