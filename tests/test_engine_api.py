"""The declared engine interface (engine_api.py): both implementations have every member, with the
parameters the server passes; server code asks an engine for nothing else (no capability
sniffing); the composition root carries every engine setting (word confidence was once dropped
on one path)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from nemo_serve import compose
from nemo_serve.config import Settings
from nemo_serve.engine_api import EngineAPI, interface_members

from . import helpers

PACKAGE = Path(__file__).resolve().parent.parent / "nemo_serve"


def missing_members(impl: object) -> list[str]:
    """What `impl` lacks of EngineAPI: a member, a method where one is declared, or a parameter
    of a declared method (a keyword the server passes that the implementation would refuse)."""
    problems = []
    for name in sorted(interface_members()):
        declared = inspect.getattr_static(EngineAPI, name, None)
        if not hasattr(impl, name):
            problems.append(name)
            continue
        if inspect.isfunction(declared):
            got = getattr(impl, name)
            if not callable(got):
                problems.append(f"{name} (not a method)")
                continue
            params = inspect.signature(got).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            wanted = [p for p in inspect.signature(declared).parameters if p != "self"]
            problems += [f"{name}({p})" for p in wanted if p not in params and p != "handle"]
    return problems


@pytest.fixture(scope="module")
def engine():
    return compose.in_process_engine(helpers.model(None, None), Settings.from_sources({"num_slots": 2}, {}))


@pytest.fixture
def group(engine, tmp_path):
    from nemo_serve.core.frontend_process import CoreEndpoint
    from nemo_serve.core.shared import FileLock, SharedLayout, SharedSlots

    layout, lock = SharedLayout(2, 16000), FileLock(str(tmp_path / "slots.lock"))
    shared = SharedSlots.create(layout, lock)
    try:
        endpoint = CoreEndpoint(0, "cpu", shared.name, layout, lock, str(tmp_path), 0)
        yield compose.frontend_engine(Settings.from_sources({}, {}), engine.model_info, [endpoint], frontend=0)
    finally:
        shared.close()


def test_the_interface_declares_the_server_side_api():
    assert {"open_stream", "push", "finish", "force_final", "abort", "num_free_slots", "num_open_streams",
            "queue_delay_s", "cores", "error", "model_info", "start", "stop"} <= interface_members()  # fmt: skip


def test_in_process_engine_implements_it(engine):
    assert missing_members(engine) == []
    cores = engine.cores()
    assert len(cores) == 1 and cores[0]["total_slots"] == 2 and cores[0]["free_slots"] == 2


def test_engine_cores_group_implements_it_even_for_one_core(group):
    assert missing_members(group) == []
    assert [c["core"] for c in group.cores()] == [0] and group.num_slots == 2


def test_a_member_missing_from_an_implementation_is_found(engine):
    class NoCores:
        """The in-process engine without `cores()` and with an open_stream that takes no phrases."""

        def __getattr__(self, name):
            if name == "cores":
                raise AttributeError(name)
            return getattr(engine, name)

        def open_stream(self, on_result, *, stream_id=None, language=None, endpoint=None, context_right=None):
            raise NotImplementedError

    assert sorted(missing_members(NoCores())) == ["cores", "open_stream(boost)", "open_stream(diarization)",
                                                  "open_stream(phrases)"]  # fmt: skip


def test_server_code_never_sniffs_the_engine():
    """No hasattr/getattr on an engine in the server, the front ends or the composition root:
    what an engine can do is the interface."""
    files = [*(PACKAGE / "server").glob("*.py"), *(PACKAGE / "core").glob("*.py"), PACKAGE / "compose.py",
             PACKAGE / "cli.py", PACKAGE / "ray_serve.py"]  # fmt: skip
    found = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") and node.args:
                target = ast.unparse(node.args[0])
                if "engine" in target or "client" in target or "group" in target:
                    found.append(f"{f.name}: {ast.unparse(node)}")
    assert found == []


@pytest.mark.parametrize("on", [False, True])
def test_the_composition_root_carries_word_confidence(on):
    settings = Settings.from_sources({"word_confidence": on or None, "num_slots": 1}, {})
    assert compose.engine_for(helpers.model(None, None), settings).token_confidence is on
