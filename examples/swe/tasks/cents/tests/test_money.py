from money import format_cents, parse_amount


def test_positive():
    assert format_cents(1234) == "12.34"
    assert format_cents(5) == "0.05"


def test_negative():
    assert format_cents(-250) == "-2.50"
    assert format_cents(-5) == "-0.05"


def test_round_trip():
    for cents in [0, 7, -7, 199, -199, 100000]:
        assert parse_amount(format_cents(cents)) == cents


def test_parse():
    assert parse_amount("-2.5") == -250
    assert parse_amount("7") == 700
