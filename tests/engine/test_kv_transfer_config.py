"""--kv-transfer-config: vLLM's JSON, checked when parsed (a typo never starts a
server that silently does not disaggregate), the combinations it cannot work with
refused at start-up, and kv_transfer_params in a request: bounded, and ignored by
a server not run with the flag."""
from __future__ import annotations

import pytest

from kvserve.engine.config.kv_transfer_config import KVTransferConfig
from tests.support.server import engine_http_client


def test_the_flag_says_what_is_wrong(capsys):
    from kvserve.server.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-transfer-config", '{"kv_rol": "x"}'])
    assert "unknown keys ['kv_rol']" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--kv-transfer-config",
                                      '{"kv_connector": "MooncakeConnector", '
                                      '"kv_role": "kv_producer"}'])
    assert args.kv_transfer_config.produces and not args.kv_transfer_config.consumes


def test_bad_configs_are_refused():
    for text, reason in [('{"kv_connector": "NixlConnector"}', "kv_connector must be"),
                         ('{"kv_role": "kv_prefill"}', "kv_role must be"),
                         ('{"kv_port": 70000}', "kv_port must be"),
                         ('{"kv_connector_extra_config": {"hold_timeout": 1}}',
                          "unknown kv_connector_extra_config keys"),
                         ('{"kv_connector_extra_config": {"fetch_timeout_s": 0}}',
                          "fetch_timeout_s must be a positive"),
                         ('{"kv_connector_extra_config": {"protocol": "udp"}}',
                          "protocol must be"),
                         ("[1]", "not a JSON object"), ("{", "not JSON")]:
        with pytest.raises(ValueError, match=reason):
            KVTransferConfig.parse(text)
    config = KVTransferConfig.parse('{"kv_role": "kv_consumer"}')
    # the KV stays on the host unless the operator names an interface
    assert config.kv_ip == "127.0.0.1" and config.extra("hold_timeout_s") > \
        config.extra("fetch_timeout_s")


def test_what_it_cannot_work_with_is_refused(tiny_engine_factory):
    from kvserve.modelstore.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="--kv-transfer-config does not work with "
                                             "prefix caching off"):
        tiny_engine_factory(kv_transfer_config=KVTransferConfig(kv_role="kv_consumer"),
                            enable_prefix_caching=False)


def test_kv_transfer_params_are_bounded_and_ignored_without_the_flag(tiny_engine_factory):
    with engine_http_client(tiny_engine_factory(), "tiny") as http:
        def complete(params):
            return http.post("/v1/completions", json=dict(
                model="tiny", prompt=[5, 6, 7, 8], max_tokens=2, temperature=0,
                kv_transfer_params=params))

        for bad in [{"remote_port": 0}, {"remote_host": "h" * 300},
                    {"transfer_id": "t" * 65}, {"do_remote_decode": "maybe"}]:
            r = complete(bad)
            assert r.status_code == 400, (bad, r.text)
        r = complete({"do_remote_decode": True})
        assert r.status_code == 200 and "kv_transfer_params" not in r.json()
        r = complete({"do_remote_prefill": True, "remote_host": "127.0.0.1",
                      "remote_port": 9, "transfer_id": "x"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
