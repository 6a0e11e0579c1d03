"""intake.fingerprint: one digest per request as sent, whatever way its JSON was written."""

from __future__ import annotations

import pytest

from app import errors, intake


def digest(params: str, model: str = "m", priority: int = 0) -> str:
    return intake.fingerprint(model, intake.parse_params(params), priority)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ('{"a": 1, "b": [1, 2]}', '{"b":[1,2],"a":1}'),  # key order, spaces
        ('{"x": 80}', '{"x": 80.0}'),  # one number to JSON
        ('{"x": 1e23}', '{"x": 100000000000000000000000}'),
        ('{"x": 0}', '{"x": -0.0}'),
        ('{"s": "é"}', '{"s": "\\u00e9"}'),
        ("", "{}"),
    ],
)
def test_the_same_request_written_otherwise_has_one_digest(one, other):
    assert digest(one) == digest(other)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ('{"x": 1}', '{"x": true}'),
        ('{"x": 1}', '{"x": "1"}'),
        ('{"x": null}', "{}"),
        ('{"x": [1]}', '{"x": 1}'),
        ('{"x": 12345678901234567890123456789012}', '{"x": 12345678901234567890123456789013}'),
        ('{"x": 0.1}', '{"x": 0.10000000000000002}'),
    ],
)
def test_other_params_have_another_digest(one, other):
    assert digest(one) != digest(other)


def test_model_and_priority_count():
    assert len({digest("{}"), digest("{}", model="n"), digest("{}", priority=1)}) == 3


def test_params_nested_too_deeply_are_refused():
    deep: list[object] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(errors.InvalidParams, match="nested too deeply"):
        intake.fingerprint("m", {"x": deep}, 0)


@pytest.mark.parametrize(
    ("raw", "field", "message"),
    [
        (
            '{"width_mm": 80, "width_mm": 90}',
            "params.width_mm",
            "params.width_mm: given 2 times; send it once",
        ),
        ('{"a": 1, "a": 1, "a": 2}', "params.a", "params.a: given 3 times; send it once"),
        (
            '{"a": [{"x": 1}, {"x": 2, "x": 3}]}',
            "params",
            "params: key 'x' is given 2 times in a nested object",
        ),
    ],
)
def test_a_key_repeated_in_params_is_refused_naming_it(raw, field, message):
    """`{"width_mm": 80, "width_mm": 90}` was taken as 90 without a word, as a form field sent twice
    took its last value before: the model ran with a value the client may not have meant."""
    with pytest.raises(errors.InvalidParams) as caught:
        intake.parse_params(raw)
    assert caught.value.field == field
    assert caught.value.message.startswith(message)
