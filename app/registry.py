"""The model registry: which models may run, with which parameters, argv, VRAM and outputs.

Models come from the built-in `app/models.toml` plus an optional user file; a user model replaces
a built-in one of the same name. A broken file raises `RegistryError` naming file, model and field.

Each argv element is rendered on its own with `str.format_map`, so a value is always exactly one
argument and no shell ever sees it. Values render as: bool "true"/"false"; int in decimal; float
as `repr()` (shortest round-trip form: "100.0", "0.5", "1e-05"; always readable by `float()`).
"""

from __future__ import annotations

import math
import re
import string
import sys
import tomllib
from collections.abc import Mapping, Set
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias, TypeVar

from app import errors

Value: TypeAlias = bool | int | float | str
ParamType = Literal["int", "float", "bool", "str"]
_T = TypeVar("_T")

BUILTIN_FILE: Final = Path(__file__).with_name("models.toml")
BUILTIN_PLACEHOLDERS: Final = frozenset({"python", "input", "output_dir"})
MAX_STR_CHARS: Final = 4096  # far below the kernel's 128 KiB limit on one argument
DEFAULT_OUTPUT_MAX_MB: Final = 512
# Job rows keep attempts and VRAM figures in 32-bit integers: larger values failed every submit.
MAX_ATTEMPTS: Final = 1000
MAX_VRAM_MB: Final = 1 << 30  # 1 PiB, far beyond any GPU; also the most an estimate reaches

_MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_PARAM_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_PLAIN_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
_MEDIA_TYPE = re.compile(r"[a-z0-9][a-z0-9.+-]*/[a-z0-9][a-z0-9.+-]*")
_PARAM_TYPES: Final[dict[str, ParamType]] = {"int": "int", "float": "float", "bool": "bool", "str": "str"}
_WORDS: Final = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string",
                 "list": "an array", "dict": "an object", "NoneType": "null"}  # fmt: skip
_MEDIA_TYPES: Final = {"glb": "model/gltf-binary", "gltf": "model/gltf+json", "stl": "model/stl",
                       "obj": "model/obj", "png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg",
                       "json": "application/json", "txt": "text/plain"}  # fmt: skip
_MODEL_REQUIRED: Final = frozenset({"argv", "vram", "timeout_s", "max_attempts", "outputs"})
_MODEL_KEYS: Final = _MODEL_REQUIRED | {
    "description", "bad_input_exit_codes", "params", "oom_exit_codes", "oom_patterns",
    "mode", "serve_argv", "load_timeout_s", "idle_vram_mb", "extends",
}  # fmt: skip
MODES: Final = ("oneshot", "persistent")
# What CUDA out-of-memory looks like in a log (PyTorch, the CUDA runtime, cuBLAS, cuDNN).
DEFAULT_OOM_PATTERNS: Final = (
    r"CUDA out of memory", r"OutOfMemoryError", r"cudaErrorMemoryAllocation", r"CUBLAS_STATUS_ALLOC_FAILED",
    r"CUDNN_STATUS_ALLOC_FAILED", r"out of memory on device",
)  # fmt: skip
_VRAM_KEYS: Final = frozenset({"base_mb", "mb_per_megapixel", "max_mb"})
_PARAM_KEYS: Final = frozenset({"type", "default", "min", "max", "choices", "description"})
_OUTPUT_KEYS: Final = frozenset({"name", "media_type", "required", "max_mb"})


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
            if not abs(value) < 1e308:  # also nan, inf and ints too big for a float
                raise self._invalid("must be a finite number")
            return float(value)
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
            if not _PLAIN_FILE.fullmatch(name) or name in names:
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
        return min((spec.estimate_vram_mb(0.0) for spec in self.models.values()), default=0)


def load_registry(user_file: Path | None = None) -> Registry:
    """The built-in models, plus (replacing same-named ones) those in `user_file`."""
    models = _load_file(BUILTIN_FILE)
    if user_file is not None:
        models.update(_load_file(user_file))
    return Registry(MappingProxyType(models))


def _read_toml(path: Path) -> dict[str, object]:
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise errors.RegistryError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise errors.RegistryError(f"{path}: not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.RegistryError(f"{path}: cannot be read: {exc}") from exc


def _load_file(path: Path) -> dict[str, ModelSpec]:
    document, loader = _read_toml(path), _Loader(path)
    loader.keys(document, {"models"}, {"models"}, "")
    models: dict[str, ModelSpec] = {}
    tables = loader.of(document["models"], dict, "models", "a table")
    for name, value in tables.items():
        model = _Loader(path, name)
        model.check(bool(_MODEL_NAME.fullmatch(name)), None, f"a name must match {_MODEL_NAME.pattern}")
        models[name] = model.model(name, model.inherit(model.of(value, dict, None, "a table"), tables))
    loader.check(bool(models), "models", "defines no model")
    return models


@dataclass(frozen=True, slots=True)
class _Loader:
    """Reads one file (and one model in it); every error names the file, model and field."""

    file: Path
    model_name: str | None = None

    def error(self, field: str | None, problem: str) -> errors.RegistryError:
        model = [f"model '{self.model_name}'"] if self.model_name is not None else []
        named = [f"field '{field}'"] if field is not None else []
        return errors.RegistryError(": ".join([str(self.file), *model, *named, problem]))

    def check(self, ok: bool, field: str | None, problem: str) -> None:
        if not ok:
            raise self.error(field, problem)

    def model(self, name: str, table: dict[str, object]) -> ModelSpec:
        self.keys(table, _MODEL_KEYS, _MODEL_REQUIRED, "")
        tables = self.of(table.get("params", {}), dict, "params", "a table")
        params = {param_name: self.param(param_name, value) for param_name, value in tables.items()}
        vram = self.of(table["vram"], dict, "vram", "a table")
        self.keys(vram, _VRAM_KEYS, {"base_mb"}, "vram")
        base_mb = int(self.number(vram["base_mb"], "vram.base_mb", integer=True, high=MAX_VRAM_MB))
        max_mb, max_vram = vram.get("max_mb"), None
        if max_mb is not None:
            max_vram = int(self.number(max_mb, "vram.max_mb", True, max(base_mb, 1), high=MAX_VRAM_MB))
        return ModelSpec(
            name=name,
            description=self.of(table.get("description", ""), str, "description", "a string"),
            argv=self.argv(table["argv"], params),
            params=MappingProxyType(params),
            base_mb=base_mb,
            mb_per_megapixel=float(
                self.number(vram.get("mb_per_megapixel", 0), "vram.mb_per_megapixel", high=MAX_VRAM_MB)
            ),
            max_vram_mb=max_vram,
            timeout_s=float(self.number(table["timeout_s"], "timeout_s", above=True)),
            max_attempts=int(
                self.number(table["max_attempts"], "max_attempts", integer=True, low=1, high=MAX_ATTEMPTS)
            ),
            bad_input_exit_codes=self.exit_codes(table.get("bad_input_exit_codes", [])),
            outputs=self.outputs(table["outputs"], params),
            oom_exit_codes=self.exit_codes(table.get("oom_exit_codes", []), "oom_exit_codes"),
            oom_patterns=self.patterns(table.get("oom_patterns", list(DEFAULT_OOM_PATTERNS))),
            **self.warm(table),
        )

    def inherit(self, table: dict[str, object], tables: Mapping[str, object]) -> dict[str, object]:
        """`extends = "other"`: the other model's fields (same file), overridden by this table's;
        `params` one level deeper, parameter by parameter. The tables are read, never changed:
        whether a model extends another is seen as written, whichever of them was loaded first."""
        base = table.get("extends")
        if base is None:
            return table
        parent = tables.get(base) if isinstance(base, str) else None
        self.check(
            isinstance(parent, dict) and "extends" not in parent,
            "extends",
            "must name another model of this file that extends nothing",
        )
        assert isinstance(parent, dict)
        merged = {**parent, **{key: value for key, value in table.items() if key != "extends"}}
        # Redefining one parameter keeps the others: a child's argv still names them all.
        own, inherited = table.get("params"), parent.get("params")
        if isinstance(own, dict) and isinstance(inherited, dict):
            merged["params"] = {**inherited, **own}
        return merged

    def warm(self, table: Mapping[str, object]) -> dict[str, Any]:
        """mode, serve_argv, load_timeout_s and idle_vram_mb, checked together."""
        mode = table.get("mode", "oneshot")
        self.check(mode in MODES, "mode", f"must be one of {', '.join(MODES)}")
        serve = table.get("serve_argv", [])
        ok = isinstance(serve, list) and all(isinstance(item, str) for item in serve)
        self.check(
            ok and (mode != "persistent" or bool(serve)),
            "serve_argv",
            "must be a non-empty array of strings for a persistent model",
        )
        for index, element in enumerate(serve if isinstance(serve, list) else []):
            self.template(element, f"serve_argv[{index}]", {"python"})
        idle = table.get("idle_vram_mb")
        idle_mb = None if idle is None else int(self.number(idle, "idle_vram_mb", True, high=MAX_VRAM_MB))
        return {
            "mode": mode,
            "serve_argv": tuple(serve) if isinstance(serve, list) else (),
            "load_timeout_s": float(
                self.number(table.get("load_timeout_s", 300), "load_timeout_s", above=True)
            ),
            "idle_vram_mb": idle_mb,
        }

    def param(self, name: str, value: object) -> ParamSpec:
        at = f"params.{name}"
        self.check(bool(_PARAM_NAME.fullmatch(name)), at, f"a name must match {_PARAM_NAME.pattern}")
        self.check(name not in BUILTIN_PLACEHOLDERS, at, "python, input and output_dir are reserved names")
        table = self.of(value, dict, at, "a table")
        self.keys(table, _PARAM_KEYS, {"type"}, at)
        kind = _PARAM_TYPES.get(table["type"]) if isinstance(table["type"], str) else None
        if kind is None:
            raise self.error(f"{at}.type", f"must be one of int, float, bool, str, not {table['type']!r}")
        low, high = (self.bound(table, kind, f"{at}.{key}") for key in ("min", "max"))
        self.check(low is None or high is None or low <= high, f"{at}.min", f"must not be above max ({high})")
        description = self.of(table.get("description", ""), str, f"{at}.description", "a string")
        spec = ParamSpec(name, kind, None, low, high, (), description)
        if "choices" in table:
            spec = replace(spec, choices=self.choices(spec, table["choices"]))
        if "default" in table:
            spec = replace(spec, default=self.checked(spec, table["default"], f"{at}.default"))
        return spec

    def bound(self, table: dict[str, object], kind: ParamType, field: str) -> int | float | None:
        key = field.rpartition(".")[2]
        if key not in table:
            return None
        self.check(kind in ("int", "float"), field, "only int and float parameters have one")
        return self.number(table[key], field, kind == "int", -math.inf)

    def choices(self, spec: ParamSpec, value: object) -> tuple[Value, ...]:
        at = f"params.{spec.name}.choices"
        if spec.type == "bool" or not isinstance(value, list) or not value:
            raise self.error(at, "must be a non-empty array (and bool parameters have none)")
        choices = tuple(self.checked(spec, item, at) for item in value)
        self.check(len(set(choices)) == len(choices), at, "lists a value twice")
        return choices

    def checked(self, spec: ParamSpec, value: object, field: str) -> Value:
        try:
            return spec.coerce(value)
        except errors.InvalidParams as exc:
            raise self.error(field, exc.message.partition(": ")[2]) from None

    def argv(self, value: object, params: Mapping[str, ParamSpec]) -> tuple[str, ...]:
        if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
            raise self.error("argv", "must be a non-empty array of strings")
        for index, element in enumerate(value):
            self.template(element, f"argv[{index}]", BUILTIN_PLACEHOLDERS | params.keys())
        return tuple(value)

    def template(self, template: str, field: str, known: Set[str]) -> str:
        """`template` with every placeholder replaced by "x", once each is a known plain `{name}`."""
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise self.error(field, f"{template!r}: {exc} (write {{{{ and }}}} for braces)") from None
        for _, name, spec, conversion in parsed:
            if name is not None and (spec or conversion or name not in known):
                listed = ", ".join(f"{{{k}}}" for k in sorted(known)) or "none"
                raise self.error(field, f"{template!r}: placeholders must be plain and one of {listed}")
        return "".join(text + ("x" if name is not None else "") for text, name, _, _ in parsed)

    def outputs(self, value: object, params: Mapping[str, ParamSpec]) -> tuple[OutputSpec, ...]:
        if not isinstance(value, list) or not value:
            raise self.error("outputs", "must be a non-empty array of tables ([[models.<name>.outputs]])")
        outputs = tuple(self.output(f"outputs[{i}]", item, params) for i, item in enumerate(value))
        self.check(len({output.name for output in outputs}) == len(outputs), "outputs", "repeats a name")
        return outputs

    def output(self, at: str, value: object, params: Mapping[str, ParamSpec]) -> OutputSpec:
        table = self.of(value, dict, at, "a table")
        self.keys(table, _OUTPUT_KEYS, {"name"}, at)
        name = self.of(table["name"], str, f"{at}.name", "a string")
        skeleton = self.template(name, f"{at}.name", params.keys())
        self.check(bool(_PLAIN_FILE.fullmatch(skeleton)), f"{at}.name", "must be a plain file name")
        media_type = table.get("media_type")
        if media_type is not None and not (isinstance(media_type, str) and _MEDIA_TYPE.fullmatch(media_type)):
            raise self.error(f"{at}.media_type", "must be a media type such as model/gltf-binary")
        required = self.of(table.get("required", True), bool, f"{at}.required", "true or false")
        max_mb = self.number(table.get("max_mb", DEFAULT_OUTPUT_MAX_MB), f"{at}.max_mb", True, 1)
        return OutputSpec(name, media_type, required, int(max_mb))

    def exit_codes(self, value: object, field: str = "bad_input_exit_codes") -> frozenset[int]:
        codes = value if isinstance(value, list) else [None]
        if any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 255 for c in codes):
            raise self.error(field, "must be an array of exit codes from 1 to 255")
        return frozenset(codes)

    def patterns(self, value: object) -> tuple[str, ...]:
        items = self.of(value, list, "oom_patterns", "an array of regular expressions")
        for item in items:
            try:
                re.compile(self.of(item, str, "oom_patterns", "an array of regular expressions"))
            except re.error as exc:
                raise self.error("oom_patterns", f"{item!r} is not a regular expression ({exc})") from exc
        return tuple(items)

    def keys(self, table: Mapping[str, object], allowed: Set[str], required: Set[str], at: str) -> None:
        listed = ", ".join(sorted(allowed))
        for key in table:
            self.check(key in allowed, f"{at}.{key}".lstrip("."), f"unknown field (allowed: {listed})")
        for key in sorted(required - table.keys()):
            raise self.error(f"{at}.{key}".lstrip("."), "is required")

    def of(self, value: object, kind: type[_T], field: str | None, words: str) -> _T:
        if not isinstance(value, kind):
            raise self.error(field, f"must be {words}")
        return value

    def number(
        self,
        value: object,
        field: str,
        integer: bool = False,
        low: float = 0,
        above: bool = False,
        high: float = math.inf,
    ) -> int | float:
        kind = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
            raise self.error(field, f"must be {kind}")
        self.check(math.isfinite(value), field, f"must be {kind}, not {value}")
        bad = value <= low if above else value < low
        self.check(not bad, field, f"must be {kind} {'above' if above else 'of at least'} {low:g}")
        self.check(value <= high, field, f"must be {kind} of at most {high:.12g}")
        return value
