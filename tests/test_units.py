"""Memory sizes: parse_bytes reads what users write in max_memory and hardware specs; format_bytes prints it back."""

from __future__ import annotations

import pytest

from pipemap import MemorySpecError, PipemapError, format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0B", 0),
        ("512B", 512),
        ("1KB", 1000),
        ("500MB", 500 * 1000**2),
        ("24GB", 24 * 1000**3),
        ("2TB", 2 * 1000**4),
        ("1KiB", 1024),
        ("512MiB", 512 * 1024**2),
        ("24GiB", 24 * 1024**3),
        ("1TiB", 1024**4),
        ("1024", 1024),
        ("1.5GiB", 1610612736),
        ("1.5GB", 1_500_000_000),
        ("0.5KiB", 512),
        ("2.01KB", 2010),  # float("2.01") * 1000 is 2009.99...: must not truncate to 2009
        ("4.35GB", 4_350_000_000),
        ("24gib", 24 * 1024**3),
        (" 24 GiB ", 24 * 1024**3),
    ],
)
def test_parse_bytes_strings(text, expected):
    assert parse_bytes(text) == expected


def test_kb_is_powers_of_1000_and_kib_of_1024():
    assert parse_bytes("1GB") == 10**9
    assert parse_bytes("1GiB") == 2**30
    assert parse_bytes("1MB") < parse_bytes("1MiB")


@pytest.mark.parametrize("value", [0, 1, 1024, 24 * 1024**3])
def test_parse_bytes_plain_ints(value):
    assert parse_bytes(value) == value


@pytest.mark.parametrize("value", ["", "GiB", "abc", "24 GiBs", "24XB", "-1GiB", "1.2.3MB", "1e9", -1, True, None,
                                   [24]])
def test_parse_bytes_bad_input(value):
    with pytest.raises(MemorySpecError) as info:
        parse_bytes(value)
    assert info.value.text == value
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, PipemapError)
    assert "24GiB" in str(info.value)  # the message shows what to write instead


def test_memory_spec_error_is_caught_as_value_error():
    with pytest.raises(ValueError):
        parse_bytes("lots")


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (5 * 1024**2, "5.00 MiB"),
        (3 * 2**30, "3.00 GiB"),
        (1024**4, "1024.00 GiB"),
    ],
)
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


def test_format_then_parse_round_trip():
    for n in (1024, 5 * 1024**2, 3 * 2**30):
        assert parse_bytes(format_bytes(n).replace(" ", "")) == n
