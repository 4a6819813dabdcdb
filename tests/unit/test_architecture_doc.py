"""docs/ARCHITECTURE.md's layout map names every module of the runtime (issue 30: ~7k lines
of it were missing from the map)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layout_block() -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    m = re.search(r"## Layout\n```\n(.*?)```", text, flags=re.S)
    assert m, "docs/ARCHITECTURE.md has no '## Layout' code block"
    return m.group(1)


def _entries(block: str) -> dict[str, str]:
    """Top-level entry (``app/``, ``diloco.py``) -> its text, continuation lines included."""
    out: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        m = re.match(r"^  (\S+)\s", line)
        if m:
            current = m.group(1)
            out[current] = line
        elif current is not None and line.startswith("    "):
            out[current] += " " + line.strip()
    return out


def test_every_runtime_module_is_in_the_layout_map() -> None:
    entries = _entries(_layout_block())
    missing = []
    for path in sorted((ROOT / "dtrain").rglob("*.py")):
        rel = path.relative_to(ROOT / "dtrain")
        if rel.parts[0] == "_proto":
            continue
        if len(rel.parts) == 1:
            if rel.name in ("__init__.py", "__main__.py"):
                if rel.name not in entries.get("__init__.py", ""):
                    missing.append(str(rel))
            elif rel.name not in entries:
                missing.append(str(rel))
            continue
        package = rel.parts[0] + "/"
        if rel.name == "__init__.py":
            if package not in entries:
                missing.append(str(rel))
            continue
        if not re.search(rf"\b{re.escape(rel.name)}\b", entries.get(package, "")):
            missing.append(str(rel))
    assert missing == [], f"docs/ARCHITECTURE.md's layout map does not name: {missing}"


def test_the_check_finds_a_missing_module() -> None:
    entries = _entries("  app/                cli.py (the CLI)\n                      worker.py\n  site.py   x\n")
    assert set(entries) == {"app/", "site.py"}
    assert "worker.py" in entries["app/"] and "launch.py" not in entries["app/"]
