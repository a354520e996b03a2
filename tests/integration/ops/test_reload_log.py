"""A config reload that is applied is routine: logged at ``info``; one that is
rejected keeps its ``error`` line."""

from __future__ import annotations

import logging

import yaml

from gateway.config import load_config
from gateway.ops.config_reload import reload_from_file
from gateway.server.app import create_app
from gateway.server.listener import listen
from tests.support.servers import ScriptedBackend


async def test_an_applied_reload_logs_at_info_and_a_rejected_one_at_error(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="gateway.ops.config_reload")
    path = tmp_path / "gw.yaml"
    async with ScriptedBackend().running() as be:
        def write(models: list[str]) -> None:
            path.write_text(yaml.safe_dump({"health": {"interval_s": 60}, "routing": {"scrape_interval_s": 0},
                                            "backends": [{"name": "b", "url": be.url, "models": models}]}))

        write(["m"])
        app = create_app(load_config(path), config_path=str(path))
        server = await listen(app, "127.0.0.1", 0)
        try:
            write(["m", "m2"])
            assert (await reload_from_file(app, "test"))[0]
            path.write_text("backends: [{name: x}]\n")
            assert not (await reload_from_file(app, "test"))[0]
        finally:
            await server.shutdown(1.0)
    lines = [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records
             if r.name == "gateway.ops.config_reload"]
    assert ("INFO", "config reloaded (test) from " + str(path)) in lines
    assert ("ERROR", "config reload (test) rejected") in lines
    assert not [r for r in caplog.records if r.name == "gateway.ops.config_reload" and r.levelno == logging.WARNING]
