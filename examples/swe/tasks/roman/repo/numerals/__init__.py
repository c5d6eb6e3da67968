"""Roman numerals."""

_VALUES = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


def to_roman(n: int) -> str:
    """`n` (1 to 3999) as a Roman numeral."""
    if not 1 <= n <= 3999:
        raise ValueError(f"{n} is outside 1..3999")
    out = []
    for value, letters in _VALUES:
        count, n = divmod(n, value)
        out.append(letters * count)
    return "".join(out)
