import pytest

from numerals import to_roman


def test_additive():
    assert to_roman(3) == "III"
    assert to_roman(2026) == "MMXXVI"


def test_subtractive_pairs():
    assert to_roman(4) == "IV"
    assert to_roman(9) == "IX"
    assert to_roman(40) == "XL"
    assert to_roman(1994) == "MCMXCIV"


def test_out_of_range():
    with pytest.raises(ValueError):
        to_roman(0)
