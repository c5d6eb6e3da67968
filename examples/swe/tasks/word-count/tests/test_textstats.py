from textstats import longest_word, word_count


def test_single_spaces():
    assert word_count("the quick brown fox") == 4


def test_runs_of_whitespace():
    assert word_count("the  quick\tbrown\n fox ") == 4


def test_empty_text_has_no_words():
    assert word_count("") == 0
    assert word_count("   ") == 0


def test_longest_word():
    assert longest_word("a bb ccc dd") == "ccc"
    assert longest_word("") == ""
