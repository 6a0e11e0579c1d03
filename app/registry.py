"""The model registry: which models may run, with which parameters, argv, VRAM and outputs.

The registry is read from TOML files by `app/modelsfile.py`; this module holds what it reads into
(ModelSpec, with its ParamSpec and OutputSpec) and what the service asks of a model.

Each argv element is rendered on its own with `str.format_map`, so a value is always exactly one
argument and no shell ever sees it. Values render as: bool "true"/"false"; int in decimal; float
as `repr()` (shortest round-trip form: "100.0", "0.5", "1e-05"; always readable by `float()`).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final, Literal, TypeAlias

from app import errors

Value: TypeAlias = bool | int | float | str
ParamType = Literal["int", "float", "bool", "str"]

BUILTIN_PLACEHOLDERS: Final = frozenset({"python", "input", "output_dir"})
MAX_STR_CHARS: Final = 4096  # far below the kernel's 128 KiB limit on one argument
DEFAULT_OUTPUT_MAX_MB: Final = 512
# Job rows keep attempts and VRAM figures in 32-bit integers: larger values failed every submit.
MAX_ATTEMPTS: Final = 1000
MAX_VRAM_MB: Final = 1 << 30  # 1 PiB, far beyond any GPU; also the most an estimate reaches

# An output file name: no folder, no leading dot or dash (also what a models file may declare).
PLAIN_FILE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
_WORDS: Final = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string",
                 "list": "an array", "dict": "an object", "NoneType": "null"}  # fmt: skip
_MEDIA_TYPES: Final = {"glb": "model/gltf-binary", "gltf": "model/gltf+json", "stl": "model/stl",
                       "obj": "model/obj", "png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg",
                       "json": "application/json", "txt": "text/plain"}  # fmt: skip
MODES: Final = ("oneshot", "persistent")
# What CUDA out-of-memory looks like in a log (PyTorch, the CUDA runtime, cuBLAS, cuDNN).
DEFAULT_OOM_PATTERNS: Final = (
    r"CUDA out of memory", r"OutOfMemoryError", r"cudaErrorMemoryAllocation", r"CUBLAS_STATUS_ALLOC_FAILED",
    r"CUDNN_STATUS_ALLOC_FAILED", r"out of memory on device",
)  # fmt: skip


def render_value(value: Value) -> str:
    """The argv text of a parameter value (see the module docstring)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def media_type_for(file_name: str) -> str:
    """The media type of a result file, from its extension."""
    return _MEDIA_TYPES.get(Path(file_name).suffix[1:].lower(), "application/octet-stream")


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One model parameter: type, default (None: the request must give it), range, choices."""

    name: str
    type: ParamType
    default: Value | None = None
    min: int | float | None = None
    max: int | float | None = None
    choices: tuple[Value, ...] = ()
    description: str = ""

    def coerce(self, value: object) -> Value:
        """`value` checked against this parameter and converted to its type, else InvalidParams."""
        typed = self._typed(value)
        if isinstance(typed, int | float) and not isinstance(typed, bool):
            if self.min is not None and typed < self.min:
                raise self._invalid(f"must be at least {self.min}")
            if self.max is not None and typed > self.max:
                raise self._invalid(f"must be at most {self.max}")
        if self.choices and typed not in self.choices:
            raise self._invalid(f"must be one of {', '.join(render_value(c) for c in self.choices)}")
        return typed

    def public(self) -> dict[str, object]:
        """JSON-able description for GET /models."""
        public = {key: getattr(self, key) for key in ("type", "default", "min", "max", "description")}
        return {**public, "required": self.default is None, "choices": list(self.choices) or None}

    def _typed(self, value: object) -> Value:
        if isinstance(value, bool):  # bool is an int subclass; only a bool param takes it
            if self.type == "bool":
                return value
        elif self.type == "int" and isinstance(value, int):
            return value
        elif self.type == "float" and isinstance(value, int | float):
            try:
                number = float(value)
            except OverflowError:  # an int too big for a float
                number = math.inf
            if not math.isfinite(number):
                raise self._invalid("must be a finite number")
            return number
        elif self.type == "str" and isinstance(value, str):
            return self._safe(value)
        kind = _WORDS.get(type(value).__name__, type(value).__name__)
        raise self._invalid(f"must be {_WORDS[self.type]}, not {kind}")

    def _safe(self, value: str) -> str:
        if value.startswith("-"):
            raise self._invalid("must not start with '-'")
        if any(c in value for c in "\x00\r\n"):
            raise self._invalid("must not contain NUL or line breaks")
        if len(value) > MAX_STR_CHARS:
            raise self._invalid(f"must be at most {MAX_STR_CHARS} characters")
        return value

    def _invalid(self, problem: str) -> errors.InvalidParams:
        return errors.InvalidParams(f"params.{self.name}: {problem}", field=f"params.{self.name}")


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One file a model run must (or may) leave in its output folder."""

    name: str
    media_type: str | None = None
    required: bool = True
    max_mb: int = DEFAULT_OUTPUT_MAX_MB


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything the service needs to validate, place and run one model."""

    name: str
    description: str
    argv: tuple[str, ...]
    params: Mapping[str, ParamSpec]
    base_mb: int
    mb_per_megapixel: float
    max_vram_mb: int | None
    timeout_s: float
    max_attempts: int
    bad_input_exit_codes: frozenset[int]
    outputs: tuple[OutputSpec, ...]
    oom_exit_codes: frozenset[int] = frozenset()
    oom_patterns: tuple[str, ...] = DEFAULT_OOM_PATTERNS
    mode: str = "oneshot"  # "persistent": a warm runner loads the model once (docs/persistent.md)
    serve_argv: tuple[str, ...] = ()  # the warm runner's command; only {python} is filled in
    load_timeout_s: float = 300.0
    idle_vram_mb: int | None = None  # what a warm runner holds between jobs (default: base_mb)

    @property
    def persistent(self) -> bool:
        """Jobs run in a warm runner rather than a process each."""
        return self.mode == "persistent"

    def build_serve_argv(self, *, python: str = sys.executable) -> list[str]:
        """The warm runner's command line ({{ and }} are braces, as in argv)."""
        return [element.format_map({"python": python}) for element in self.serve_argv]

    def out_of_memory(self, exit_code: int | None, log_tail: str) -> bool:
        """Did a failed run die of GPU out-of-memory (by exit code or a line in its log)?"""
        if exit_code is not None and exit_code in self.oom_exit_codes:
            return True
        return any(re.search(pattern, log_tail) for pattern in self.oom_patterns)

    def validate_params(self, raw: Mapping[str, object]) -> dict[str, Value]:
        """Checked, typed parameters with defaults filled in; InvalidParams names the field."""
        if not isinstance(raw, Mapping):
            raise errors.InvalidParams("params: must be an object", field="params")
        for key in sorted(str(key) for key in raw if key not in self.params):
            known = ", ".join(self.params) or "none"
            raise errors.InvalidParams(
                f"params.{key}: unknown parameter (known: {known})", field=f"params.{key}"
            )
        values: dict[str, Value] = {}
        for name, spec in self.params.items():
            if name in raw:
                values[name] = spec.coerce(raw[name])
            elif spec.default is not None:
                values[name] = spec.default
            else:
                raise errors.InvalidParams(f"params.{name}: is required", field=f"params.{name}")
        self._output_names(values)  # a param that names an output is refused now, not after the run
        return values

    def estimate_vram_mb(self, megapixels: float) -> int:
        """VRAM for an input of this size: ceil(base + per-megapixel * megapixels), capped by max."""
        if not math.isfinite(megapixels) or megapixels < 0:
            raise ValueError(f"megapixels must be a finite number >= 0, got {megapixels}")
        estimate = min(self.base_mb + self.mb_per_megapixel * megapixels, MAX_VRAM_MB)  # never inf
        return math.ceil(min(estimate, self.max_vram_mb or MAX_VRAM_MB))

    def build_argv(
        self, params: Mapping[str, Value], *, input_path: Path, output_dir: Path, python: str = sys.executable
    ) -> list[str]:
        """The command line for one run (params are re-validated); for exec, never a shell."""
        values = {name: render_value(v) for name, v in self.validate_params(params).items()}
        values.update(python=python, input=str(input_path), output_dir=str(output_dir))
        return [element.format_map(values) for element in self.argv]

    def expected_outputs(self, params: Mapping[str, Value]) -> list[tuple[str, str, OutputSpec]]:
        """(file name, media type, spec) of each output for these params; names are plain."""
        names = self._output_names(self.validate_params(params))
        pairs = zip(names, self.outputs, strict=True)
        return [(name, output.media_type or media_type_for(name), output) for name, output in pairs]

    def _output_names(self, values: Mapping[str, Value]) -> list[str]:
        """The outputs' file names for these params; InvalidParams names the param that makes one
        not a plain file name (or two the same)."""
        rendered = {name: render_value(value) for name, value in values.items()}
        names: list[str] = []
        for output in self.outputs:
            name = output.name.format_map(rendered)
            if not PLAIN_FILE.fullmatch(name) or name in names:
                field = next((f"params.{p}" for p in self.params if f"{{{p}}}" in output.name), "params")
                raise errors.InvalidParams(f"{field}: gives the output file name {name!r}", field=field)
            names.append(name)
        return names

    def public(self) -> dict[str, object]:
        """JSON-able description for GET /models (no argv: that is the operator's business)."""
        vram = {
            "base_mb": self.base_mb,
            "mb_per_megapixel": self.mb_per_megapixel,
            "max_mb": self.max_vram_mb,
        }
        public = {key: getattr(self, key) for key in ("name", "description", "timeout_s", "max_attempts")}
        params = {name: spec.public() for name, spec in self.params.items()}
        return {**public, "params": params, "vram": vram, "outputs": [asdict(o) for o in self.outputs]}


@dataclass(frozen=True, slots=True)
class Registry:
    """The models this service may run, by name."""

    models: Mapping[str, ModelSpec]

    def get(self, name: str) -> ModelSpec:
        """The model called `name`; UnknownModel lists the known ones."""
        spec = self.models.get(name)
        if spec is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise errors.UnknownModel(f"model: unknown model {name!r} (known: {known})", field="model")
        return spec

    def smallest_vram_mb(self) -> int:
        """The smallest VRAM estimate of any model (for an empty input)."""
        return min(self.smallest_needs_mb().values(), default=0)

    def smallest_needs_mb(self) -> dict[str, int]:
        """Each model's VRAM estimate for an empty input: a GPU offering less never runs its jobs."""
        return {name: spec.estimate_vram_mb(0.0) for name, spec in self.models.items()}
