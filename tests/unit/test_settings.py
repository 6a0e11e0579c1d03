"""Settings: environment variables, and bad values named at start."""

from __future__ import annotations

import pytest

from app import errors
from app.settings import Settings, load_settings


def test_defaults_and_env(monkeypatch):
    monkeypatch.setenv("GPUJOBS_MAX_UPLOAD_MB", "5")
    monkeypatch.setenv("GPUJOBS_DATABASE_URL", "postgres://u:p@db:5432/jobs")
    settings = load_settings()
    assert settings.max_upload_bytes == 5 * 1024 * 1024
    assert settings.database_url == "postgresql+asyncpg://u:p@db:5432/jobs"
    assert Settings().database_url is not None and Settings(database_url="").database_url is None


def test_an_empty_models_file_is_unset(monkeypatch):
    """`GPUJOBS_MODELS_FILE=` (as a compose file or an env file leaves it) was the path `.`, and
    the service stopped at start: "cannot be read: Is a directory". Empty means unset, as for
    GPUJOBS_DATABASE_URL."""
    monkeypatch.setenv("GPUJOBS_MODELS_FILE", "")
    assert load_settings().models_file is None
    monkeypatch.setenv("GPUJOBS_MODELS_FILE", " ")
    assert load_settings().models_file is None


@pytest.mark.parametrize(
    ("env", "value", "needle"),
    [
        ("GPUJOBS_PORT", "99999", "GPUJOBS_PORT"),
        ("GPUJOBS_LEASE_S", "-1", "GPUJOBS_LEASE_S"),
        ("GPUJOBS_DATABASE_URL", "mysql://x", "GPUJOBS_DATABASE_URL"),
        ("GPUJOBS_GPUS", "24 parsecs", "GPUJOBS_GPUS"),
        ("GPUJOBS_GPUS", "3000TiB", "GPUJOBS_GPUS: '3000TiB' is larger than"),  # past the claim's integer
        ("GPUJOBS_LOG_LEVEL", "loud", "GPUJOBS_LOG_LEVEL"),
        ("GPUJOBS_HEARTBEAT_INTERVAL_S", "60", "GPUJOBS_HEARTBEAT_INTERVAL_S (60) must be shorter than"),
        # A job's priority is a 32-bit integer in PostgreSQL, and aging adds to it: these were taken,
        # and a job asking for such a priority then failed with a 500.
        ("GPUJOBS_PRIORITY_MAX", str(2**31), "GPUJOBS_PRIORITY_MAX"),
        ("GPUJOBS_PRIORITY_MIN", str(-(2**31)), "GPUJOBS_PRIORITY_MIN"),
    ],
)
def test_bad_setting_is_named(monkeypatch, env, value, needle):
    monkeypatch.setenv(env, value)
    with pytest.raises(errors.ConfigError) as caught:
        load_settings()
    assert needle in caught.value.message


FLOAT_SETTINGS = sorted(name for name, field in Settings.model_fields.items() if field.annotation is float)


@pytest.mark.parametrize("name", FLOAT_SETTINGS)
@pytest.mark.parametrize("value", ["inf", "-inf", "Infinity", "nan"])
def test_a_setting_that_is_not_a_finite_number_is_refused(monkeypatch, name, value):
    """`inf` passed every `ge=0` check: an endless lease, retry delay or aging step then reached
    PostgreSQL as an interval it cannot hold, and the worker's loops raised until it stopped."""
    env = f"GPUJOBS_{name.upper()}"
    monkeypatch.setenv(env, value)
    with pytest.raises(errors.ConfigError) as caught:
        load_settings()
    assert env in caught.value.message and "finite" in caught.value.message


def test_cli_refuses_bad_settings_with_the_name(monkeypatch):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "app", "worker"],
        env={"PATH": "/usr/bin:/bin", "GPUJOBS_LEASE_S": "soon"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "GPUJOBS_LEASE_S" in result.stderr


def test_readme_configuration_table_is_current():
    """The README's table is `python -m app.settings`: every setting, its default and meaning."""
    from pathlib import Path

    from app.settings import markdown_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- settings-table:start -->")[1].split("<!-- settings-table:end -->")[0]
    assert block.strip() == markdown_table(), "run: python -m app.settings, and paste it into README.md"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"GPUJOBS_HEARTBEAT_INTERVAL_S": "30"},
            "GPUJOBS_HEARTBEAT_INTERVAL_S (30) must be shorter than GPUJOBS_LEASE_S (20)",
        ),
        (
            {"GPUJOBS_PRIORITY_MIN": "5", "GPUJOBS_PRIORITY_MAX": "2"},
            "GPUJOBS_PRIORITY_MIN (5) must not exceed GPUJOBS_PRIORITY_MAX (2)",
        ),
        ({"GPUJOBS_LOG_LEVEL": "loud"}, "GPUJOBS_LOG_LEVEL: must be DEBUG, INFO, WARNING or ERROR"),
        ({"GPUJOBS_GPUS": "abc"}, "GPUJOBS_GPUS: 'abc' is not a GPU size"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch, env, expected):
    """Two settings that disagree were reported as `settings: Value error, heartbeat_interval_s must
    be shorter than lease_s`: field names, not the variables an operator sets, and neither value."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(errors.ConfigError) as caught:
        load_settings()
    message = caught.value.message
    assert message.startswith("invalid configuration: " + expected), message
    assert "Value error" not in message and "\n" not in message


# Durations that reach PostgreSQL (now() ± them) or a timer, but for those with a tighter bound of
# their own. GPUJOBS_AGE_STEP_S is left out: a step longer than any wait turns aging off, and the
# aging pass allows it (tests/integration/test_scheduling.py).
DURATIONS = sorted(
    name
    for name, field in Settings.model_fields.items()
    if name.endswith("_s")
    and name != "age_step_s"
    and not any(getattr(m, "le", None) is not None and m.le < 315_360_000 for m in field.metadata)
)


@pytest.mark.parametrize("name", DURATIONS)
def test_a_duration_past_ten_years_is_refused_by_name(monkeypatch, name):
    """GPUJOBS_LEASE_S=1e12 passed (finite, positive): the reaper's `now() - dead_after` was out
    of PostgreSQL's timestamp range, it died, and the worker stopped, exit code 0. Ten years is
    accepted; more is a configuration error naming the variable and the bound."""
    env = f"GPUJOBS_{name.upper()}"
    monkeypatch.setenv(env, "315360000")
    if name == "heartbeat_interval_s":
        monkeypatch.setenv("GPUJOBS_LEASE_S", "315360000")
        monkeypatch.setenv(env, "315359999")
    load_settings()
    monkeypatch.setenv(env, "1e12" if Settings.model_fields[name].annotation is float else "1000000000000")
    with pytest.raises(errors.ConfigError) as caught:
        load_settings()
    assert f"{env}: Input should be less than or equal to 315360000" in caught.value.message, caught.value
