"""README's set-up commands and .ci/run stay in step."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_test_command_written_in_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"The test command it ends with is `([^`]+)`", readme)
    assert m, "README must state the test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert m.group(1) in ci, f"the README test command {m.group(1)!r} is not what .ci/run runs"


def test_readme_has_exactly_two_setup_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
    assert len(blocks) == 2, blocks
    assert "pip install torch==2.13.0" in blocks[0] and "dtrain launch --sites 3" in blocks[0]
    assert blocks[1].strip() == "bash .ci/run"
