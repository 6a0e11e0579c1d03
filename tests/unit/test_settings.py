"""Settings: environment variables, and bad values named at start."""

from __future__ import annotations

from pathlib import Path

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
        # A stream silent for a minute is taken for a lost connection by `gpujobs submit` (and by
        # nginx's default proxy_read_timeout): with keepalives further apart, a queued job's
        # `submit --wait` reconnected every minute, each time a failure in a row.
        ("GPUJOBS_STREAM_KEEPALIVE_S", "61", "GPUJOBS_STREAM_KEEPALIVE_S"),
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


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://postgres@127.0.0.1:99999/x", "port 99999 is not a number between 1 and 65535"),
        ("postgresql://postgres@127.0.0.1:0/x", "port 0 is not a number between 1 and 65535"),
        ("postgresql://postgres@127.0.0.1:abc/x", "cannot be read as a URL"),
        ("postgresql://[::1/x", "cannot be read as a URL"),
        ("postgresql://h/x?foo=bar", "asyncpg takes no 'foo' in the URL"),
        ("postgresql://h/x?sslmode=sometimes", "sslmode 'sometimes' is not one of"),
        ("postgresql://h/x?ssl=require&sslmode=disable", "give ssl or sslmode"),
        ("postgresql://h/x?sslmode=require&sslmode=disable", "sslmode is given twice"),
        ("postgresql://h/x?host=a,b&port=5432,99999", "port 99999 is not a number between"),
        ("postgresql://h/x?port=abc", "port abc is not a number between"),
        # Read as the password "p" and the host "ssw0rd@db": the password's tail was shown with the
        # connection's error ("cannot reach ...gpujobs:***@ssw0rd@db..."), and no word on the @.
        ("postgresql://gpujobs:p@ssw0rd@db:5432/jobs", "has an @ in its user or password: write it"),
    ],
)
def test_a_database_url_asyncpg_cannot_use_is_refused_by_name(monkeypatch, url, expected):
    """A bad port, an unclosed IPv6 bracket or a query parameter asyncpg does not take (libpq's
    `sslmode=require` among them) passed, and serve, worker and migrate crashed at their first
    connection with a traceback (OverflowError, ValueError, TypeError: unexpected keyword argument
    'sslmode'), exit 1."""
    monkeypatch.setenv("GPUJOBS_DATABASE_URL", url)
    with pytest.raises(errors.ConfigError) as caught:
        load_settings()
    message = caught.value.message
    assert message.startswith("invalid configuration: GPUJOBS_DATABASE_URL: " + expected), message
    assert "\n" not in message and "ssw0rd" not in message


@pytest.mark.parametrize("mode", ["disable", "allow", "prefer", "require", "verify-ca", "verify-full"])
def test_libpq_sslmode_is_asyncpgs_ssl(mode):
    """libpq's `sslmode` is asyncpg's `ssl` through SQLAlchemy, and `sslmode` again in the plain
    URL that LISTEN (asyncpg's DSN parser) and psql read."""
    from app import db

    url = Settings(database_url=f"postgresql://u:p@db:5432/jobs?sslmode={mode}").database_url
    assert url == f"postgresql+asyncpg://u:p@db:5432/jobs?ssl={mode}"
    assert Settings(database_url=f"postgres://u:p@db/jobs?ssl={mode}").database_url == (
        f"postgresql+asyncpg://u:p@db/jobs?ssl={mode}"
    )
    assert db.asyncpg_dsn(url) == f"postgresql://u:p@db:5432/jobs?sslmode={mode}"


def test_the_urls_the_service_makes_itself_pass():
    """The embedded server's URL (a socket folder in `host`), IPv6 and several hosts still pass."""
    for url in (
        "postgresql+asyncpg://postgres@/postgres?host=/tmp/gpujobs-pg",
        "postgresql://postgres@[::1]:5432/x",
        "postgresql://postgres@/x?host=a,b&port=5432,5433",
        "postgresql://postgres@/x?host=a:5432&host=b:5433",
        "postgresql://u:p%40x@db:5432/jobs",
        "postgresql://db/jobs?user=u&password=p&target_session_attrs=read-write",  # as libpq and asyncpg
    ):
        assert Settings(database_url=url).database_url is not None


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "postgresql://%2Fvar%2Frun%2Fpostgresql/jobs",
            "postgresql+asyncpg:///jobs?host=%2Fvar%2Frun%2Fpostgresql",
        ),
        (
            "postgresql://u:p@%2fvar%2frun%2fpostgresql:5433/jobs?sslmode=disable",
            "postgresql+asyncpg://u:p@/jobs?host=%2Fvar%2Frun%2Fpostgresql&port=5433&ssl=disable",
        ),
    ],
)
def test_libpqs_percent_encoded_socket_folder_as_the_host_is_asyncpgs_host_in_the_query(url, expected):
    """libpq reads a host that decodes to a path as a socket folder; asyncpg took the text for a
    host name (its connection failed: "[Errno -2] Name or service not known")."""
    assert Settings(database_url=url).database_url == expected


def test_a_socket_folder_given_as_the_host_and_in_the_query_is_refused(monkeypatch):
    monkeypatch.setenv("GPUJOBS_DATABASE_URL", "postgresql://%2Fa/jobs?host=/b")
    with pytest.raises(errors.ConfigError, match="a socket folder as its host and a host in its query"):
        load_settings()


def test_a_virtual_gpu_larger_than_the_claim_counts_is_refused(monkeypatch):
    """GPUJOBS_VIRTUAL_GPU_MB=1000000000000 passed: the worker stored total_mb=1e12 in workers.gpus,
    its claim then failed (int32 out of range), and every POST /jobs and GET /models answered 500
    until that row aged out. The bound is GPUJOBS_GPUS's: what PostgreSQL's integer holds, in MB."""
    from app import gpu

    monkeypatch.setenv("GPUJOBS_VIRTUAL_GPU_MB", str(gpu.MAX_GPU_MB))
    assert load_settings().virtual_gpu_mb == gpu.MAX_GPU_MB
    monkeypatch.setenv("GPUJOBS_VIRTUAL_GPU_MB", "1000000000000")
    with pytest.raises(errors.ConfigError) as caught:
        load_settings()
    expected = f"GPUJOBS_VIRTUAL_GPU_MB: Input should be less than or equal to {gpu.MAX_GPU_MB}"
    assert expected in caught.value.message, caught.value.message


@pytest.mark.parametrize(
    ("env", "value", "bound"),
    [
        # Each reaches a SQL parameter: an integer (abnormal_runs + 1 >= :quarantine_after), the
        # claim's int[] of slots, or a LIMIT and a count (bigint). These passed, and the worker died
        # at start with a traceback, or every POST /jobs answered 500.
        ("GPUJOBS_QUARANTINE_AFTER", "3000000000", 2**31 - 1),
        ("GPUJOBS_QUEUE_LIMIT", "99999999999999999999", 2**31 - 1),
        ("GPUJOBS_QUEUE_LIMIT_PER_KEY", "99999999999999999999", 2**31 - 1),
        ("GPUJOBS_MAX_JOBS_PER_GPU", "3000000000", 10_000),
        ("GPUJOBS_VRAM_BUFFER_MB", "1000000000000", 2**31 - 1),
    ],
)
def test_an_integer_past_what_the_database_holds_is_refused_by_name(monkeypatch, env, value, bound):
    monkeypatch.setenv(env, str(bound))
    load_settings()
    monkeypatch.setenv(env, value)
    with pytest.raises(errors.ConfigError) as caught:
        load_settings()
    assert f"{env}: Input should be less than or equal to {bound}" in caught.value.message, caught.value


INT_SETTINGS = sorted(name for name, field in Settings.model_fields.items() if field.annotation is int)


@pytest.mark.parametrize("name", INT_SETTINGS)
def test_every_integer_setting_has_an_upper_bound_postgresql_holds(name):
    """An integer setting without one took any size (a typo's extra zeros), and those that reach
    SQL then failed there, far from the variable; the rest are bounded alike, within PostgreSQL's
    integer, so that a new use in SQL cannot meet one too large."""
    bounds = [m.le for m in Settings.model_fields[name].metadata if getattr(m, "le", None) is not None]
    assert bounds and bounds[0] <= 2**31 - 1, name


@pytest.mark.parametrize("blank", ["", "  "])
@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_a_blank_setting_is_its_default(monkeypatch, name, blank):
    """`GPUJOBS_HOST=` (a blank line of an env file or a compose file) was the host "", and `serve`
    listened on every interface instead of 127.0.0.1; a blank GPUJOBS_STORAGE_DIR was the folder
    `.`, a blank GPUJOBS_LINK_SECRET of spaces the secret. Blank means unset, for every setting."""
    monkeypatch.setenv(f"GPUJOBS_{name.upper()}", blank)
    assert getattr(load_settings(), name) == Settings.model_fields[name].default


def test_the_default_storage_dir_is_the_checkouts_wherever_a_command_runs(monkeypatch, tmp_path):
    """The default was the relative path `storage`, taken from the current folder: `gpujobs keys
    create bob` run from $HOME (or anywhere after activating the venv) made and migrated a new,
    empty embedded database there and printed a key the running service refused (401), and
    `serve` from there started a second, empty service. The default is now the checkout's
    `storage` folder; a relative GPUJOBS_STORAGE_DIR set on purpose is still the current folder's."""
    checkout = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    assert load_settings().storage_dir == checkout / "storage"
    monkeypatch.setenv("GPUJOBS_STORAGE_DIR", "mine")
    assert load_settings().storage_dir.resolve() == tmp_path / "mine"
    assert not (tmp_path / "storage").exists()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"GPUJOBS_PRIORITY_MIN": "10"},
            "GPUJOBS_PRIORITY_MIN (10) must be at most 0, the priority of a job that asks for none",
        ),
        (
            {"GPUJOBS_PRIORITY_MAX": "-5"},
            "GPUJOBS_PRIORITY_MAX (-5) must be at least 0, the priority of a job that asks for none",
        ),
    ],
)
def test_a_priority_range_without_the_default_priority_is_refused_at_start(monkeypatch, env, expected):
    """GPUJOBS_PRIORITY_MIN=10 (or GPUJOBS_PRIORITY_MAX=-5) was taken at start; then every upload that
    asked for no priority (the README's curl, `gpujobs submit` without --priority, the web form's
    default) was refused with a 422 about a priority the user never sent."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(errors.ConfigError) as caught:
        load_settings()
    assert caught.value.message == "invalid configuration: " + expected


def test_a_misspelt_variable_is_named_with_the_setting_it_resembles():
    """GPUJOBS_PORTT=18200 was ignored without a word (pydantic-settings drops unknown names), and
    the server came up on 8000; now each GPUJOBS_* name that is no setting gets a line naming the
    closest one. The names read on purpose elsewhere are left alone."""
    from app.variables import unknown_variables

    environ = {
        "GPUJOBS_PORTT": "18200",
        "gpujobs_storage_dri": "x",  # pydantic-settings reads these names in any case
        "GPUJOBS_ZZZ": "1",
        "GPUJOBS_API_KEYS": "gpj_x",
        "GPUJOBS_PORT": "1",
        "gpujobs_port": "1",
        "GPUJOBS_URL": "http://h",
        "GPUJOBS_API_KEY": "gpj_x",
        "GPUJOBS_JOB": "j:1",
        "GPUJOBS_WORKER": "h:w",
        "GPUJOBS_RUNNER": "h:w:m:0",
        "GPUJOBS_FUZZ_EXAMPLES": "5",
        "PATH": "/bin",
    }
    assert unknown_variables(environ) == [
        "GPUJOBS_API_KEYS is not a setting (did you mean GPUJOBS_API_KEY?)",
        "GPUJOBS_PORTT is not a setting (did you mean GPUJOBS_PORT?)",
        "GPUJOBS_ZZZ is not a setting (no setting has a name like it; `python -m app.settings` lists them)",
        "gpujobs_storage_dri is not a setting (did you mean GPUJOBS_STORAGE_DIR?)",
    ]


def test_the_tests_database_url_set_for_the_service_is_said_to_be_ignored():
    """`DATABASE_URL=postgresql://... gpujobs serve` (the README's variable for the tests' server)
    ran the service on the embedded PostgreSQL without a word."""
    from app.variables import unknown_variables

    said = "DATABASE_URL is read by the tests only; the service reads GPUJOBS_DATABASE_URL"
    assert any(line.startswith(said) for line in unknown_variables({"DATABASE_URL": "postgresql://h/db"}))
    both = {"DATABASE_URL": "postgresql://h/db", "GPUJOBS_DATABASE_URL": "postgresql://h/db"}
    assert unknown_variables(both) == []


@pytest.mark.parametrize("command", ["serve", "models"])
def test_commands_that_read_the_settings_warn_of_a_misspelt_variable(command, tmp_path):
    """`GPUJOBS_PORTT=9 gpujobs serve` started on 8000 with no hint of the typo. `serve` here
    stops at once (its port is taken), after the settings were read and the warning logged."""
    import socket
    import subprocess
    import sys

    env = {"PATH": "/usr/bin:/bin", "GPUJOBS_PORTT": "9", "GPUJOBS_STORAGE_DIR": str(tmp_path)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = ["--port", str(taken.getsockname()[1])] if command == "serve" else []
        result = subprocess.run(
            [sys.executable, "-m", "app", command, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert "GPUJOBS_PORTT is not a setting (did you mean GPUJOBS_PORT?)" in result.stderr, result.stderr
    assert "WARNING" in result.stderr and result.stderr.count("GPUJOBS_PORTT") == 1, result.stderr
