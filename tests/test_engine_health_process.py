"""A broken engine must say so (issue 21 item 5): `ironlm serve` under IRONLM_FAULT=forward:raise used to fail
every request while /health answered 200 "ok" and the engine never restarted, because a failed forward fails
its requests inside a step that returns normally. Run as a real server process, as an orchestrator sees it."""

from __future__ import annotations

import httpx
import pytest

from ironlm.bench.server_process import ServerProcess
from ironlm.server.api import build_app
from server_utils import LiveServer, tiny_engine, wait_for

ENGINE_FLAGS = ["--num-kv-blocks", "128", "--block-size", "4", "--max-model-len", "256", "--device", "cpu",
                "--dtype", "float32", "--served-model-name", "tiny"]
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("health-process"), arch="llama"))


def test_a_forward_that_always_fails_restarts_the_engine_then_turns_health_503(tiny: str) -> None:
    # The default policy: 3 failed steps in a row restart the engine, 2 restarts without a good step kill it.
    server = ServerProcess(tiny, ENGINE_FLAGS, env={"IRONLM_FAULT": "forward:raise"})
    server.start(timeout_s=300)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/health").json()["status"] == "ok"
            statuses = []
            for _ in range(12):
                statuses.append(http.post("/v1/completions", json=BODY).status_code)
                if statuses[-1] != 500:
                    break
            # Each of the first 9 fails with its forward's error; the 9th answer can reach the client just before
            # the loop gives up, so /health may still say 200 for an instant: the next request is refused (503).
            assert statuses == [500] * 9 + [503], server.log_tail()
            assert wait_for(lambda: http.get("/health").status_code == 503, timeout=10)
            health = http.get("/health")
            assert health.json()["status"] == "engine_dead"
            assert health.json()["engine_restarts"] == 2
            assert server.log_tail(100_000).count("restarting the engine loop after 3 failed steps in a row") == 2
            assert "injected fault: forward" in health.json()["error"]
            refused = http.post("/v1/completions", json=BODY)
            assert refused.status_code == 503  # fails fast now, and says why
            assert server.proc is not None and server.proc.poll() is None  # the process is alive to report it
    finally:
        server.stop()


def test_forward_failures_with_good_steps_between_never_restart(tmp_path_factory, monkeypatch) -> None:
    """Only failures in a row count: every other forward failing is a per-request problem, not a broken engine.
    (In-process, a real uvicorn server: the counting is the same, the process start is not worth it twice.)"""
    monkeypatch.setenv("IRONLM_FAULT", "forward:raise:every=2")
    engine = tiny_engine(tmp_path_factory)
    monkeypatch.delenv("IRONLM_FAULT")
    server = LiveServer(build_app(engine, served_model_name="tiny"), engine)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            body = {**BODY, "max_tokens": 1}  # one forward per request: they alternate succeed, fail
            statuses = [http.post("/v1/completions", json=body).status_code for _ in range(8)]
            assert statuses == [200, 500] * 4
            health = http.get("/health")
            assert health.status_code == 200 and health.json()["engine_restarts"] == 0
            assert health.json()["engine_step_failures_in_a_row"] == 1
    finally:
        server.stop()
