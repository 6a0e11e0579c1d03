"""What the operator's docs show can be used as shown."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app import modelsfile

ROOT = Path(__file__).resolve().parents[2]
MODELS_DOC = ROOT / "docs" / "models.md"
TOML_BLOCKS = re.findall(r"```toml\n(.*?)```", MODELS_DOC.read_text(), re.S)


@pytest.mark.parametrize("block", TOML_BLOCKS, ids=[f"block{i}" for i in range(len(TOML_BLOCKS))])
def test_every_registry_example_in_docs_models_loads(block, tmp_path):
    """The registry example of docs/models.md used `{width_mm}` in its argv without declaring the
    parameter: copied into GPUJOBS_MODELS_FILE, it stopped the service at start."""
    path = tmp_path / "models.toml"
    path.write_text(block)
    assert modelsfile.load_registry(path).models


OPS_DOC = ROOT / "docs" / "operations.md"
APP = ROOT / "app"
# `extra={"action": "word"}`, and the runner's kills, which pass their word as an argument.
ACTION_LITERAL = re.compile(r"""["']action["']: *["']([a-z_]+)["']""")
ACTION_KILL = re.compile(r"""self\._kill\(.*, *["']([a-z_]+)["']\)$""", re.M)
ACTION_ANY = re.compile(r"""["']action["']: *""")
# The one action made at run time: `job_{state}`, the state an attempt's failure leaves (sql.FAIL).
ACTION_BUILT = {
    'f"job_{state}"': [
        f"job_{state}" for state in ("failed", "scheduled", "queued", "quarantined", "canceled")
    ]
}


def actions_logged() -> set[str]:
    """Every `action` word a log line of app/ carries. An action the code builds in a way this
    does not read fails here, for the reader to be taught it."""
    found: set[str] = set()
    for path in APP.rglob("*.py"):
        source = path.read_text()
        found |= set(ACTION_LITERAL.findall(source)) | set(ACTION_KILL.findall(source))
        for at in ACTION_ANY.finditer(source):
            rest = source[at.end() :]
            if ACTION_LITERAL.match(source, at.start()):
                continue
            built = next((words for form, words in ACTION_BUILT.items() if rest.startswith(form)), None)
            assert built is not None or rest.startswith("action"), f"{path}: an action this test cannot read"
            found |= set(built or ())
    return found


def without_parentheses(text: str) -> str:
    """`text` without what stands between parentheses (nested ones too)."""
    while (stripped := re.sub(r"\([^()]*\)", "", text)) != text:
        text = stripped
    return text


def actions_documented() -> set[str]:
    """The action words docs/operations.md lists under "Logs": the `action` row of its field table
    (its own words, not the fields named in parentheses), and the first column of the table of the
    other actions."""
    logs = OPS_DOC.read_text().split("\n## Logs\n", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in logs.splitlines() if line.startswith("| `action` |"))
    listed = set(re.findall(r"`([a-z_]+)`", without_parentheses(row.split("|")[2])))
    for words in re.findall(r"^\| ((?:`[a-z_]+`(?: / )?)+) \| [A-Z][A-Z /or]+ \|", logs, re.M):
        listed |= set(re.findall(r"`([a-z_]+)`", words))
    return listed


def test_every_action_the_code_logs_is_in_docs_operations():
    """Operators alert and search on the `action` word. docs/operations.md listed 36 of the 87 the
    code logs and ended its list with "...": `retention_failed`, `no_admin_key`, `worker_refused`,
    `unknown_setting`, `run_timed_out`, `feed_down`, `job_quarantined` and the rest were nowhere."""
    missing = actions_logged() - actions_documented()
    assert not missing, f"actions logged but not listed in docs/operations.md, Logs: {sorted(missing)}"


def test_every_action_docs_operations_lists_is_logged():
    """A word listed that no line carries is an alert that never fires."""
    stale = actions_documented() - actions_logged()
    assert not stale, f"actions listed in docs/operations.md that no code logs: {sorted(stale)}"
