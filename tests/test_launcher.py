"""The launcher keeps reading a started engine's stdout, so a chatty child never blocks."""

from __future__ import annotations

import asyncio
import os

from slime.engines.client import ClientConfig, EngineClient
from tests.conftest import start_engine

NUM_LINES = 10_000  # ~1 MB: far more than a pipe buffer holds

# Imported by the child at start-up (sitecustomize on its PYTHONPATH): right after the server's
# ready line, stdout gets ~1 MB written from the event loop thread, as a chatty library or a
# stray print would. If nobody reads the pipe, that write blocks and the server stops serving.
CHATTY_SITECUSTOMIZE = f"""
import sys


class _ChattyStdout:
    def __init__(self, stream):
        self._stream, self._ready_seen, self._done = stream, False, False

    def write(self, text):
        self._ready_seen = self._ready_seen or '"event": "ready"' in text
        return self._stream.write(text)

    def flush(self):
        self._stream.flush()
        if self._ready_seen and not self._done:
            self._done = True
            for i in range({NUM_LINES}):
                self._stream.write(f"chatter {{i}} " + "x" * 100 + "\\n")
            self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


sys.stdout = _ChattyStdout(sys.stdout)
"""


def test_chatty_engine_keeps_serving_and_its_output_reaches_the_log(tiny_model, tmp_path, monkeypatch):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(CHATTY_SITECUSTOMIZE)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(site_dir), os.environ.get("PYTHONPATH")]))
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    with start_engine(tiny_model, logs) as eng:

        async def generate():
            # The timeout only matters if the fix regresses: the blocked server never answers.
            async with EngineClient(eng.url, ClientConfig(timeout_s=60)) as c:
                return await c.generate([1, 2, 3], sampling_params={"max_new_tokens": 2})

        result = asyncio.run(generate())
        assert result["meta_info"]["completion_tokens"] == 2
        assert eng.stop() in (0, -15)
        log = (logs / os.listdir(logs)[0]).read_text()
    assert f"chatter {NUM_LINES - 1} " in log
