"""Amounts of money held as integer cents."""


def format_cents(cents: int) -> str:
    """`cents` as a decimal amount: 1234 -> "12.34", 5 -> "0.05", -250 -> "-2.50"."""
    return f"{cents // 100}.{cents % 100:02d}"


def parse_amount(text: str) -> int:
    """A decimal amount ("12.34", "-2.5", "7") as integer cents."""
    sign = -1 if text.startswith("-") else 1
    whole, _, frac = text.lstrip("+-").partition(".")
    return sign * (int(whole or "0") * 100 + int((frac + "00")[:2]))
