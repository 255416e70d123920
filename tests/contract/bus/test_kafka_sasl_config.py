"""Kafka TLS/SASL settings: one loader for every party (``[bus.security]`` and the
``TRAINGUARD_KAFKA_*`` variables), checked combinations, and what reaches aiokafka."""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from trainguard.agent import AgentConfig, ConfigError
from trainguard.agent.bus import BusConfig, KafkaSecurity, load_kafka_security
from trainguard.agent.bus._kafka import KafkaBus
from trainguard.daemon.service._settings import load_daemon_config

PASSWORD = "pw-Zq8#vX2,=]"

SCRAM_ENV = {
    "TRAINGUARD_KAFKA_SECURITY_PROTOCOL": "sasl_plaintext",
    "TRAINGUARD_KAFKA_SASL_MECHANISM": "scram-sha-512",
    "TRAINGUARD_KAFKA_SASL_USERNAME": "trainguard",
    "TRAINGUARD_KAFKA_SASL_PASSWORD": PASSWORD,
}


def test_no_table_and_no_variables_is_plaintext() -> None:
    assert load_kafka_security(None, {}) == KafkaSecurity()


def test_variables_set_everything_case_insensitively() -> None:
    assert load_kafka_security(None, SCRAM_ENV) == KafkaSecurity(
        protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="trainguard",
        sasl_password=PASSWORD,
    )


def test_variables_beat_the_table_key_by_key_and_empty_ones_are_unset() -> None:
    table = {
        "protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_username": "from-file",
        "sasl_password": "file-password",
    }
    env = {"TRAINGUARD_KAFKA_SASL_USERNAME": "from-env", "TRAINGUARD_KAFKA_SASL_MECHANISM": ""}
    got = load_kafka_security(table, env)
    assert (got.protocol, got.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-256")
    assert (got.sasl_username, got.sasl_password) == ("from-env", "file-password")


def test_a_password_file_drops_one_line_break(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    env = {**SCRAM_ENV, "TRAINGUARD_KAFKA_SASL_PASSWORD_FILE": str(secret)}
    del env["TRAINGUARD_KAFKA_SASL_PASSWORD"]
    assert load_kafka_security(None, env).sasl_password == PASSWORD
    secret.write_text(PASSWORD + "\r\n\n")  # only one line break is framing
    assert load_kafka_security(None, env).sasl_password == PASSWORD + "\r\n"


def test_a_password_file_in_the_environment_replaces_the_tables_password(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("mounted")
    table = {"protocol": "SASL_SSL", "sasl_username": "u", "sasl_password": "in-toml"}
    env = {"TRAINGUARD_KAFKA_SASL_PASSWORD_FILE": str(secret)}
    assert load_kafka_security(table, env).sasl_password == "mounted"


@pytest.mark.parametrize(
    ("table", "env", "message"),
    [
        ({"sasl_password": "a", "sasl_password_file": "/x"}, {}, "both set"),
        (
            None,
            {"TRAINGUARD_KAFKA_SASL_PASSWORD": "a", "TRAINGUARD_KAFKA_SASL_PASSWORD_FILE": "/x"},
            "both set",
        ),
        ({"passwd": "a"}, {}, "unknown key"),
        ({"protocol": 1}, {}, "expected a string"),
        ({"protocol": "TLS"}, {}, "expected one of"),
        ({"protocol": "SASL_SSL", "sasl_username": "u"}, {}, "needs sasl_username and"),
        ({"protocol": "SASL_SSL", "sasl_password": "p"}, {}, "needs sasl_username and"),
        (
            {"protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "sasl_username": "u"},
            {"TRAINGUARD_KAFKA_SASL_PASSWORD": "p"},
            "SASL mechanism 'GSSAPI'",
        ),
        ({"sasl_username": "u"}, {}, "does not authenticate with SASL"),
        ({"protocol": "SASL_PLAINTEXT", "ssl_cafile": "ca.pem"}, SCRAM_ENV, "does not use TLS"),
    ],
)
def test_refused_settings_name_the_problem_never_a_value(
    table: dict[str, object] | None, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        load_kafka_security(table, env)
    assert PASSWORD not in str(caught.value)
    assert "p'" not in str(caught.value)


def test_an_unreadable_or_empty_password_file_is_refused_by_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    env = {**SCRAM_ENV, "TRAINGUARD_KAFKA_SASL_PASSWORD_FILE": str(missing)}
    del env["TRAINGUARD_KAFKA_SASL_PASSWORD"]
    with pytest.raises(ValueError, match=f"{missing}: No such file"):
        load_kafka_security(None, env)
    missing.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_kafka_security(None, env)
    missing.write_bytes(b"\xffsecret-bytes")
    with pytest.raises(ValueError, match="not UTF-8") as caught:
        load_kafka_security(None, env)
    # Neither the message nor a chained error carries the file's bytes.
    assert caught.value.__suppress_context__
    assert "secret-bytes" not in str(caught.value)


def test_agents_read_the_variables_and_report_bad_ones_as_config_errors() -> None:
    config = AgentConfig.resolve(env={**SCRAM_ENV, "TRAINGUARD_JOB": "j"})
    assert config.kafka_security == load_kafka_security(None, SCRAM_ENV)
    with pytest.raises(ConfigError, match="needs sasl_username"):
        AgentConfig.resolve(
            env={"TRAINGUARD_JOB": "j", "TRAINGUARD_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}
        )


def test_the_daemon_reads_its_table_and_the_variables(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text(
        '[bus]\nurl = "kafka://k:9092"\n[bus.security]\nprotocol = "SASL_SSL"\n'
        'sasl_mechanism = "SCRAM-SHA-256"\nsasl_username = "d"\n'
    )
    config = load_daemon_config(path, env={"TRAINGUARD_KAFKA_SASL_PASSWORD": PASSWORD})
    assert config.bus.security == KafkaSecurity(
        protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-256",
        sasl_username="d",
        sasl_password=PASSWORD,
    )
    assert load_daemon_config(None, env=SCRAM_ENV).bus.security.protocol == "SASL_PLAINTEXT"
    path.write_text('[bus]\nsecurity = "SASL_SSL"\n')
    with pytest.raises(ValueError, match=r"must be a table"):
        load_daemon_config(path, env={})


def _ca_file(directory: Path) -> Path:
    """A self-signed CA certificate (PEM) in ``directory``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainguard test CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = directory / "ca.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def test_sasl_ssl_settings_reach_aiokafka(tmp_path: Path) -> None:
    security = KafkaSecurity(
        protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="trainguard",
        sasl_password=PASSWORD,
        ssl_cafile=str(_ca_file(tmp_path)),
    )
    kwargs = KafkaBus(BusConfig(url="kafka://k:9093", security=security), "k:9093")._client_kwargs()
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert (kwargs["sasl_mechanism"], kwargs["sasl_plain_username"]) == (
        "SCRAM-SHA-512",
        "trainguard",
    )
    assert kwargs["sasl_plain_password"] == PASSWORD
    context = kwargs["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.check_hostname
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert [c["subject"] for c in context.get_ca_certs()] == [
        ((("commonName", "trainguard test CA"),),)
    ]


def test_plaintext_sends_no_credentials() -> None:
    kwargs = KafkaBus(BusConfig(url="kafka://k:9092"), "k:9092")._client_kwargs()
    assert kwargs["security_protocol"] == "PLAINTEXT"
    assert not {"sasl_plain_password", "ssl_context"} & kwargs.keys()
