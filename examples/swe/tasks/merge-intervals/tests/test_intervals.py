from intervals import merge, total_length


def test_overlapping():
    assert merge([(5, 8), (1, 3), (2, 4)]) == [(1, 4), (5, 8)]


def test_touching_intervals_merge():
    assert merge([(1, 2), (2, 3)]) == [(1, 3)]


def test_total_length_of_touching():
    assert total_length([(0, 5), (5, 10)]) == 10
    assert merge([(0, 5), (5, 10), (12, 13)]) == [(0, 10), (12, 13)]


def test_empty():
    assert merge([]) == []
