"""`ironlm serve`'s assembly (server/assemble.py): the engine loads and warms up on a thread of its own that exits,
so the server's main thread never runs an OpenMP region (see `_load_off_main` for the 2x it costs otherwise)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ironlm import EngineConfig, LLMEngine, SamplingParams
from ironlm.config import ServerConfig
from ironlm.server import assemble as assemble_mod
from server_utils import TINY_ENGINE_KW, tiny_model_path


def test_the_engine_loads_off_the_main_thread_then_serves(tmp_path_factory: pytest.TempPathFactory,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    loaders: list[threading.Thread] = []
    real = LLMEngine.__init__

    def init(self: LLMEngine, *args, **kwargs) -> None:
        loaders.append(threading.current_thread())
        real(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", init)
    config = EngineConfig(model=str(tiny_model_path(tmp_path_factory)), device="cpu", **TINY_ENGINE_KW)
    served = assemble_mod.assemble(config, ServerConfig())
    engine = served.engine
    try:
        assert len(loaders) == 1 and loaders[0] is not threading.main_thread()
        assert loaders[0] is not threading.current_thread() and not loaders[0].is_alive()  # it exited

        async def one() -> list[int]:
            stream = await engine.add_request(None, {"prompt_token_ids": [5, 6, 7]},
                                              SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
            out = None
            async for out in stream:
                pass
            assert out is not None
            return list(out.outputs[0].token_ids)

        assert len(asyncio.run(one())) == 4
    finally:
        asyncio.run(engine.shutdown(1.0))


def test_a_load_error_reaches_the_caller(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        assemble_mod.assemble(EngineConfig(model=str(tmp_path / "missing"), device="cpu"), ServerConfig())
