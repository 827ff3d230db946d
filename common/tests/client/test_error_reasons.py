"""The catalogue of refusal reasons: a server's domain is its service's, so the bound on calls at once
(CALL_LIMIT, which every server gives) says which server refused, in the decoder's domain the same as the
decoder's own reasons."""

from __future__ import annotations

from tandem.client import error_reasons as reasons


def test_a_servers_domain_is_its_services_the_decoders_the_catalogues() -> None:
    assert reasons.domain_of("tandem.v1.Decoder") == reasons.DECODER == "tandem.decoder"
    assert reasons.domain_of("tandem.v1.Encoder") == reasons.ENCODER == "tandem.encoder"
    assert reasons.domain_of("test.Faulty") == "test.faulty"
    assert reasons.domain_of("tandem") == "tandem"  # a server of health alone


def test_an_infos_numbers_are_the_strings_the_wire_carries() -> None:
    info = reasons.info_of(reasons.ENCODER, reasons.CALL_LIMIT, {reasons.MAX_CALLS: 10_000})
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "CALL_LIMIT",
        "tandem.encoder",
        {"maxCalls": "10000"},
    )
