"""The API uses the engine only through EngineClient (server/engine/engine_client.py), and LLMEngine provides
all of it: read from the code, so a new reach into the engine's insides (its scheduler, worker, args) fails
here instead of tying the two programs together unseen."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE_NAMES = {"engine"}          # a variable or attribute named engine (self.engine, serving.engine, engine)


def client_members() -> set[str]:
    tree = ast.parse((REPO / "server/engine/engine_client.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineClient"]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)} | \
           {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def _is_engine(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in ENGINE_NAMES) or \
           (isinstance(node, ast.Attribute) and node.attr in ENGINE_NAMES)


def engine_uses(folder: Path) -> dict[str, set[str]]:
    """Attribute name -> the files that read it off an engine."""
    uses: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _is_engine(node.value):
                uses.setdefault(node.attr, set()).add(str(path.relative_to(REPO)))
    return uses


def llm_engine_members() -> set[str]:
    tree = ast.parse((REPO / "server/engine/llm_engine.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine"]
    members = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    members.add(t.attr)
    return members


def test_the_scanner_sees_an_engine_reach():
    uses = engine_uses(REPO / "server" / "api")
    assert "add_request" in uses and "input_processor" in uses   # what the API does use, it finds


def test_the_api_names_nothing_of_the_engine_beyond_the_client():
    beyond = {name: files for name, files in engine_uses(REPO / "server" / "api").items()
              if name not in client_members()}
    # the engine loop's own wrapper (AsyncEngine) is itself held as `async_engine`, not `engine`
    assert beyond == {}, f"the API reads these off the engine, outside EngineClient: {beyond}"


def test_the_offline_llm_uses_only_the_client():
    tree = ast.parse((REPO / "server/engine/llm.py").read_text())
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _is_engine(n.value)}
    assert used and used <= client_members(), used - client_members()


def test_llm_engine_provides_the_whole_client():
    missing = client_members() - llm_engine_members()
    assert not missing, missing
