import pytest

from chunkflow_planner.units import UnitError, format_bytes, parse_duration, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GB", 24 * 10**9),
        ("24gb", 24 * 10**9),
        ("24GiB", 24 * 2**30),
        ("24 gib", 24 * 2**30),
        ("16MB", 16 * 10**6),
        ("16MiB", 16 * 2**20),
        ("1.5KB", 1500),
        ("4KiB", 4096),
        ("4096", 4096),  # a plain integer of at least 1024 is bytes
        ("512B", 512),
        (1024, 1024),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24XB", "GB", "", "twelve", "24 G B", "-5GB", "0GB", "0", "0.1B", True, "512", "1.25"])
def test_parse_size_rejects(text):
    with pytest.raises(UnitError):
        parse_size(text)


def test_parse_size_message_lists_units():
    with pytest.raises(UnitError, match="KiB"):
        parse_size("3 parsecs")


@pytest.mark.parametrize("text, expected", [("1.2s", 1.2), ("850ms", 0.85), ("2", 2.0), ("1min", 60.0)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["0s", "-1s", "fast", "3 hours"])
def test_parse_duration_rejects(text):
    with pytest.raises(UnitError):
        parse_duration(text)


def test_format_bytes_round_trips_through_parse():
    assert format_bytes(24e9) == "24.00 GB"
    assert format_bytes(24 * 2**30, binary=True) == "24.00 GiB"
    assert parse_size(format_bytes(327.31e6).replace(" ", "")) == pytest.approx(327.31e6, rel=1e-4)
