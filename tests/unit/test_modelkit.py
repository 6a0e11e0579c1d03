"""Tests for app.modelkit: the line protocol, and the kit serving a real model process (no mocks)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from app import modelkit, runner
from tests.conftest import modules_loaded_by

ROOT = Path(__file__).resolve().parents[2]
WARM_TOY = ROOT / "tests" / "models" / "warm_toy.py"


def _line(message: object) -> bytes:
    return (json.dumps(message) + "\n").encode()


def _job(name: str, tmp_path: Path, **params: Any) -> dict[str, Any]:
    """A valid job message for warm_toy."""
    paths = {"input": str(tmp_path / "in.png"), "output_dir": str(tmp_path / name)}
    return {"job": name, **paths, "params": params}


# -- the protocol, as pure functions ------------------------------------------------------


def test_a_request_round_trips(tmp_path: Path) -> None:
    request = modelkit.Request("j:1", tmp_path / "in.png", tmp_path / "out", {"sleep": 0.5, "name": "é"})
    assert modelkit.parse_request(request.encode()) == request
    assert request.encode().endswith(b"\n") and request.encode().count(b"\n") == 1


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (b"not json\n", "not a JSON line"),
        (b"\xff\xfe\n", "not a JSON line"),
        (b"[1, 2]\n", "not a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "not a JSON line"),
        (_line({"input": "/a", "output_dir": "/b", "params": {}}), "'job'"),
        (_line({"job": "j", "output_dir": "/b", "params": {}}), "'input'"),
        (_line({"job": "j", "input": "/a", "output_dir": 3, "params": {}}), "'output_dir'"),
        (_line({"job": "j", "input": "/a", "output_dir": "/b"}), "'params'"),
        (_line({"job": "j", "input": "/a", "output_dir": "/b", "params": [1]}), "'params'"),
        (_line({"job": "", "input": "/a", "output_dir": "/b", "params": {}}), "1 to 200"),
        (_line({"job": "j", "input": "in.png", "output_dir": "/b", "params": {}}), "absolute"),
        (b"x" * (modelkit.MAX_LINE_BYTES + 1), "line over"),
    ],
)
def test_malformed_requests_are_rejected(line: bytes, problem: str) -> None:
    with pytest.raises(modelkit.ProtocolError, match=problem):
        modelkit.parse_request(line)


@pytest.mark.parametrize(
    "reply",
    [
        modelkit.Ready("relief", 42),
        modelkit.Progress("j:1", 0.25, "meshing"),
        modelkit.Done("j:1", ("mesh.glb",)),
        modelkit.Failed("j:1", "no alpha", bad_input=True),
        modelkit.Failed("j:1", "CUDA out of memory", oom=True),
        modelkit.Failed(None, "not a JSON line", protocol=True),
    ],
)
def test_replies_round_trip(reply: modelkit.Reply) -> None:
    assert modelkit.parse_reply(modelkit.encode(reply)) == reply


@pytest.mark.parametrize(
    "message",
    [
        {"ready": False},
        {"job": "j", "progress": True},
        {"job": "j", "progress": "half"},
        {"progress": 0.5},
        {"job": "j", "done": True, "outputs": "mesh.glb"},
        {"job": "j", "done": True, "outputs": [1]},
        {"job": "j", "done": 1},
        {"job": 5, "error": "x"},
        {"job": "j", "error": "x", "oom": "yes"},
        {"job": "j", "hello": True},
        {},
    ],
)
def test_malformed_replies_are_rejected(message: dict[str, object]) -> None:
    with pytest.raises(modelkit.ProtocolError):
        modelkit.parse_reply(_line(message))


def test_reply_details() -> None:
    assert modelkit.parse_reply(b'{"job": "j", "progress": 7}') == modelkit.Progress("j", 1.0)
    assert modelkit.parse_reply(b'{"ready": true}') == modelkit.Ready("", None)
    for constant in (b"NaN", b"Infinity", b"-Infinity"):  # JavaScript's, not JSON: json.loads takes them
        with pytest.raises(modelkit.ProtocolError, match="not a JSON line"):
            modelkit.parse_reply(b'{"job": "j", "progress": ' + constant + b"}")
        with pytest.raises(modelkit.ProtocolError, match="not a JSON line"):
            modelkit.parse_request(
                b'{"job": "j", "input": "/a", "output_dir": "/b", "params": {"x": ' + constant + b"}}"
            )
    long = modelkit.encode(modelkit.Failed("j", "e" * 100_000))
    assert len(long) < modelkit.MAX_ERROR_CHARS + 100


class OutOfMemoryError(RuntimeError):
    """Named like torch's."""


def test_oom_is_recognised_by_name_text_or_cause() -> None:
    assert modelkit.is_oom(OutOfMemoryError("boom"))
    assert modelkit.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        try:
            raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")
        except RuntimeError as inner:
            raise ValueError("decoding failed") from inner
    except ValueError as outer:
        assert modelkit.is_oom(outer)
    assert not modelkit.is_oom(MemoryError("host memory"))
    assert not modelkit.is_oom(ValueError("bad image"))


def test_job_progress_is_clamped_and_nan_ignored(tmp_path: Path) -> None:
    sent: list[modelkit.Reply] = []
    job = modelkit.Job("j:1", tmp_path / "in", tmp_path / "out", {}, sent.append)
    job.progress(0.5, "half")
    job.progress(3)
    job.progress(-1, "back")
    job.progress(math.nan, "ignored")
    assert sent == [
        modelkit.Progress("j:1", 0.5, "half"),
        modelkit.Progress("j:1", 1.0, ""),
        modelkit.Progress("j:1", 0.0, "back"),
    ]


def test_a_job_shows_no_callback_in_its_repr(tmp_path: Path) -> None:
    job = modelkit.Job("j:1", tmp_path / "in", tmp_path / "out", {"k": 1}, print)
    assert (
        repr(job)
        == f"Job(id='j:1', input={tmp_path / 'in'!r}, output_dir={tmp_path / 'out'!r}, params={{'k': 1}})"
    )


def test_a_runner_imports_only_what_serving_needs() -> None:
    """Every warm runner start pays for this module's imports before its model loads: asyncio is
    the worker's side, dataclasses (with inspect) and traceback cost a start 15-20 ms of CPU."""
    loaded = modules_loaded_by("app.modelkit")
    assert "app.modelkit" in loaded
    assert not {"asyncio", "dataclasses", "inspect", "traceback"} & loaded


def test_reply_lines_frame_the_bytes_as_they_come() -> None:
    lines = modelkit.ReplyLines()
    assert lines.feed(b'{"job": "j", "pro') == [] and lines.unfinished == b'{"job": "j", "pro'
    progress, done, hello = lines.feed(b'gress": 0.5}\n{"job": "j", "done": true}\nhello\n{"job": "j"')
    assert (progress, done) == (modelkit.Progress("j", 0.5), modelkit.Done("j"))
    assert isinstance(hello, str) and hello.startswith("not a JSON line") and hello.endswith("b'hello'")
    assert lines.unfinished == b'{"job": "j"' and "unterminated" in str(lines.end())
    [cut] = lines.feed(b"\n")
    assert isinstance(cut, str) and cut.startswith("not a JSON line") and lines.end() is None
    too_long = f"a line over {modelkit.MAX_LINE_BYTES} bytes"
    assert modelkit.ReplyLines().feed(b"x" * (modelkit.MAX_LINE_BYTES + 1)) == [too_long]


# -- the kit, serving a real process ------------------------------------------------------


class Kit:
    """warm_toy as a subprocess, spoken to line by line like the worker does."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, tmp_path: Path, *args: str) -> Kit:
        env = runner.minimal_env(None, {"PYTHONPATH": str(ROOT)})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(WARM_TOY), "--loads", str(tmp_path / "loads"), *args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, cwd=tmp_path, limit=modelkit.MAX_LINE_BYTES,
        )  # fmt: skip
        return cls(proc)

    async def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()

    async def reply(self) -> modelkit.Reply:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 10)
        return modelkit.parse_reply(line)  # anything else on stdout fails the test here

    async def final(self, message: object) -> modelkit.Reply:
        """Send a job; return its final reply (progress skipped)."""
        await self.send(message if isinstance(message, bytes) else _line(message))
        while isinstance(reply := await self.reply(), modelkit.Progress):
            pass
        return reply

    async def finish(self) -> tuple[int, str]:
        """Close stdin; the exit code and all of stderr."""
        assert self.proc.stdin is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        err = await asyncio.wait_for(self.proc.stderr.read(), 10)
        return await asyncio.wait_for(self.proc.wait(), 10), err.decode()


@pytest.mark.asyncio
async def test_malformed_job_lines_get_protocol_errors_and_the_kit_keeps_serving(tmp_path: Path) -> None:
    kit = await Kit.start(tmp_path)
    ready = await kit.reply()
    assert isinstance(ready, modelkit.Ready) and ready.model == "warm_toy" and ready.pid == kit.proc.pid
    bad: list[bytes] = [
        b"not json\n",
        b"[1]\n",
        _line({"job": "a:1", "input": "/in.png"}),
        _line({**_job("b:1", tmp_path), "params": "sleep=1"}),
        _line({**_job("c:1", tmp_path), "input": "relative.png"}),
        b"x" * (modelkit.MAX_LINE_BYTES + 5000) + b"\n",
    ]
    replies = [await kit.final(line) for line in bad]
    assert all(isinstance(r, modelkit.Failed) and r.protocol for r in replies)
    jobs = [r.job for r in replies if isinstance(r, modelkit.Failed)]
    assert jobs == [None, None, "a:1", "b:1", "c:1", None]
    done = await kit.final(_job("d:1", tmp_path))
    assert done == modelkit.Done("d:1", ("out.txt",))
    assert (tmp_path / "d:1" / "out.txt").read_text().startswith("d:1 pid")
    code, err = await kit.finish()
    assert code == 0
    assert "rejected a malformed job line" in err
    assert (tmp_path / "loads").read_text().count("\n") == 1


@pytest.mark.asyncio
async def test_prints_to_stdout_go_to_stderr(tmp_path: Path) -> None:
    kit = await Kit.start(tmp_path)
    await kit.reply()
    await kit.send(_line(_job("j:1", tmp_path, junk=True)))
    replies = [await kit.reply() for _ in range(3)]  # parse_reply would fail on any junk line
    assert replies[-1] == modelkit.Done("j:1", ("out.txt",))
    code, err = await kit.finish()
    assert code == 0
    assert "warm_toy: loading (a print to stdout)" in err
    assert "junk from print()" in err and "junk from fd 1" in err


@pytest.mark.asyncio
async def test_model_errors_are_reported_and_the_kit_keeps_serving(tmp_path: Path) -> None:
    kit = await Kit.start(tmp_path)
    await kit.reply()
    bad_input = await kit.final(_job("a:1", tmp_path, bad_input=True))
    oom = await kit.final(_job("b:1", tmp_path, oom=True))
    failed = await kit.final(_job("c:1", tmp_path, fail=True))
    assert bad_input == modelkit.Failed("a:1", "the input is not what warm_toy wants", bad_input=True)
    assert isinstance(oom, modelkit.Failed) and oom.oom and not oom.bad_input
    assert failed == modelkit.Failed("c:1", "ValueError: warm_toy failed on purpose")
    assert await kit.final(_job("d:1", tmp_path)) == modelkit.Done("d:1", ("out.txt",))
    code, err = await kit.finish()
    assert code == 0
    assert "Traceback" in err and "ValueError: warm_toy failed on purpose" in err


@pytest.mark.asyncio
async def test_progress_reported_after_its_job_ended_is_dropped(tmp_path: Path) -> None:
    """A thread of the model's that reports progress once its job has ended must not put a stray
    line on stdout: the worker would take it as the runner speaking out of turn, or as the next
    job's answer, and end the runner."""
    kit = await Kit.start(tmp_path)
    await kit.reply()
    assert await kit.final(_job("a:1", tmp_path, late=True)) == modelkit.Done("a:1", ("out.txt",))
    await asyncio.sleep(0.5)  # the late report (0.2 s after the job) is made meanwhile
    await kit.send(_line(_job("b:1", tmp_path, steps=0)))
    assert await kit.reply() == modelkit.Done("b:1", ("out.txt",))
    code, _err = await kit.finish()
    assert code == 0


@pytest.mark.asyncio
async def test_a_failed_load_exits_without_ready(tmp_path: Path) -> None:
    kit = await Kit.start(tmp_path, "--fail-load")
    assert kit.proc.stdout is not None
    assert await asyncio.wait_for(kit.proc.stdout.read(), 10) == b""
    code, err = await kit.finish()
    assert code == modelkit.EXIT_LOAD_FAILED
    assert "load failed on purpose" in err


@pytest.mark.asyncio
async def test_stdin_closing_mid_job_ends_the_process(tmp_path: Path) -> None:
    kit = await Kit.start(tmp_path)
    await kit.reply()
    await kit.send(_line(_job("j:1", tmp_path, hang=True)))
    assert isinstance(await kit.reply(), modelkit.Progress)
    code, err = await kit.finish()
    assert code == modelkit.EXIT_ORPHANED
    assert "the worker is gone" in err
    with pytest.raises(ProcessLookupError):
        os.kill(kit.proc.pid, 0)


@pytest.mark.asyncio
async def test_stdin_closing_while_the_model_loads_ends_the_process_at_once(tmp_path: Path) -> None:
    """A worker killed while its runner loaded: the kit loaded on (minutes, for a large model, its
    GPU memory held beside the runner the job's next worker starts) and saw stdin closed only then.
    It now exits 0 at once, without a ready line; a worker closing it while it loads is heard too."""
    kit = await Kit.start(tmp_path, "--load-sleep", "30")
    await asyncio.sleep(0.5)  # started, and loading
    code, err = await kit.finish()  # within finish()'s 10 s, not after the 30 s load
    assert code == 0, err
    assert "stdin closed while loading" in err
    assert kit.proc.stdout is not None and await kit.proc.stdout.read() == b""


@pytest.mark.asyncio
async def test_a_job_line_still_unread_when_stdin_closes_is_not_started(tmp_path: Path) -> None:
    """docs/persistent.md: a job line still unread when stdin closes is not started; the kit exits
    0. Here the line and the hang-up both come while the kit loads. The job began before the watch
    thread (started with the read loop) had looked, ran, and was then killed as orphaned (exit 4).
    Twenty runners at once, since the thread is usually quick enough. The kit now sees the hang-up
    while it loads, and exits then, with no ready line."""

    async def one(n: int) -> tuple[int, str, list[modelkit.Reply]]:
        kit = await Kit.start(tmp_path / str(n), "--load-sleep", "0.5")
        assert kit.proc.stdin is not None and kit.proc.stdout is not None
        kit.proc.stdin.write(_line(_job("j:1", tmp_path, hang=True)))
        code, err = await kit.finish()
        return code, err, [modelkit.parse_reply(line) for line in (await kit.proc.stdout.read()).splitlines()]

    for n in range(20):
        (tmp_path / str(n)).mkdir()
    for code, err, replies in await asyncio.gather(*(one(n) for n in range(20))):
        assert code == 0, err
        assert replies == [], replies


@pytest.mark.asyncio
async def test_a_job_sent_as_stdin_closes_is_never_left_running(tmp_path: Path) -> None:
    """The worker wrote a job and went: the kit either skips the job or exits during it.

    A reader thread that saw the end of stdin before the job began would let it run for nobody
    (here: forever, since the job hangs). Five runners, to meet both orders of the race."""
    for _ in range(5):
        kit = await Kit.start(tmp_path)
        assert isinstance(await kit.reply(), modelkit.Ready)
        assert kit.proc.stdin is not None and kit.proc.stdout is not None
        kit.proc.stdin.write(_line(_job("j:1", tmp_path, hang=True)))
        code, err = await kit.finish()
        assert code in (0, modelkit.EXIT_ORPHANED), err
        replies = [modelkit.parse_reply(line) for line in (await kit.proc.stdout.read()).splitlines()]
        assert not [r for r in replies if not isinstance(r, modelkit.Progress)], replies


# -- a copy of the kit in another Python ---------------------------------------------------

COPIED_RUNNER = """
import sys
import modelkit

def handle(model, job):
    (job.output_dir / "out.txt").write_text(model + str(job.params["n"]))

sys.exit(modelkit.serve(lambda: "ran ", handle, name="copied"))
"""


def _old_pythons() -> list[Path]:
    """pyenv's Python 3.8 and 3.9 interpreters on this machine (docs/persistent.md supports 3.8+)."""
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = [max(versions.glob(f"{minor}.*"), default=None) for minor in ("3.8", "3.9")]
    return [path / "bin" / "python" for path in found if path is not None]


def _serve(argv: list[str], env: dict[str, str], requests: list[modelkit.Request], log: Path) -> list[Any]:
    """Run a runner program, send it the jobs one by one, and return each one's final reply."""
    finals: list[modelkit.Reply] = []
    with (
        log.open("wb") as stderr,
        subprocess.Popen(
            argv, cwd=log.parent, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
        ) as proc,
    ):
        assert proc.stdin is not None and proc.stdout is not None
        ready = proc.stdout.readline()
        assert ready, log.read_text()
        assert isinstance(modelkit.parse_reply(ready), modelkit.Ready)
        for request in requests:
            proc.stdin.write(request.encode())
            proc.stdin.flush()
            while isinstance(reply := modelkit.parse_reply(proc.stdout.readline()), modelkit.Progress):
                pass
            finals.append(reply)
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0, log.read_text()
    return finals


@pytest.mark.parametrize(
    "python", _old_pythons() or [None], ids=lambda p: p.parent.parent.name if p else "none"
)
def test_a_copied_kit_serves_a_job_on_python_3_8_and_3_9(python: Path | None, tmp_path: Path) -> None:
    """docs/persistent.md: a model in its own environment may carry a copy of modelkit.py (TripoSR
    supports Python 3.8+). `Reply = Ready | Progress | Done | Failed` ran at import, a TypeError
    before Python 3.10: the copied kit could not even be imported."""
    if python is None:
        pytest.skip("no pyenv Python 3.8 or 3.9 here")
    (tmp_path / "modelkit.py").write_bytes((ROOT / "app" / "modelkit.py").read_bytes())
    (tmp_path / "runner.py").write_text(COPIED_RUNNER)
    request = modelkit.Request("j:1", tmp_path / "in.png", tmp_path / "out", {"n": 7})
    argv, env = [str(python), str(tmp_path / "runner.py")], {"PATH": os.environ["PATH"]}
    assert _serve(argv, env, [request], tmp_path / "runner.log") == [modelkit.Done("j:1", ("out.txt",))]
    assert (tmp_path / "out" / "out.txt").read_text() == "ran 7"


def test_the_blur_runner_of_docs_persistent_md_works_as_shown(tmp_path: Path) -> None:
    """The doc's blur example failed a CMYK JPEG as a model error (PNG cannot hold CMYK: the runner
    was ended and the job retried), and took `radius: true` for a radius of 1."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "persistent.md").read_text(), re.S)
    [example] = [block for block in blocks if block.startswith('"""Blur an image')]
    (tmp_path / "blur.py").write_text(example)
    cmyk = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (32, 24), (10, 20, 30, 40)).save(cmyk)
    requests = [
        modelkit.Request("j:1", cmyk, tmp_path / "out1", {"radius": 2}),
        modelkit.Request("j:2", cmyk, tmp_path / "out2", {"radius": True}),
    ]
    argv, env = (
        [sys.executable, str(tmp_path / "blur.py")],
        {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)},
    )
    done, refused = _serve(argv, env, requests, tmp_path / "blur.log")
    assert done == modelkit.Done("j:1", ("blurred.png",)), (tmp_path / "blur.log").read_text()
    with Image.open(tmp_path / "out1" / "blurred.png") as blurred:
        assert (blurred.format, blurred.size) == ("PNG", (32, 24))
    assert isinstance(refused, modelkit.Failed) and refused.bad_input and "params.radius" in refused.error


def test_the_blur_models_registry_entry_of_docs_persistent_md_registers_it(tmp_path: Path) -> None:
    """The doc showed the blur runner with no registry entry: a reader had to find out that `argv`
    and `max_attempts` are required in persistent mode too, and that `radius` must be declared."""
    from app import modelsfile

    blocks = re.findall(r"```toml\n(.*?)```", (ROOT / "docs" / "persistent.md").read_text(), re.S)
    [entry] = [block for block in blocks if block.startswith("[models.blur]")]
    (tmp_path / "models.toml").write_text(entry)
    spec = modelsfile.load_registry(tmp_path / "models.toml").get("blur")
    assert spec.persistent and spec.build_serve_argv(python="py") == ["py", "/opt/models/blur.py"]
    assert spec.validate_params({"radius": 2}) == {"radius": 2}
    assert spec.validate_params({}) == {"radius": 4}


@pytest.mark.parametrize("code", [0, 3])
def test_a_model_that_calls_sys_exit_in_a_job_fails_that_job(tmp_path: Path, code: int) -> None:
    """Any exception `handle` raises other than bad input is a model error (docs/persistent.md). A
    SystemExit (a library's sys.exit(), argparse's exit on a bad argument) left the kit: the runner
    exited with its code without a word about the job. Exit 0 read, to the worker, as a runner that
    retired before it took the job (sent to another runner, a new load); any other code as a crash,
    a strike towards quarantine."""
    script = tmp_path / "exits.py"
    script.write_text(
        "import sys\n"
        "from app import modelkit\n"
        "def handle(model, job):\n"
        "    sys.exit(job.params['code'])\n"
        "sys.exit(modelkit.serve(lambda: None, handle, name='exits'))\n"
    )
    (tmp_path / "in.png").write_bytes(b"x")
    env = runner.minimal_env(None, {"PYTHONPATH": str(ROOT)})
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    assert isinstance(modelkit.parse_reply(proc.stdout.readline()), modelkit.Ready)
    proc.stdin.write(_line(_job("j0:1", tmp_path, code=code)))
    proc.stdin.flush()
    reply = proc.stdout.readline()
    proc.stdin.close()
    exited = proc.wait(timeout=10)
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()
    assert reply, f"the runner exited {exited} without answering job j0:1"
    failed = modelkit.parse_reply(reply)
    assert isinstance(failed, modelkit.Failed) and not failed.bad_input, failed
    assert failed.error == f"SystemExit: {code}", failed
