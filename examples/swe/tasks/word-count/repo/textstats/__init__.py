"""Small text statistics."""


def word_count(text: str) -> int:
    """Number of words in `text` (words are separated by whitespace)."""
    return len(text.split(" "))


def longest_word(text: str) -> str:
    """The longest word of `text` (the first of equal length); "" for no words."""
    words = text.split()
    return max(words, key=len) if words else ""
