"""Model registry: loading and validating TOML, parameters, argv, outputs and VRAM estimates."""

from __future__ import annotations

import math
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from app import errors, modelsfile, registry

TINY = """
[models.tiny]
description = "A test model"
argv = ["{python}", "-c", "pass", "{input}", "{output_dir}", "--steps={steps}", "{label}"]
vram = { base_mb = 100, mb_per_megapixel = 10.5, max_mb = 1000 }
timeout_s = 5
max_attempts = 2
bad_input_exit_codes = [65]

[models.tiny.params.steps]
type = "int"
min = 1
max = 50
default = 10

[models.tiny.params.label]
type = "str"
default = "plain"

[models.tiny.params.scale]
type = "float"
min = 0.5
max = 2
default = 1

[models.tiny.params.fast]
type = "bool"
default = false

[models.tiny.params.kind]
type = "str"
choices = ["a", "b"]

[[models.tiny.outputs]]
name = "out-{kind}.json"

[[models.tiny.outputs]]
name = "log.txt"
media_type = "text/x-log"
required = false
max_mb = 1
"""

WriteFile = Callable[[str], Path]


@pytest.fixture
def write_file(tmp_path: Path) -> WriteFile:
    """Write TOML text to models.toml in a temporary folder and return its path."""

    def write(text: str) -> Path:
        path = tmp_path / "models.toml"
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    return write


@pytest.fixture
def tiny(write_file: WriteFile) -> registry.ModelSpec:
    """The `tiny` model from a user file."""
    return modelsfile.load_registry(write_file(TINY)).get("tiny")


def test_builtin_registry_has_relief() -> None:
    models = modelsfile.load_registry()
    relief = models.get("relief")
    assert relief.timeout_s == 600
    assert relief.max_attempts == 3
    assert relief.bad_input_exit_codes == frozenset({64, 65})
    assert relief.estimate_vram_mb(0) == 1024
    assert models.smallest_vram_mb() == 1024
    assert list(relief.params) == [
        "format", "width_mm", "depth_mm", "base_mm", "resolution", "invert", "smoothing", "mask",
    ]  # fmt: skip
    assert "device" not in relief.params


def test_relief_argv_with_defaults() -> None:
    relief = modelsfile.load_registry().get("relief")
    argv = relief.build_argv({}, input_path=Path("/in/a.png"), output_dir=Path("/out"), python="py")
    assert argv == [
        "py", "-m", "app.relief", "--input", "/in/a.png", "--output-dir", "/out", "--format", "glb",
        "--width-mm", "100.0", "--depth-mm", "5.0", "--base-mm", "2.0", "--resolution", "256",
        "--invert", "false", "--smoothing", "1.0", "--mask", "auto", "--device", "auto",
    ]  # fmt: skip
    assert relief.expected_outputs({"format": "stl"})[0][:2] == ("mesh.stl", "model/stl")


def test_user_file_adds_a_model(write_file: WriteFile) -> None:
    models = modelsfile.load_registry(write_file(TINY))
    assert set(models.models) == {"relief", "relief-warm", "tiny"}
    assert models.smallest_vram_mb() == 100


def test_user_file_replaces_a_builtin_model(write_file: WriteFile) -> None:
    models = modelsfile.load_registry(write_file(TINY.replace("models.tiny", "models.relief")))
    assert models.get("relief").description == "A test model"
    assert "format" not in models.get("relief").params


def test_unknown_model_lists_known_ones() -> None:
    with pytest.raises(errors.UnknownModel) as caught:
        modelsfile.load_registry().get("tripo")
    assert "'tripo'" in caught.value.message and "relief" in caught.value.message
    assert caught.value.field == "model"


def test_missing_user_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(errors.RegistryError) as caught:
        modelsfile.load_registry(missing)
    # The setting it came from, too: an env file or a compose file may have set it long ago.
    assert caught.value.message == f"GPUJOBS_MODELS_FILE: {missing}: file not found"


def test_toml_syntax_error_names_file_and_line(write_file: WriteFile) -> None:
    with pytest.raises(errors.RegistryError) as caught:
        modelsfile.load_registry(write_file('[models.x]\nargv = ["a"\ntimeout_s = 1\n'))
    assert "models.toml" in caught.value.message
    assert "line 3" in caught.value.message


def _broken(old: str, new: str) -> str:
    assert old in TINY, old
    return TINY.replace(old, new, 1)


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        (_broken("timeout_s = 5", "timeout_s = 0"), "timeout_s", "above 0"),
        (_broken("timeout_s = 5", 'timeout_s = "5"'), "timeout_s", "a number"),
        (_broken("timeout_s = 5\n", ""), "timeout_s", "required"),
        (_broken("max_attempts = 2", "max_attempts = 0"), "max_attempts", "at least 1"),
        (_broken("max_attempts = 2", "max_attempts = true"), "max_attempts", "an integer"),
        (_broken("max_attempts = 2", "max_attempts = 3000000000"), "max_attempts", "at most 1000"),
        (_broken("base_mb = 100", "base_mb = 3000000000"), "vram.base_mb", "at most 1073741824"),
        (_broken("max_mb = 1000", "max_mb = 3000000000"), "vram.max_mb", "at most 1073741824"),
        (
            _broken("mb_per_megapixel = 10.5", "mb_per_megapixel = 1e300"),
            "vram.mb_per_megapixel",
            "at most 1073741824",
        ),
        (_broken("timeout_s = 5", "timeout_s = 5\ntimeout = 5"), "timeout", "unknown field"),
        (_broken('argv = ["{python}"', 'argv = ["{pyhton}"'), "argv[0]", "{pyhton}"),
        (_broken('"--steps={steps}"', '"--steps={steps!r}"'), "argv[5]", "placeholder"),
        (_broken('"--steps={steps}"', '"--steps={steps"'), "argv[5]", "braces"),
        (_broken('argv = ["{python}", "-c"', 'argv = [1, "-c"'), "argv", "strings"),
        # The program is the operator's: a request's parameter there would choose what runs.
        (_broken('argv = ["{python}"', 'argv = ["{label}"'), "argv[0]", "a request would choose the program"),
        (_broken('argv = ["{python}"', 'argv = ["/opt/{label}"'), "argv[0]", "must not hold a parameter"),
        (_broken('argv = ["{python}"', 'argv = [" "'), "argv[0]", "must name the program to run"),
        (_broken("base_mb = 100", "base_mb = -1"), "vram.base_mb", "at least 0"),
        (_broken("base_mb = 100, ", ""), "vram.base_mb", "required"),
        (_broken("mb_per_megapixel = 10.5", "mb_per_megapixel = -1"), "vram.mb_per_megapixel", "at least 0"),
        (_broken("max_mb = 1000", "max_mb = 50"), "vram.max_mb", "at least 100"),
        (_broken("max_mb = 1000", "maxmb = 1000"), "vram.maxmb", "unknown field"),
        (
            _broken("bad_input_exit_codes = [65]", "bad_input_exit_codes = [0]"),
            "bad_input_exit_codes",
            "1 to 255",
        ),
        (_broken('type = "int"', 'type = "integer"'), "params.steps.type", "int, float, bool, str"),
        (_broken("min = 1\n", "min = 1.5\n"), "params.steps.min", "an integer"),
        (_broken("max = 50", "max = 0"), "params.steps.min", "above max"),
        (_broken("default = 10", "default = 99"), "params.steps.default", "at most 50"),
        (_broken("default = 10", 'default = "10"'), "params.steps.default", "an integer, not a string"),
        (_broken('default = "plain"', 'default = "--rm"'), "params.label.default", "'-'"),
        (_broken("default = false", "default = 0"), "params.fast.default", "a boolean"),
        (_broken('choices = ["a", "b"]', 'choices = ["a", "a"]'), "params.kind.choices", "twice"),
        (_broken('choices = ["a", "b"]', "choices = []"), "params.kind.choices", "non-empty"),
        (
            _broken('type = "str"\ndefault = "plain"', 'type = "str"\ndefault = "plain"\nhelp = "x"'),
            "params.label.help",
            "unknown field",
        ),
        (_broken("[models.tiny.params.label]", "[models.tiny.params.Label]"), "params.Label", "must match"),
        (_broken("[models.tiny.params.label]", "[models.tiny.params.input]"), "params.input", "reserved"),
        (_broken('name = "out-{kind}.json"', 'name = "out-{knd}.json"'), "outputs[0].name", "{knd}"),
        (_broken('name = "out-{kind}.json"', 'name = "../out.json"'), "outputs[0].name", "plain file"),
        (_broken('name = "out-{kind}.json"', 'name = "log.txt"'), "outputs", "repeats"),
        (_broken('media_type = "text/x-log"', 'media_type = "log"'), "outputs[1].media_type", "media type"),
        (_broken("required = false", 'required = "no"'), "outputs[1].required", "true or false"),
        (_broken("max_mb = 1\n", "max_mb = 0\n"), "outputs[1].max_mb", "at least 1"),
        (_broken("max_mb = 1\n", "max_mb = 1\nsize = 2\n"), "outputs[1].size", "unknown field"),
        (TINY.split("[[models.tiny.outputs]]")[0], "outputs", "required"),
    ],
)
def test_broken_file_names_file_model_and_field(
    write_file: WriteFile, text: str, field: str, words: str
) -> None:
    with pytest.raises(errors.RegistryError) as caught:
        modelsfile.load_registry(write_file(text))
    message = caught.value.message
    assert "models.toml: model 'tiny': " in message
    assert f"field '{field}': " in message
    assert words in message


def test_a_models_file_an_editor_began_with_a_byte_order_mark_is_read(write_file: WriteFile) -> None:
    """Saved "UTF-8 with BOM" (Windows editors), it was refused: "Invalid statement (at line 1, column 1)"."""
    path = write_file(TINY)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert modelsfile.load_registry(path).get("tiny").name == "tiny"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[models.Tiny]\nargv = ['x']\n", "model 'Tiny': a name must match"),
        ("[model.tiny]\n", "field 'model': unknown field"),
        ("title = 'x'\n", "field 'title': unknown field"),
        ("[models]\n", "field 'models': defines no model"),
        ("models = 3\n", "field 'models': must be a table"),
    ],
)
def test_broken_file_structure(write_file: WriteFile, text: str, words: str) -> None:
    with pytest.raises(errors.RegistryError) as caught:
        modelsfile.load_registry(write_file(text))
    assert "models.toml: " in caught.value.message
    assert words in caught.value.message


def test_validate_params_fills_defaults(tiny: registry.ModelSpec) -> None:
    values = tiny.validate_params({"kind": "a", "scale": 2})
    assert values == {"steps": 10, "label": "plain", "scale": 2.0, "fast": False, "kind": "a"}
    assert isinstance(values["scale"], float)


@pytest.mark.parametrize(
    ("raw", "field", "words"),
    [
        ({"kind": "a", "stepz": 3}, "params.stepz", "unknown parameter"),
        ({}, "params.kind", "required"),
        ({"kind": "c"}, "params.kind", "one of a, b"),
        ({"kind": "a", "steps": "5"}, "params.steps", "an integer, not a string"),
        ({"kind": "a", "steps": 5.0}, "params.steps", "an integer, not a number"),
        ({"kind": "a", "steps": True}, "params.steps", "an integer, not a boolean"),
        ({"kind": "a", "scale": True}, "params.scale", "a number, not a boolean"),
        ({"kind": "a", "fast": 1}, "params.fast", "a boolean, not an integer"),
        ({"kind": "a", "fast": "true"}, "params.fast", "a boolean, not a string"),
        ({"kind": "a", "steps": None}, "params.steps", "not null"),
        ({"kind": "a", "steps": 0}, "params.steps", "at least 1"),
        ({"kind": "a", "steps": 51}, "params.steps", "at most 50"),
        ({"kind": "a", "scale": 2.01}, "params.scale", "at most 2"),
        ({"kind": "a", "scale": float("nan")}, "params.scale", "finite"),
        ({"kind": "a", "scale": 10**400}, "params.scale", "finite"),
        ({"kind": "a", "label": "--output=/etc"}, "params.label", "'-'"),
        ({"kind": "a", "label": "two\nlines"}, "params.label", "line breaks"),
        ({"kind": "a", "label": "nul\x00"}, "params.label", "NUL"),
        ({"kind": "a", "label": "x" * 5000}, "params.label", "at most 4096"),
        ({"kind": "a", "label": ["x"]}, "params.label", "a string, not an array"),
    ],
)
def test_validate_params_rejects(
    tiny: registry.ModelSpec, raw: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(errors.InvalidParams) as caught:
        tiny.validate_params(raw)
    assert caught.value.field == field
    assert caught.value.message.startswith(f"{field}: ")
    assert words in caught.value.message


@pytest.mark.parametrize("value", [1e308, 1.5e308, sys.float_info.max, -sys.float_info.max, 10**308, 5e-324])
def test_a_float_without_bounds_takes_every_finite_number(value: float) -> None:
    """Numbers from 1e308 up to the largest float were refused as "not a finite number" (the check
    was `abs(value) < 1e308`), though 10**308 written as an integer was taken."""
    assert registry.ParamSpec("x", "float").coerce(value) == float(value)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 10**309, -(10**400)])
def test_a_float_that_is_not_finite_is_refused(value: float) -> None:
    with pytest.raises(errors.InvalidParams, match=r"params\.x: must be a finite number"):
        registry.ParamSpec("x", "float").coerce(value)


def test_build_argv_keeps_each_value_one_argument(tiny: registry.ModelSpec) -> None:
    label = "a b; rm -rf / $(x) {steps} 'q'"
    argv = tiny.build_argv(
        {"kind": "b", "label": label, "steps": 7},
        input_path=Path("/in dir/img one.png"),
        output_dir=Path("/out dir"),
        python="/usr/bin/python3",
    )
    assert argv == ["/usr/bin/python3", "-c", "pass", "/in dir/img one.png", "/out dir", "--steps=7", label]


def test_build_argv_renders_values_and_defaults_to_this_python(tiny: registry.ModelSpec) -> None:
    argv = tiny.build_argv({"kind": "a"}, input_path=Path("i"), output_dir=Path("o"))
    assert argv[0] == sys.executable
    assert [registry.render_value(v) for v in (True, False, 3, 2.5, 100.0, 1e-05, "s")] == [
        "true", "false", "3", "2.5", "100.0", "1e-05", "s",
    ]  # fmt: skip
    assert float(registry.render_value(1e-05)) == 1e-05


def test_build_argv_revalidates(tiny: registry.ModelSpec) -> None:
    with pytest.raises(errors.InvalidParams):
        tiny.build_argv({"kind": "a", "label": "-x"}, input_path=Path("i"), output_dir=Path("o"))


def test_expected_outputs(tiny: registry.ModelSpec) -> None:
    outputs = tiny.expected_outputs({"kind": "b"})
    assert [(name, media_type) for name, media_type, _ in outputs] == [
        ("out-b.json", "application/json"),
        ("log.txt", "text/x-log"),
    ]
    assert outputs[1][2] == registry.OutputSpec("log.txt", "text/x-log", required=False, max_mb=1)
    assert outputs[0][2].required and outputs[0][2].max_mb == 512


def test_expected_outputs_rejects_names_that_leave_the_folder(write_file: WriteFile) -> None:
    text = _broken('name = "out-{kind}.json"', 'name = "out-{label}.json"')
    spec = modelsfile.load_registry(write_file(text)).get("tiny")
    with pytest.raises(errors.InvalidParams) as caught:
        spec.expected_outputs({"kind": "a", "label": "x/../../etc"})
    assert caught.value.field == "params.label"


@pytest.mark.parametrize(
    ("name", "media_type"),
    [
        ("m.glb", "model/gltf-binary"), ("m.GLTF", "model/gltf+json"), ("m.stl", "model/stl"),
        ("m.obj", "model/obj"), ("m.png", "image/png"), ("m.jpg", "image/jpeg"),
        ("m.json", "application/json"), ("m.txt", "text/plain"), ("m.ply", "application/octet-stream"),
        ("glb", "application/octet-stream"),
    ],
)  # fmt: skip
def test_media_type_for(name: str, media_type: str) -> None:
    assert registry.media_type_for(name) == media_type


def test_estimate_vram_mb(tiny: registry.ModelSpec) -> None:
    assert tiny.estimate_vram_mb(0) == 100
    assert tiny.estimate_vram_mb(2) == 121
    assert tiny.estimate_vram_mb(0.1) == 102  # 101.05 rounds up
    assert tiny.estimate_vram_mb(1000) == 1000  # capped by max_mb
    with pytest.raises(ValueError):
        tiny.estimate_vram_mb(-1)


def test_an_estimate_never_exceeds_what_a_job_row_holds(write_file: WriteFile) -> None:
    steep = _broken("mb_per_megapixel = 10.5, max_mb = 1000", "mb_per_megapixel = 1073741824")
    spec = modelsfile.load_registry(write_file(steep)).get("tiny")
    assert spec.estimate_vram_mb(1000) == registry.MAX_VRAM_MB < 2**31


def test_public_description_is_json(tiny: registry.ModelSpec) -> None:
    import json

    public = json.loads(json.dumps(tiny.public()))
    assert public["name"] == "tiny"
    assert public["vram"] == {"base_mb": 100, "mb_per_megapixel": 10.5, "max_mb": 1000}
    assert public["params"]["kind"] == {
        "type": "str", "default": None, "min": None, "max": None, "description": "",
        "required": True, "choices": ["a", "b"],
    }  # fmt: skip
    assert public["outputs"][1] == {
        "name": "log.txt",
        "media_type": "text/x-log",
        "required": False,
        "max_mb": 1,
    }
    assert "argv" not in public


def test_specs_are_frozen(tiny: registry.ModelSpec) -> None:
    with pytest.raises(TypeError):
        tiny.params["x"] = tiny.params["kind"]  # type: ignore[index]
    with pytest.raises(AttributeError):
        tiny.timeout_s = 1  # type: ignore[misc]


def test_persistent_model_fields_and_extends(write_file: WriteFile) -> None:
    text = (
        TINY
        + """
[models.tiny-warm]
extends = "tiny"
mode = "persistent"
serve_argv = ["{python}", "-m", "tiny", "--serve"]
load_timeout_s = 30
idle_vram_mb = 64
"""
    )
    warm = modelsfile.load_registry(write_file(text)).get("tiny-warm")
    assert warm.persistent and warm.load_timeout_s == 30 and warm.idle_vram_mb == 64
    assert warm.build_serve_argv(python="py") == ["py", "-m", "tiny", "--serve"]
    assert warm.argv == modelsfile.load_registry(write_file(text)).get("tiny").argv  # inherited
    assert not modelsfile.load_registry(write_file(text)).get("tiny").persistent
    builtin = modelsfile.load_registry()
    assert builtin.get("relief-warm").persistent
    assert builtin.get("relief-warm").params.keys() == builtin.get("relief").params.keys()


CHAIN = """
[models.a]
extends = "tiny"
timeout_s = 7

[models.b]
extends = "a"
max_attempts = 3
"""


@pytest.mark.parametrize(
    ("text", "model"),
    [
        (TINY + CHAIN, "b"),  # b extends a, which extends tiny: refused, whichever comes first
        (TINY + "\n".join(reversed(CHAIN.split("\n\n"))), "b"),
        (TINY + '[models.me]\nextends = "me"\n', "me"),
    ],
    ids=["chain", "chain_written_the_other_way", "itself"],
)
def test_extends_names_another_model_that_extends_nothing(
    write_file: WriteFile, text: str, model: str
) -> None:
    with pytest.raises(errors.RegistryError) as caught:
        modelsfile.load_registry(write_file(text))
    message = caught.value.message
    assert f"model '{model}': field 'extends': must name another model" in message, message


def test_a_model_extending_another_changes_only_the_parameters_it_names(write_file: WriteFile) -> None:
    """A child redefining one `params.<x>` table lost all of its parent's parameters, and failed
    with a confusing message about the argv's placeholders (`{label}` is no parameter)."""
    text = TINY + '[models.short]\nextends = "tiny"\n[models.short.params.steps]\ntype = "int"\nmax = 5\n'
    short = modelsfile.load_registry(write_file(text)).get("short")
    assert short.params.keys() == modelsfile.load_registry(write_file(TINY)).get("tiny").params.keys()
    assert (short.params["steps"].max, short.params["steps"].default) == (5, None)  # replaced whole
    assert short.params["label"].default == "plain"


def test_braces_in_serve_argv_are_written_as_in_argv(write_file: WriteFile) -> None:
    """{{ and }} stand for one brace in serve_argv too, as the template check says and argv does."""
    text = TINY.replace(
        "[models.tiny]\n",
        '[models.tiny]\nmode = "persistent"\nserve_argv = ["{python}", "--opts={{\\"a\\": 1}}"]\n',
        1,
    )
    spec = modelsfile.load_registry(write_file(text)).get("tiny")
    assert spec.build_serve_argv(python="py") == ["py", '--opts={"a": 1}']


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ('mode = "sometimes"', "mode"),
        ('mode = "persistent"', "serve_argv"),
        ('mode = "persistent"\nserve_argv = ["{python}", "{input}"]', "serve_argv[1]"),
        ('extends = "nobody"', "extends"),
        ("load_timeout_s = 0", "load_timeout_s"),
        ("idle_vram_mb = 3000000000", "idle_vram_mb"),
    ],
)
def test_bad_persistent_fields_are_named(write_file: WriteFile, extra: str, field: str) -> None:
    text = TINY.replace("[models.tiny]\n", f"[models.tiny]\n{extra}\n", 1)
    with pytest.raises(errors.RegistryError) as caught:
        modelsfile.load_registry(write_file(text))
    assert f"field '{field}'" in caught.value.message or field in caught.value.message


def test_the_built_in_files_header_names_every_field() -> None:
    """docs/models.md says the header of app/models.toml documents every field; seven of a
    model's (the out-of-memory rules, `extends` and the warm runner's four) were not there."""
    text = (Path(registry.__file__).parent / "models.toml").read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    fields = modelsfile._MODEL_KEYS | modelsfile._VRAM_KEYS | modelsfile._PARAM_KEYS | modelsfile._OUTPUT_KEYS
    assert [name for name in sorted(fields) if not re.search(rf"\b{name}\b", header)] == []
