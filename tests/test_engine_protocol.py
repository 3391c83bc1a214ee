"""The written-down engine contracts (ironlm.engine.protocol) hold: the engines implement them with the same
signatures, and the servers use nothing of the async engine beyond EngineClient."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from fake_engine import FakeEngine
from ironlm.config import EngineConfig
from ironlm.engine import AsyncLLMEngine, EngineClient, LLMEngine, StepEngine
from server_utils import TINY_ENGINE_KW, tiny_model_path

SERVER_DIR = Path(__file__).resolve().parent.parent / "python" / "ironlm" / "server"


def protocol_members(proto: type) -> set[str]:
    names = {n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names | set(getattr(proto, "__annotations__", {}))


def params_of(func: object) -> list[tuple[str, inspect._ParameterKind]]:
    fn = func.fget if isinstance(func, property) else func
    if fn is None or not callable(fn):
        return []
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(("proto", "impl"), [(StepEngine, LLMEngine), (EngineClient, AsyncLLMEngine)])
def test_implementations_match_the_protocol_signatures(proto: type, impl: type) -> None:
    for name in sorted(protocol_members(proto)):
        declared = vars(proto).get(name)
        if declared is None:  # an annotated attribute: set in __init__, checked on instances below
            continue
        actual = inspect.getattr_static(impl, name, None)
        assert actual is not None, f"{impl.__name__} lacks {name}"
        if callable(declared):
            assert params_of(actual) == params_of(declared), f"{impl.__name__}.{name} differs from {proto.__name__}"
            assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(declared), name


def test_instances_satisfy_the_protocols() -> None:
    fake = FakeEngine()
    assert isinstance(fake, StepEngine)
    client = AsyncLLMEngine(fake, start=False)
    assert isinstance(client, EngineClient)
    assert client.model_config is None and client.device == "cpu"  # what a test double reports
    assert not isinstance(object(), StepEngine)  # the check is not vacuous


def test_real_engine_is_a_step_engine(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = str(tiny_model_path(tmp_path_factory))
    engine = LLMEngine(EngineConfig(model=model, device="cpu", **{**TINY_ENGINE_KW, "warmup": False}))
    assert isinstance(engine, StepEngine)
    client = AsyncLLMEngine(engine, start=False)
    assert client.model_config is engine.model_config and client.device == engine.device


def engine_attributes_used_by(path: Path) -> set[str]:
    """Attributes read off anything the server calls `engine` (a parameter, `self.engine`, `app.state.engine`)."""
    used: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "engine") or (
                isinstance(owner, ast.Attribute) and owner.attr == "engine"):
            used.add(node.attr)
    return used


def test_servers_use_only_the_engine_client_contract() -> None:
    files = sorted(SERVER_DIR.glob("*.py"))
    assert len(files) > 5
    used = {name: engine_attributes_used_by(path) for path, name in ((p, p.name) for p in files)}
    assert {"add_requests", "tokenizer", "stats"} <= set().union(*used.values())  # the walk sees real uses
    allowed = protocol_members(EngineClient)
    beyond = {name: sorted(attrs - allowed) for name, attrs in used.items() if attrs - allowed}
    assert not beyond, f"server code reads engine members that EngineClient does not declare: {beyond}"
